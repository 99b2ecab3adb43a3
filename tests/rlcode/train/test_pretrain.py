"""rlcode.train.pretrain: the data order, the held-out bits per byte against an independent float64
computation on each file alone, and the whole job on a tiny corpus (learning, TensorBoard tags,
resume equal to an uninterrupted run, the Hugging Face export)."""

import collections
import json
import math
import os
import signal

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from support import job_config
from support.tiny_corpus import texts, write_corpus

from rlcode.checks import ConfigError
from rlcode.data import bpe
from rlcode.models import hf
from rlcode.models.transformer import init_model
from rlcode.tokenizer import ByteTokenizer, load_tokenizer
from rlcode.train import pretrain
from rlcode.train.metrics import read_jsonl, read_scalars
from rlcode.train.step import make_logprob_fn
from rlcode.train.workdir import load_run_model

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def load_config(arg=None):
    return job_config("pretrain_code", arg)


def tiny_config(tmp_path, steps=6, tokenizer="byte", **data):
    cfg = load_config("tokenizer=byte")
    cfg.workdir = str(tmp_path / "run")
    cfg.tokenizer = tokenizer
    cfg.model.update(d_model=32, num_layers=1, num_heads=2, num_kv_heads=1, head_dim=16, ffw_dim=64)
    cfg.data.update(corpus_dir=str(tmp_path / "corpus"), seq_len=64, rows_per_step=4, eval_batch=4, **data)
    cfg.train.steps = steps
    cfg.optim.update(lr=3e-3, warmup_steps=1)
    cfg.eval.every = 3
    cfg.checkpoint.update(every=2, keep=5)
    return cfg


@pytest.mark.parametrize("rows,B", [(10, 4), (7, 7), (5, 3)])
def test_batches_cover_every_row_once_per_epoch_and_count_tokens(rows, B):
    ids = np.concatenate([pretrain.batch_rows(c, B, rows, seed=3) for c in range(6 * rows)])
    for e in range(6 * B):  # every epoch, across batch boundaries, is a permutation of the rows
        assert sorted(ids[e * rows:(e + 1) * rows].tolist()) == list(range(rows))
    assert np.array_equal(pretrain.batch_rows(5, B, rows, seed=3), ids[5 * B:6 * B])  # a resumed run's batch
    assert not np.array_equal(pretrain.batch_rows(0, B, rows, seed=4), pretrain.batch_rows(0, B, rows, seed=3)) \
        or rows == B
    packed = pretrain.pack_texts(texts(rows), ByteTokenizer(), 64)
    data = pretrain.PackedCorpus(packed.packed, rows)
    n = data.rows
    for count in (0, 1, 3, 2 * n + 1):
        seen = np.concatenate([pretrain.batch_rows(c, B, n, 3) for c in range(count)]) if count else np.zeros(0, int)
        assert pretrain.tokens_before(count, B, data, 3) == int(data.packed.mask.sum(1)[seen].sum())


