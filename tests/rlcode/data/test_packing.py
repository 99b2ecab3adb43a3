"""rlcode.data.packing: rows of packed documents against an independent unpacking, the model's
predictions packed equal to each document alone (dense and squid attention), and exact byte
counts for bits per byte."""

import itertools

import jax.numpy as jnp
import numpy as np
import pytest
from support.forward import forward

from rlcode.data import bpe, corpus, packing
from rlcode.models.attention import AttentionMask
from rlcode.models.transformer import init_model, model_config
from rlcode.tokenizer import ByteTokenizer


def unpack(p: packing.Packed):
    """(inputs, targets) of every segment, in row order, read back independently of `pack`."""
    out = []
    for r in range(p.inputs.shape[0]):
        for s in sorted(set(p.segment_ids[r].tolist()) - {0}):
            where = np.flatnonzero(p.segment_ids[r] == s)
            assert np.array_equal(where, np.arange(where[0], where[0] + len(where)))  # contiguous
            assert np.array_equal(p.positions[r, where], np.arange(len(where)))
            out.append((p.inputs[r, where].tolist(), p.targets[r, where].tolist()))
    return out


@pytest.mark.parametrize("length", [1, 5, 16, 64])
def test_rows_hold_every_prediction_once_in_order(length):
    rng = np.random.default_rng(length)
    docs = [rng.integers(3, 200, n).tolist() for n in rng.integers(0, 90, 40)] + [[7], []]
    p = packing.pack(docs, length, np.ones(320, np.int32), pad_id=1)
    want = []  # each document's pairs, cut into pieces of at most `length` predictions
    for d in docs:
        pairs = list(zip(d[:-1], d[1:]))
        want += [([a for a, _ in pairs[i:i + length]], [b for _, b in pairs[i:i + length]])
                 for i in range(0, len(pairs), length)]
    assert unpack(p) == want
    assert p.inputs.shape[1] == length and p.mask.sum() == sum(max(len(d) - 1, 0) for d in docs)
    assert np.array_equal(p.mask, (p.segment_ids > 0).astype(np.float32))
    assert np.all(p.inputs[p.segment_ids == 0] == 1) and np.array_equal(p.target_bytes, p.mask.astype(np.int32))
    # Rows are filled greedily: the first piece of each row did not fit the row before it.
    used = (p.segment_ids > 0).sum(1)
    for r in range(1, len(used)):
        first = int((p.segment_ids[r] == 1).sum())
        assert used[r - 1] + first > length
    with pytest.raises(ValueError, match="length must be >= 1"):
        packing.pack(docs, 0, np.ones(320, np.int32))


@pytest.mark.parametrize("kind", ["dense", "squid"])
def test_packed_predictions_equal_each_document_alone(kind):
    cfg = model_config(vocab_size=64, d_model=32, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, ffw_dim=64,
                       attention={"kind": kind, **({"impl": "xla"} if kind == "squid" else {})})
    model = init_model(cfg, seed=3)
    rng = np.random.default_rng(0)
    docs = [rng.integers(3, 64, n).tolist() for n in (9, 4, 17, 2, 12)]
    p = packing.pack(docs, 24, np.ones(64, np.int32))
    assert p.inputs.shape[0] >= 2 and (p.segment_ids.max(1) >= 2).any()  # some row holds several documents
    packed = forward(model, jnp.asarray(p.inputs), jnp.asarray(p.positions), packing.attention_mask(p, kind)).hidden
    for r in range(p.inputs.shape[0]):
        for s in sorted(set(p.segment_ids[r].tolist()) - {0}):
            where = np.flatnonzero(p.segment_ids[r] == s)
            alone = forward(model, jnp.asarray(p.inputs[r, where])[None], jnp.arange(len(where))[None],
                            AttentionMask()).hidden[0]
            np.testing.assert_allclose(np.asarray(packed[r, where]), np.asarray(alone), atol=2e-5, rtol=2e-5)
    with pytest.raises(ValueError, match="'dense' or 'squid'"):
        packing.attention_mask(p, "nsa")


def test_target_bytes_count_the_text_exactly(tmp_path):
    docs = [d.text for d in itertools.islice(corpus.stdlib_documents(), 12)]
    tok = bpe.save(bpe.train(docs[:10], 700), str(tmp_path / "tok"))
    sizes = packing.token_bytes(tok)
    assert sizes[: 7].sum() == 0 and sizes.shape == (700,)
    for text in docs[10:] + ["é😀 x\n\tz = 'ü'\r\n"]:
        ids = tok.encode(text)
        assert sizes[ids].sum() == len(text.encode("utf-8"))
        p = packing.pack([ids], 4096, sizes)  # every token but the first is a target
        assert (p.target_bytes * p.mask).sum() == len(text.encode("utf-8")) - sizes[ids[0]]
    byte_sizes = packing.token_bytes(ByteTokenizer())
    assert byte_sizes[:256].sum() == 256 and byte_sizes[256:].sum() == 0


@pytest.mark.parametrize("length", [5, 64, 200])
def test_best_fit_holds_the_same_pieces_in_fewer_rows(length):
    rng = np.random.default_rng(length + 1)
    docs = [rng.integers(3, 200, n).tolist() for n in rng.integers(0, 400, 60)] + [[7], []]
    greedy = packing.pack(docs, length, np.ones(320, np.int32), pad_id=1)
    best = packing.pack(docs, length, np.ones(320, np.int32), pad_id=1, fit="best")
    assert sorted(unpack(best)) == sorted(unpack(greedy))  # the same pieces, each once
    assert best.mask.sum() == greedy.mask.sum() and (best.segment_ids > 0).sum(1).max() <= length
    assert best.inputs.shape[0] <= greedy.inputs.shape[0]
    # Best fit: no piece fits the free room of a row created before the one it went into, at
    # the time it was placed; checked at the end, where rooms are smaller still.
    used = (best.segment_ids > 0).sum(1)
    firsts = [int((best.segment_ids[r] == 1).sum()) for r in range(len(used))]
    for r in range(1, len(used)):
        assert all(used[q] + firsts[r] > length for q in range(r))
    with pytest.raises(ValueError, match="fit must be"):
        packing.pack(docs, length, np.ones(320, np.int32), fit="first")