def test_heldout_bits_per_byte_equal_each_file_alone_in_float64(tmp_path):
    tok = bpe.save(bpe.train(texts(30, seed=1), 300), str(tmp_path / "tok"))
    docs = texts(7, seed=2) + ["x = 'caf\u00e9 \u2713'\n"]  # multi-byte characters count as their UTF-8 bytes
    data = pretrain.pack_texts(docs, tok, 48)
    assert data.rows >= 3 and (data.packed.segment_ids.max(1) >= 2).any()
    model_cfg = tiny_config(tmp_path).model
    model_cfg.vocab_size = 300
    model = init_model(model_cfg, seed=1)
    graphdef, state = nnx.split(model)
    got = pretrain.heldout_loss(make_logprob_fn(graphdef), nnx.to_pure_dict(state), data, batch=2)
    # Oracle: each file alone (BOS, the text, EOS), logits in float64 from the model's hidden states,
    # cut into pieces of 48 predictions as the packing does.
    nll, tokens, n_bytes = 0.0, 0, 0
    w, layout = model.unembedding()
    w = np.asarray(w, np.float64) if layout == "dv" else np.asarray(w, np.float64).T  # [D, V]
    # One compiled causal forward of 48 positions: a piece's trailing padding cannot reach it.
    hidden = jax.jit(lambda ids: nnx.merge(graphdef, state)(ids, jnp.arange(48)[None]).hidden[0])
    for text in docs:
        ids = [tok.bos_id] + tok.encode(text) + [tok.eos_id]
        for start in range(0, len(ids) - 1, 48):
            piece = ids[start:start + 49]
            n = len(piece) - 1
            h = hidden(jnp.asarray(piece[:-1] + [0] * (48 - n))[None])[:n]
            logits = np.asarray(h, np.float64) @ w
            lse = np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1)) + logits.max(-1)
            nll += float(np.sum(lse - logits[np.arange(len(piece) - 1), piece[1:]]))
            tokens += len(piece) - 1
        n_bytes += len(text.encode("utf-8"))
    assert got["tokens"] == tokens and got["bytes"] == n_bytes  # every byte of every file is a target
    assert abs(got["nll"] - nll / tokens) < 1e-4 * got["nll"]
    assert abs(got["bpb"] - nll / math.log(2) / n_bytes) < 1e-4 * got["bpb"]


def test_repeated_rows_repeat_each_rows_first_span_as_one_document():
    packed = pretrain.pack_texts(texts(6, seed=4), ByteTokenizer(), 40).packed
    rows, spans = np.array([0, 2, 1]), np.array([5, 40, 13])
    rep = pretrain.repeated_rows(packed, rows, spans)
    for i, (r, n) in enumerate(zip(rows, spans)):  # the naive loop
        stream = list(packed.inputs[r]) + [packed.targets[r, -1]]
        want = [stream[t % n] for t in range(41)]
        assert list(rep["inputs"][i]) == want[:40] and list(rep["targets"][i]) == want[1:]
        assert list(rep["repeat"][i]) == [t + 1 >= n for t in range(40)]
    assert rep["mask"].all() and (rep["segment_ids"] == 1).all()
    assert (rep["positions"] == np.arange(40)).all()
    # with_repeats: about the asked share of rows is replaced, the same rows on a rerun of the step.
    ids = np.arange(packed.inputs.shape[0])
    b = pretrain.with_repeats(packed, ids, 0.5, 16, count=3, seed=0)
    again = pretrain.with_repeats(packed, ids, 0.5, 16, count=3, seed=0)
    assert np.array_equal(np.asarray(b["inputs"]), np.asarray(again["inputs"]))
    plain = pretrain.train_batch(packed, ids)
    changed = [i for i in ids if not np.array_equal(np.asarray(b["inputs"][i]), np.asarray(plain["inputs"][i]))]
    assert changed and len(changed) < len(ids)
    for i in changed:
        row = np.asarray(b["inputs"][i])
        n = next(n for n in range(2, 17) if np.array_equal(row[n:], row[:-n]))  # periodic with a span <= 16
        assert n >= 2 and (np.asarray(b["segment_ids"][i]) == 1).all()
    assert np.array_equal(np.asarray(pretrain.with_repeats(packed, ids, 0.0, 16, 3, 0)["inputs"]),
                          np.asarray(plain["inputs"]))


def test_shuffled_and_uniform_repeats_draw_the_span_at_random():
    """repeat_tokens: "shuffled" repeats a random sample of the row's own tokens (a sub-multiset
    of them, not the row's first span); "uniform" repeats ids drawn from the given vocabulary,
    whatever the row holds. Both stay one periodic document, and a rerun of a step is the same."""
    packed = pretrain.pack_texts(texts(6, seed=4), ByteTokenizer(), 40).packed
    rows, spans = np.array([0, 2, 1, 3]), np.array([5, 40, 13, 20])
    vocab = np.array([300, 301, 302, 303, 304, 305, 306, 307])  # ids no byte text holds
    shuffled = pretrain.repeated_rows(packed, rows, spans, "shuffled", np.random.default_rng(0))
    uniform = pretrain.repeated_rows(packed, rows, spans, "uniform", np.random.default_rng(0), vocab)
    differs = 0
    for i, (r, n) in enumerate(zip(rows, spans)):
        stream = list(packed.inputs[r]) + [packed.targets[r, -1]]
        for rep in (shuffled, uniform):
            span = list(rep["inputs"][i][:n])
            want = [span[t % n] for t in range(41)]
            assert list(rep["inputs"][i]) == want[:40] and list(rep["targets"][i]) == want[1:]
        pool = list(stream)
        for t in shuffled["inputs"][i][:n]:  # every token of the span is one of the row's, used at most as often
            pool.remove(t)
        differs += list(shuffled["inputs"][i][:n]) != stream[:n]
        assert set(uniform["inputs"][i]) <= set(vocab.tolist())
    assert differs >= 3
    assert len(set(uniform["inputs"][1].tolist())) == len(vocab)  # 40 draws of 8 ids: all of them
    with pytest.raises(ValueError, match="tokens='random'"):
        pretrain.repeated_rows(packed, rows, spans, "random")
    with pytest.raises(ValueError, match="tokens='uniform' needs rng and vocab"):
        pretrain.repeated_rows(packed, rows, spans, "uniform", np.random.default_rng(0))
    ids = np.arange(packed.inputs.shape[0])
    assert set(pretrain.split_vocab(packed).tolist()) == {t for row in texts(6, seed=4) for t in ByteTokenizer().encode(row)} | {
        ByteTokenizer().eos_id}
    batches = {kind: np.asarray(pretrain.with_repeats(packed, ids, 0.5, 16, 3, 0, kind, vocab)["inputs"])
               for kind in pretrain.REPEAT_TOKENS}
    for kind in pretrain.REPEAT_TOKENS:  # a rerun of the step: the same rows
        assert np.array_equal(batches[kind], pretrain.with_repeats(packed, ids, 0.5, 16, 3, 0, kind, vocab)["inputs"])
    assert not np.array_equal(batches["span"], batches["shuffled"])
    assert not np.array_equal(batches["span"], batches["uniform"])


@pytest.mark.slow
@pytest.mark.parametrize("kind", pretrain.REPEAT_TOKENS)
def test_the_job_trains_on_the_repeats_its_config_asks_for(tmp_path, kind):
    """data.repeat_* reach the train step: with every row repeated, each row of the step's batch
    is periodic with a span in [repeat_span // 8, repeat_span], its ids those the kind draws from
    (the row's first span, a sample of the row's tokens, or the train split's vocabulary)."""
    built = write_corpus(tmp_path / "corpus")
    cfg = tiny_config(tmp_path, steps=2, repeat_fraction=1.0, repeat_span=16, repeat_tokens=kind)
    cfg.eval.update(at_start=False, at_end=False)
    seen = []
    pretrain.run(cfg, log=lambda m: None, hooks={"batch": lambda step, b: seen.append(b) or b})
    train = pretrain.pack_texts(built.texts("train"), ByteTokenizer(), 64)
    vocab = set(pretrain.split_vocab(train.packed).tolist())
    assert len(seen) == 2
    differs = 0
    for count, b in enumerate(seen):
        rows = pretrain.batch_rows(count, 4, train.rows, cfg.seed)
        for i, r in enumerate(rows):
            seq = np.append(np.asarray(b["inputs"][i]), np.asarray(b["targets"][i, -1]))
            n = next(n for n in range(1, 65) if np.array_equal(seq[n:], seq[:-n]))
            assert 2 <= n <= 16 and np.asarray(b["mask"][i]).all() and (np.asarray(b["segment_ids"][i]) == 1).all()
            own = np.append(train.packed.inputs[r], train.packed.targets[r, -1])
            if kind == "span":
                assert np.array_equal(seq[:n], own[:n])
            elif kind == "shuffled":
                differs += not np.array_equal(seq[:n], own[:n])
                assert not collections.Counter(seq[:n].tolist()) - collections.Counter(own.tolist())
            else:
                assert set(seq.tolist()) <= vocab and not np.array_equal(seq[:n], own[:n])
    assert kind != "shuffled" or differs >= 4  # not the rows' first spans


def test_heldout_copy_tells_a_copying_model_from_one_that_does_not(tmp_path):
    """The copy metric is the NLL of the first copy and of the repeats: for a model whose
    log-probs come from a lookup of the previous occurrence it falls on the repeats; for
    a fresh model it does not."""
    data = pretrain.pack_texts(texts(12, seed=5), ByteTokenizer(), 256)
    model_cfg = tiny_config(tmp_path).model
    model = init_model(model_cfg, seed=0)
    graphdef, state = nnx.split(model)
    fresh = pretrain.heldout_copy(make_logprob_fn(graphdef), nnx.to_pure_dict(state), data, batch=4, span=32)
    assert abs(fresh["copy_repeat_nll"] - fresh["copy_first_nll"]) < 0.1 * fresh["copy_first_nll"]

    def oracle(params, b):  # knows each row's period: the repeats are certain, the first copy is not
        inputs = np.asarray(b["inputs"])
        logp = np.where(np.arange(inputs.shape[1])[None, :] + 1 >= 32, 0.0, -3.0)
        return jnp.asarray(np.broadcast_to(logp, inputs.shape)), None

    copying = pretrain.heldout_copy(oracle, None, data, batch=4, span=32)
    assert copying == {"copy_first_nll": 3.0, "copy_repeat_nll": 0.0}


def test_config_errors_name_the_field(tmp_path):
    write_corpus(tmp_path / "corpus")
    cfg = tiny_config(tmp_path)
    pretrain.validate_config(cfg, 1)
    for field, value, text in [("data.rows_per_step", 3, "not divisible by train.microbatches=2"),
                               ("model.value_head", True, "value head"),
                               ("model.vocab_size", 100, "tokenizer's 320")]:
        bad = tiny_config(tmp_path)
        bad.train.microbatches = 2 if field == "data.rows_per_step" else 1
        node, _, name = field.rpartition(".")
        bad[node][name] = value
        with pytest.raises(ConfigError, match=text):
            pretrain.validate_config(bad, 1)
    bad = tiny_config(tmp_path)
    bad.data.seqlen = 8
    with pytest.raises(ConfigError, match="seqlen.*seq_len"):
        pretrain.validate_config(bad, 1)
    with pytest.raises(ConfigError, match="data.eval_batch = 4 rows is not divisible .* 8 devices"):
        bad = tiny_config(tmp_path)
        bad.data.rows_per_step = 8
        pretrain.validate_config(bad, 8)


def test_job_learns_logs_resumes_exactly_and_exports(tmp_path):
    built = write_corpus(tmp_path / "corpus")
    tok_dir = str(tmp_path / "corpus" / "tokenizer")
    bpe.save(bpe.train(built.texts("train"), 320), tok_dir)
    # An uninterrupted run of 6 steps.
    full = tiny_config(tmp_path, tokenizer=tok_dir)
    full.workdir = str(tmp_path / "full")
    result = pretrain.run(full, log=lambda m: None)
    assert result.completed and result.steps_done == 6
    scalars = read_scalars(tmp_path / "full" / "tb")
    for tag in ("train/bpb", "heldout/bpb", "heldout/nll", "heldout/copy_first_nll", "heldout/copy_repeat_nll",
                "data/epoch", "data/tokens", "throughput/train_tokens_per_s", *pretrain.JOB.summary_metrics(full)):
        assert tag in scalars, tag
    assert [s for s, _ in scalars["heldout/bpb"]] == [0, 3, 6]
    heldout = [v for _, v in scalars["heldout/bpb"]]
    assert heldout[-1] < heldout[0] - 0.3  # it learns: these files are very regular
    # train/bpb is the step's NLL over its targets' bytes.
    per_token = [v for _, v in scalars["data/bytes_per_token"]]
    nll = [v for _, v in scalars["train/policy_loss"]]
    np.testing.assert_allclose([v for _, v in scalars["train/bpb"]],
                               np.array(nll) / math.log(2) / np.array(per_token), rtol=1e-6)

    # The same run stopped by a signal after step 3, then resumed: identical parameters.
    part = tiny_config(tmp_path, tokenizer=tok_dir)

    def stop_at_step_3(step, batch):
        if step == 2:
            os.kill(os.getpid(), signal.SIGINT)
        return batch

    first = pretrain.run(part, log=lambda m: None, hooks={"batch": stop_at_step_3})
    assert first.interrupted and first.steps_done == 3
    part.resume = True
    second = pretrain.run(part, log=lambda m: None)
    assert second.completed and second.steps_done == 6
    _, a, _ = load_run_model(str(tmp_path / "full"))
    _, b, _ = load_run_model(str(tmp_path / "run"))
    for x, y in zip(jax.tree.leaves(nnx.state(a)), jax.tree.leaves(nnx.state(b))):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    records = [r for r in read_jsonl(tmp_path / "run" / "tb") if "train/loss" in r]
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5, 6]

    # The export: a Hugging Face checkpoint equal to the last checkpoint, with the run's tokenizer.
    base = tmp_path / "full" / pretrain.BASE_DIR
    loaded = hf.load_checkpoint(str(base), dtype="float32")
    for x, y in zip(jax.tree.leaves(nnx.state(loaded, nnx.Param)), jax.tree.leaves(nnx.state(a, nnx.Param))):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    tok = load_tokenizer(str(base))
    assert tok.encode("def f(x):\n    return x\n") == load_tokenizer(tok_dir).encode("def f(x):\n    return x\n")
    report = json.load(open(base / pretrain.REPORT))
    assert report["step"] == 6 and report["heldout_step"] == 6
    assert report["heldout"]["bpb"] == pytest.approx(heldout[-1])
    assert report["tokens"] == pytest.approx(scalars["data/tokens"][-1][1]) and report["tokens"] > 0
    assert report["parameters"] == sum(np.size(x) for x in jax.tree.leaves(nnx.state(a, nnx.Param)))
    assert report["corpus"]["splits"]["train"]["files"] == len(built.splits["train"])


def test_the_committed_base_loads_with_its_tokenizer_and_report():
    base = os.path.join(ROOT, "checkpoints", "code_base")
    model = hf.load_checkpoint(base, dtype="float32")
    tok = load_tokenizer(base)
    with open(os.path.join(base, pretrain.REPORT), encoding="utf-8") as f:
        report = json.load(f)
    assert report["step"] == report["steps"] and report["heldout_step"] == report["step"]
    assert report["parameters"] == sum(np.size(x) for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    assert model.cfg.vocab_size == tok.vocab_size and report["config"]["model"]["vocab_size"] == tok.vocab_size
    text = "def add(a, b):\n    return a + b\n"
    assert tok.decode(tok.encode(text)) == text and len(tok.encode(text)) < len(text) / 2
    # It knows some Python: the body of this function is far likelier than under a fresh model.
    ids = [tok.bos_id] + tok.encode(text) + [tok.eos_id]
    fresh = init_model(hf.resolve_model_section(dict(load_config().model.to_dict(), init_from=base)), seed=0)
    nll = {}
    for name, m in (("base", model), ("fresh", fresh)):
        graphdef, state = nnx.split(m)
        batch = {"inputs": jnp.asarray([ids[:-1]]), "targets": jnp.asarray([ids[1:]]),
                 "positions": jnp.arange(len(ids) - 1)[None], "kv_lengths": jnp.asarray([len(ids) - 1])}
        logp, _ = make_logprob_fn(graphdef)(nnx.to_pure_dict(state), batch)
        nll[name] = -float(jnp.mean(logp))
    assert nll["base"] < nll["fresh"] - 3.0, nll
