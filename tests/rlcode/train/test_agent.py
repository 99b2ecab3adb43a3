"""The agent job's sampler, batcher and training layout (rlcode.train.agent).

The oracle for the sampler is the training forward: the log-probs the session sampler reports for
the tokens it sampled (prefilled turn by turn, with documents copied from their cache under squid
attention) must equal those the train step recomputes from the finished episode's sequence with
its segment layout."""

import argparse
import json
import math
import os
import re
import types

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest
from flax import nnx

from support.forward import forward
from support.local_executor import LocalExecutor

from configs.agent_repo import get_config
from support.field_checks import check_every_field
from rlcode.checks import ConfigError
from rlcode.envs import harness
from rlcode.envs.tasks import repo as repo_tasks
from rlcode.models.attention import AttentionMask
from rlcode.models.transformer import init_model, model_config
from rlcode.tokenizer import ByteTokenizer
from rlcode import session_sampling
from rlcode.train import agent, demonstrations
from rlcode.train import workdir as workdir_lib
from rlcode.train.engine import resolve_config
from rlcode.train import episodes as episodes_lib
from rlcode.train.step import make_logprob_fn

TOK = ByteTokenizer()


def dict_config(cfg, **task):
    """A copy of `cfg` with `task` fields changed."""
    out = ml_collections.ConfigDict(cfg.to_dict())
    out.task.update(task)
    return out


def tiny(kind):
    cfg = get_config(f"attention={kind},base=bytes")
    cfg.model = model_config(vocab_size=320, d_model=32, num_layers=2, num_heads=2, num_kv_heads=1, head_dim=16,
                             ffw_dim=64, attention={"kind": kind, **({"impl": "xla"} if kind == "squid" else {})})
    cfg.agent.max_turns, cfg.agent.max_response_tokens, cfg.agent.max_context_tokens = 2, 96, 3072
    cfg.rollout.group_size = 2
    cfg.sandbox.timeout = 20.0
    return cfg


def full_hidden(model, ids, spans):
    """Hidden state of the last token of `ids` from the plain training forward."""
    seg = np.zeros(len(ids), np.int32)
    for j, (a, b) in enumerate(spans):
        seg[a:b] = j + 1
    mask = AttentionMask(segment_ids=jnp.asarray(seg)[None], is_global=jnp.asarray(seg == 0)[None])
    return forward(model, jnp.asarray(ids)[None], jnp.arange(len(ids))[None], mask).hidden[0, -1]


@pytest.mark.parametrize("kind,mode", [("squid", "documents"), ("squid", "incremental"), ("dense", "full")])
@pytest.mark.slow
def test_session_prefill_equals_the_full_forward(kind, mode):
    """Turn after turn, with documents inside the new tokens and a reset (a new segment)."""
    model = init_model(tiny(kind).model, seed=1)
    g, p = nnx.split(model)
    rng = np.random.default_rng(0)
    doc = rng.integers(3, 250, 37).tolist()
    ctx0 = rng.integers(3, 250, 20).tolist()
    turn1 = ctx0 + rng.integers(3, 250, 5).tolist() + doc + rng.integers(3, 250, 9).tolist()
    spans1 = [(25, 62)]
    turn2 = turn1 + rng.integers(3, 250, 3).tolist() + doc + rng.integers(3, 250, 4).tolist()
    spans2 = spans1 + [(74, 111)]
    other = rng.integers(3, 250, 30).tolist()
    sampler = session_sampling.SessionSampler(g, TOK, rows=3, max_context=256, max_response=4, mode=mode)
    sampler.start(p, jax.random.key(0))
    # Only documents mode keeps a document to itself; the others prefill it as ordinary tokens.
    spans_of = (lambda s: s) if mode == "documents" else (lambda s: [])
    for requests in ({0: (ctx0, []), 2: (other, [])}, {0: (turn1, spans1), 2: (other + [5, 6], [])},
                     {0: (turn2, spans2), 2: (other[:7], [])}):
        last = sampler.prefill(requests)
        for r, (ids, spans) in requests.items():
            want = full_hidden(model, ids, spans_of(spans))
            np.testing.assert_allclose(np.asarray(last[r]), np.asarray(want), atol=2e-4, rtol=2e-4)
    stats = sampler.stats
    if mode == "documents":
        # The document is encoded once and copied twice; the prefill skips both copies.
        assert stats["tokens_documents_encoded"] == 37
        assert stats["tokens_new_documents"] == 74
        assert stats["tokens_prefilled"] == stats["tokens_new"] - 74
    if mode == "full":
        assert stats["tokens_prefilled"] == stats["tokens_full"]


@pytest.mark.slow
def test_episodes_logprobs_match_the_train_forward(tmp_path):
    """Real episodes through the harness (tools, grading) with a random squid policy: behaviour
    log-probs = the training forward's on the batch, and the layout marks the read files."""
    cfg = tiny("squid")
    model = init_model(cfg.model, seed=3)
    g, p = nnx.split(model)
    p = nnx.to_pure_dict(p)
    tasks = [repo_tasks.generate_task(s, difficulty=1) for s in (0, 1)]
    # A policy that reads a file in its first turn, so documents occur; then it samples freely.
    sampler = session_sampling.SessionSampler(g, TOK, rows=4, max_context=cfg.agent.max_context_tokens,
                                   max_response=cfg.agent.max_response_tokens)
    reads = {}

    orig = sampler.generate

    def generate(requests):
        out = orig(requests)
        for r, (ids, _) in requests.items():
            if r not in reads:  # replace the first turn by a read (kept out of the log-prob check)
                reads[r] = True
                path = [f for f in tasks[r // 2].files if not f.startswith("tests")][-1]
                call = {"role": "assistant", "content": "", "tool_calls": [{"name": "read_file", "arguments": {"path": path}}]}
                ids_, mask = TOK.encode_chat([call])
                out[r] = [t for t, m in zip(ids_, mask) if m]
                sampler.logprobs[r][-1] = np.full(len(out[r]), np.nan, np.float32)
        return out

    sampler.generate = generate
    episodes = episodes_lib.play_episodes([tasks[0], tasks[0], tasks[1], tasks[1]], sampler, p, jax.random.key(0),
                                   LocalExecutor(), TOK, cfg)
    assert all(e.valid for e in episodes)
    assert all(len(e.trajectory.segments[0].documents) >= 1 for e in episodes), [[(c.name, c.status, c.observation[:60]) for c in e.trajectory.tool_calls] for e in episodes]
    batch = demonstrations.training_batch(episodes, cfg, TOK.pad_id, row_multiple=1, length_multiple=64)
    seg = batch["segment_ids"]
    assert seg.max() >= 1 and np.all(batch["is_global"] == (seg == 0))
    assert not batch["mask"][seg > 0].any()  # documents are observations: never trained on
    logp, _ = make_logprob_fn(g)(p, {k: jnp.asarray(v) for k, v in batch.items()})
    beh = batch["behavior_logp"]
    check = batch["mask"] & np.isfinite(beh)
    assert check.sum() > 20
    np.testing.assert_allclose(np.asarray(logp)[check], beh[check], atol=2e-3)
    # Documents were encoded once per distinct file and reused by the second episode of a group.
    st = sampler.stats
    assert st["tokens_documents_encoded"] < st["tokens_new_documents"]


def test_turn_batcher_answers_each_episode_in_batches():
    calls = []

    class Echo:
        def generate(self, requests):
            calls.append(sorted(requests))
            return {r: [len(ids)] for r, (ids, _) in requests.items()}

    import threading
    batcher = episodes_lib.TurnBatcher(Echo(), range(3))
    results = {}

    def episode(row, turns):
        fn = batcher.policy(row)
        results[row] = [fn([0] * (row + 10 * t), [])[0] for t in range(turns)]
        batcher.done(row)

    threads = [threading.Thread(target=episode, args=(r, t)) for r, t in ((0, 1), (1, 3), (2, 2))]
    for t in threads:
        t.start()
    batcher.serve()
    for t in threads:
        t.join()
    assert calls == [[0, 1, 2], [1, 2], [1]]  # every live episode waits, then one batch
    assert results == {0: [0], 1: [1, 11, 21], 2: [2, 12]}


def test_config_errors():
    for base in ("bytes", "code"):  # the default (code) checked as the job checks it: resolved
        cfg = resolve_config(get_config(f"base={base}"))
        cfg.model.attention = {"kind": "nsa"}
        with pytest.raises(ValueError, match="attention.kind"):
            agent.validate_config(cfg)
    cfg = get_config("base=bytes")
    cfg.agent.tools = ("read_file",)
    with pytest.raises(ValueError, match="submit"):
        agent.validate_config(cfg)
    with pytest.raises(ValueError, match="levels"):
        get_config("levels=4")


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("task.num_train", 0, "task.num_train=0: must be an integer >= 1"),
        ("seed", -1, "seed=-1"),
        ("optim.lr", math.nan, "optim.lr=nan"),
        ("sampling.temperature", 0.0, "sampling.temperature=0.0"),
        ("eval.num_samples", 0, "eval.num_samples=0"),
        ("eval.batch_rows", 0, "eval.batch_rows=0"),
        ("sandbox.timeout", -1.0, "sandbox.timeout=-1.0"),
        ("train.max_minutes", math.inf, "train.max_minutes=inf"),
        ("agent.max_turns", 0, "agent.max_turns=0"),
        ("agent.prefill", "some", "agent.prefill='some'"),
        ("agent.tools", ("read_file", "submit", "teleport"), "item 2 ('teleport')"),
        ("agent.max_response_tokens", 4000, "agent.max_context_tokens=3072"),
        ("reward.length_growth", 0.5, "reward.length_growth"),
        ("reward.hack_flags", ("tampered", "nope"), "reward.hack_flags"),
        ("task.num_demos", 5000, "task.num_demos=5000"),
        ("task.rl_tasks", "demos", "task.rl_tasks='demos'"),
        ("task.demo_bugs", "wide", "task.demo_bugs='wide'"),
        ("task.num_train", 2002, "task.num_train=2002 leaves 2 tasks after the task.num_demos=2000 demonstrations"),
        ("rollout.prompts_per_step", 5000, "task.num_train=4000"),
        ("advantage.estimator", "gae", "advantage.estimator='gae'"),
        ("loss.kl_penalty", "reward", "loss.kl_penalty='reward'"),
        ("train.microbatches", 3, "train.microbatches=3"),
        ("rollout.grup_size", 4, "unknown config field 'rollout.grup_size'; did you mean rollout.group_size?"),
        ("rollout.group_size", 10**5, "reduce rollout.group_size"),
    ],
)
def test_agent_config_values_are_checked_like_the_main_job(field, value, message):
    cfg = tiny("squid")
    *path, last = field.split(".")
    node = cfg
    for name in path:
        node = node[name]
    node[last] = value
    with pytest.raises(ConfigError) as e:
        agent.validate_config(cfg, 1)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_rl_prompts_come_from_the_tasks_the_warm_start_never_saw():
    cfg = tiny("squid")
    cfg.task.num_train, cfg.task.num_demos, cfg.rollout.prompts_per_step = 50, 40, 4
    drawn = [agent.rl_prompts(cfg, 50, count) for count in range(60)]
    assert all(len(set(d)) == 4 for d in drawn)  # distinct tasks within a step
    assert set(np.concatenate(drawn)) == set(range(40, 50))  # every undemonstrated task, no demonstration
    assert np.array_equal(agent.rl_prompts(cfg, 50, 7), drawn[7])  # a function of (seed, count)
    cfg.task.rl_tasks = "all"  # the draw of every train task is the one runs have always made
    for count in range(5):
        old = np.random.default_rng([cfg.seed, count]).choice(50, 4, replace=False)
        assert np.array_equal(agent.rl_prompts(cfg, 50, count), old)
    cfg.task.rl_tasks, cfg.sft.steps = "undemonstrated", 0  # no warm start: no task was demonstrated
    assert set(np.concatenate([agent.rl_prompts(cfg, 50, c) for c in range(60)])) == set(range(50))
    cfg.sft.steps = 10
    with pytest.raises(ConfigError, match="3 of the 43 train tasks to draw from, fewer than rollout.prompts_per_step=4"
                                          "; the first task.num_demos=40 are demonstrations: set task.rl_tasks=all"):
        agent.rl_prompts(cfg, 43, 0)  # e.g. a mined train split shorter than task.num_train


@pytest.mark.parametrize("demo_bugs", ["standard", "varied"])
def test_the_expert_demonstrates_the_first_train_tasks_or_their_varied_bugs(monkeypatch, demo_bugs):
    cfg = tiny("squid")
    cfg.task.num_train, cfg.task.num_demos, cfg.task.demo_bugs = 16, 9, demo_bugs
    played = []
    monkeypatch.setattr(agent, "expert_demonstrations", lambda tasks, *a, **k: played.append(tasks) or "demos")
    ctx = types.SimpleNamespace(cfg=cfg, pool=None, tokenizer=None, say=lambda m: None)
    demos, tasks = agent.setup(ctx)
    assert demos == "demos" and len(tasks["train"]) == 16
    (shown,) = played
    first = tasks["train"][:9]
    if demo_bugs == "standard":
        assert shown == first
    else:  # the same seeds and families, a bug from the wider draw; RL's and evaluation's tasks unchanged
        assert [(t.seed, t.family) for t in shown] == [(t.seed, t.family) for t in first]
        assert all(s.task_id == f.task_id + "/varied" and s.files != f.files for s, f in zip(shown, first))
        assert tasks == agent.build_tasks(cfg)


def test_failed_edits_show_the_closest_text_unless_the_run_predates_it():
    cfg = tiny("squid")
    assert episodes_lib.episode_kwargs(cfg)["limits"].edit_hints is True  # the config's default
    cfg.agent.edit_hints = False
    assert episodes_lib.episode_kwargs(cfg)["limits"].edit_hints is False
    del cfg.agent["edit_hints"]  # a run's saved config from before the field: no hints, as it ran
    assert episodes_lib.episode_kwargs(cfg)["limits"].edit_hints is False
    # so resuming such a run with the config's hints on is a change (refused without resume_override)
    old, new = (json.loads(json.dumps(c.to_dict(), default=list)) for c in (cfg, tiny("squid")))
    assert workdir_lib.config_changes(old, new) == {"agent.edit_hints": ("(absent)", True)}


def test_varied_demonstration_bugs_need_the_generated_tasks():
    cfg = tiny("squid")
    cfg.task.source, cfg.task.demo_bugs = "mined", "varied"
    with pytest.raises(ConfigError, match="task.demo_bugs='varied': varied bugs exist only for the generated tasks"):
        agent.validate_config(cfg, 1)


def test_success_by_label_against_a_loop():
    """The evaluation's success_L<level> / success_<family>: the mean over the episodes of each
    label's tasks; tasks without a label (mined tasks have no family) are left out."""
    rng = np.random.default_rng(0)
    correct = rng.random((9, 3)) < 0.5
    labels = ["fix_a", "fix_b", "", "fix_a", "fix_c", "fix_b", "fix_a", "", "fix_c"]
    expected = {}
    for label in ("fix_a", "fix_b", "fix_c"):
        rows = [correct[i] for i in range(9) if labels[i] == label]
        expected[label] = sum(float(x) for row in rows for x in row) / (3 * len(rows))
    got = agent.success_by(correct, labels)
    assert list(got) == ["fix_a", "fix_b", "fix_c"] and got == pytest.approx(expected)


def test_the_recovering_expert_needs_edit_hints():
    cfg = tiny("squid")
    cfg.agent.expert_style, cfg.agent.edit_hints = "recover", True
    agent.validate_config(cfg, 1)
    cfg.agent.edit_hints = False
    with pytest.raises(ConfigError, match="expert_style='recover' .* needs agent.edit_hints=True"):
        agent.validate_config(cfg, 1)


def test_every_field_of_the_agent_job_is_checked():
    paths = check_every_field(tiny("squid"), lambda c: agent.validate_config(c, 1))
    assert "agent.tools" in paths and "reward.hack_flags" in paths and "train.max_minutes" in paths


def test_agent_resume_refuses_a_changed_config(tmp_path):
    cfg = tiny("squid")
    cfg.workdir = str(tmp_path / "run")
    workdir_lib.prepare_workdir(cfg)
    saved = (tmp_path / "run" / "config.json").read_text()
    changed = tiny("squid")
    changed.workdir, changed.resume, changed.seed = cfg.workdir, True, 3
    changed.reward.turn_weight = 0.5
    with pytest.raises(ConfigError) as e:
        agent.run(changed, pool=LocalExecutor(), log=lambda m: None)
    assert "seed 0 -> 3" in str(e.value) and "reward.turn_weight 0.02 -> 0.5" in str(e.value)
    assert (tmp_path / "run" / "config.json").read_text() == saved
    changed.seed, changed.reward.turn_weight = 0, 0.02
    changed.train.max_minutes, changed.train.steps = 90.0, 400  # a longer run: allowed
    workdir_lib.prepare_workdir(changed)
    assert json.loads((tmp_path / "run" / "config.json").read_text())["train"]["max_minutes"] == 90.0


def test_agent_job_end_to_end_and_report(tmp_path):
    """SFT from expert episodes, one GRPO step, evaluations, outputs; then the report's replay."""
    import json

    from experiments import agent_report
    from rlcode.train.metrics import read_jsonl

    cfg = tiny("squid")
    cfg.model.num_layers = 1  # what is checked (outputs, prefill counts, replay) does not depend on depth
    cfg.workdir = str(tmp_path / "run")
    cfg.task.num_train, cfg.task.num_demos, cfg.task.num_fresh, cfg.task.num_eval = 6, 3, 1, 1
    cfg.seed = 1  # the first draw from all six tasks would be a demonstration (task 2); RL draws from 3-5
    cfg.sft.steps, cfg.sft.batch_size, cfg.sft.cache_dir = 2, 2, str(tmp_path / "cache")
    cfg.train.steps = 1
    cfg.rollout.prompts_per_step = 1
    cfg.eval.num_samples, cfg.eval.batch_rows = 2, 2
    cfg.log.record_every = 1
    cfg.agent.max_response_tokens = 192  # the expert's edit turn
    result = agent.run(cfg, pool=LocalExecutor(), log=lambda m: None)
    assert result.completed and result.steps_done == 1
    for key in ("eval_fresh/success", "eval/success", "eval_fresh/pass@1", "eval/best_of_2"):
        assert key in result.first_eval and key in result.last_eval
    sets = agent.build_tasks(cfg, sets=("eval_fresh", "eval"))
    for prefix in ("eval_fresh", "eval"):  # one task per set: its family's success is the set's
        (task,) = sets[prefix]
        assert result.first_eval[f"{prefix}/success_{task.family}"] == result.first_eval[f"{prefix}/success"]
    logged = {k for r in read_jsonl(os.path.join(cfg.workdir, "tb")) for k in r}
    assert [t for t in agent.JOB.summary_metrics(cfg) if t not in logged] == []  # the HParams tab's metrics
    # The behaviour monitor's statistics (the agent has no question action).
    assert {"behaviour/answer_rate", "behaviour/malformed_rate", "behaviour/length"} <= logged
    assert "behaviour/question_rate" not in logged
    rows = [r for r in read_jsonl(os.path.join(cfg.workdir, "tb")) if "rollout/success" in r]
    assert len(rows) == 1
    m = rows[0]
    assert m["prefill/tokens_full"] >= m["prefill/tokens_incremental"] >= m["prefill/tokens_documents"] > 0
    assert np.isfinite(m["train/loss"]) and abs(m["train/is_ess_frac"] - 1) < 1e-3  # sampler = trainer
    assert os.path.exists(os.path.join(cfg.workdir, "summary.json"))
    # The expert demonstrations were cached, and the SFT warm start with them.
    assert any(n.startswith("agent_demos_") for n in os.listdir(cfg.sft.cache_dir))

    # The RL batch played one of the tasks that were not demonstrations (task.rl_tasks).
    first_prompt = ByteTokenizer().decode(next(iter(json.loads(
        open(os.path.join(cfg.workdir, "episodes.jsonl")).readline())["turns"][0].values()))[0])
    train = agent.build_tasks(cfg, sets=("train",))["train"]
    assert [i for i, t in enumerate(train) if t.instruction in first_prompt] == [agent.rl_prompts(cfg, 6, 0)[0]]
    assert agent.rl_prompts(cfg, 6, 0)[0] >= 3

    out = tmp_path / "agent_repo.json"
    assert agent_report.main(["--runs", cfg.workdir, "--out", str(out), "--rounds", "1", "--no_warmup"]) == 0
    data = json.load(open(out))
    assert data["curves"]["rollout/success"][0][0] == 1
    rep = data["replay"]
    assert rep["full"]["tokens"] == m["prefill/tokens_full"]
    assert rep["incremental"]["tokens"] == m["prefill/tokens_incremental"]
    assert rep["documents"]["tokens"] == m["prefill/tokens_documents"]
    for mode in ("full", "incremental", "documents"):  # the same prefills, reading every cache slot
        whole = rep["whole_cache"][mode]
        assert whole["tokens"] == rep[mode]["tokens"] and whole["bounded_speedup"] > 0
    assert data["summary"][0]["eval_fresh/success"]["start"] == result.first_eval["eval_fresh/success"]
    for tag in ("eval_fresh/read_ok", "eval_fresh/edit_ok", "eval_fresh/tool_errors"):
        assert data["summary"][0][tag]["start"] == result.first_eval[tag]
        assert data["summary"][0][tag]["end"] == result.last_eval[tag]
    for tag in ("rollout/read_ok", "rollout/edit_ok", "rollout/tool_errors"):
        assert data["curves"][tag] == [[1, m[tag]]]

    # The run's fresh tasks, and more of them, evaluated for its warm start and its final policy.
    from experiments import evaluate

    fresh = [t.task_id for t in agent.build_tasks(dict_config(cfg, num_fresh=2), sets=("eval_fresh",))["eval_fresh"]]
    for extra in ([], ["--warm_start"]):
        ev = tmp_path / f"evaluate{len(extra)}"
        assert evaluate.main(["--run", cfg.workdir, "--tasks", "repo_fresh", "--limit", "2", "--samples", "1",
                              "--k", "1", "--batch", "2", "--temperature", "1.0", "--out", str(ev), *extra]) == 0
        report = json.load(open(ev / "evaluate.json"))
        assert [r["task_id"] for r in report["per_task"]] == fresh and report["split"] == "eval_fresh"
        assert report["policy"]["step"] == (0 if extra else 1)


@pytest.mark.slow
def test_expert_turns_replay_encodes_each_file_once_per_batch(tmp_path):
    """turns_from_segments rebuilds the sampler's requests from finished segments; replaying two
    identical expert episodes encodes each read file once and copies it into both."""
    cfg = tiny("squid")
    cfg.agent.max_response_tokens = 192
    task = repo_tasks.generate_task(1, difficulty=3)
    kwargs = episodes_lib.episode_kwargs(cfg)
    turns = repo_tasks.expert_turns(task, "compact")
    traj = harness.run_episode(task, harness.ScriptedPolicy(TOK, turns), LocalExecutor(), TOK, root=tmp_path,
                               **dict(kwargs, max_turns=len(turns)))
    seg = traj.segments[0]
    assert len(seg.documents) == 2
    calls = session_sampling.turns_from_segments([seg, seg])
    assert len(calls) == traj.num_turns == 4
    previous = 0
    for call in calls:
        assert sorted(call) == [0, 1]
        ids, spans = call[0]
        n = len(ids)
        assert n > previous and ids == seg.ids[:n] and seg.policy_mask[n] == 1 and seg.policy_mask[n - 1] == 0
        assert spans == [d for d in seg.documents if d[1] <= n]
        previous = n
    model = init_model(cfg.model, seed=0)
    g, p = nnx.split(model)
    stats = session_sampling.replay_prefill(g, p, TOK, calls, mode="documents", max_context=cfg.agent.max_context_tokens, rows=2)
    doc_tokens = sum(b - a for a, b in seg.documents)
    assert stats["tokens_documents_encoded"] == doc_tokens
    assert stats["tokens_new_documents"] == 2 * doc_tokens
    assert stats["tokens_new"] == 2 * len(calls[-1][0][0])


@pytest.mark.slow
def test_agent_report_replays_the_expert_of_a_config_without_a_run(tmp_path, capsys):
    """--config: the scripted expert's turns (1 task x 2 episodes) replayed in every mode, each
    alternately bounded and reading the whole cache, with the same token counts."""
    import json

    from experiments import agent_report

    from support import derived_config

    config = derived_config(tmp_path / "agent_tiny.py", "agent_repo",
                            "cfg.model.update(d_model=32, num_layers=1, num_heads=2, num_kv_heads=1, head_dim=16, "
                            "ffw_dim=64)",
                            "cfg.agent.update(max_context_tokens=2048, max_response_tokens=192)")
    out = tmp_path / "replay.json"
    with pytest.raises(SystemExit):
        agent_report.main(["--config", str(config), "--out", str(out)])  # no --expert
    assert "add --expert" in capsys.readouterr().err
    assert agent_report.main(["--config", str(config), "--expert", "1,2", "--rounds", "1", "--no_warmup",
                              "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["runs"] == [] and data["config"]["agent"]["max_context_tokens"] == 2048
    rep = data["replay_expert"]
    assert rep["episodes_per_step"] == 2 and rep["turns"] >= 2
    assert rep["documents"]["tokens"] < rep["incremental"]["tokens"] < rep["full"]["tokens"]
    for mode in ("full", "incremental", "documents"):
        whole = rep["whole_cache"][mode]
        assert whole["tokens"] == rep[mode]["tokens"] and len(whole["times_s"]) == 1
    assert "reading the whole cache" in capsys.readouterr().out


def test_a_subset_of_the_task_sets_is_the_full_sets_part():
    """`build_tasks(sets=, num_train=)` (the expert replay, the evaluation script) builds the same
    tasks as the full sets, and no others."""
    cfg = tiny("squid")
    cfg.task.num_train, cfg.task.num_fresh, cfg.task.num_eval = 5, 2, 3
    ids = lambda ts: [t.task_id for t in ts]  # noqa: E731
    full = agent.build_tasks(cfg)
    assert [len(full[k]) for k in agent.TASK_SETS] == [5, 2, 3]
    only_eval = agent.build_tasks(cfg, sets=("eval",))
    assert ids(only_eval["eval"]) == ids(full["eval"]) and only_eval["train"] == only_eval["eval_fresh"] == []
    first = agent.build_tasks(cfg, sets=("train",), num_train=2)
    assert ids(first["train"]) == ids(full["train"])[:2] and first["eval"] == first["eval_fresh"] == []
    assert ids(agent.build_tasks(cfg, num_train=50)["train"]) == ids(full["train"])  # at most task.num_train
    with pytest.raises(ValueError, match="unknown task sets"):
        agent.build_tasks(cfg, sets=("test",))


def test_expert_demonstrations_are_cached_per_tokenizer(tmp_path):
    """The same tasks rendered with another tokenizer are other token ids: a demonstration cache
    written with bytes is never read back as BPE ids (nor the reverse)."""
    from rlcode.tokenizer import load_tokenizer

    cfg = tiny("squid")
    cfg.task.num_train = 2
    cfg.sft.cache_dir = str(tmp_path / "cache")
    cfg.agent.max_response_tokens = 192
    tasks = agent.build_tasks(cfg)["train"]
    base = os.path.join(os.path.dirname(__file__), "..", "..", "..", "checkpoints", "code_base")
    byte, bpe = ByteTokenizer(), load_tokenizer(base)
    assert byte.fingerprint() != bpe.fingerprint() == load_tokenizer(base).fingerprint()
    texts = {}
    for tok in (byte, bpe):
        demos = demonstrations.expert_demonstrations(tasks, LocalExecutor(), tok, cfg, log=lambda m: None)
        again = demonstrations.expert_demonstrations(tasks, LocalExecutor(), tok, cfg, log=lambda m: None)
        a = demos.arrays_
        np.testing.assert_array_equal(a["inputs"], again.arrays_["inputs"])  # read back from its own cache
        texts[tok.fingerprint()] = [tok.decode(row[:n]) for row, n in zip(a["inputs"], a["kv_lengths"])]
    assert len(os.listdir(cfg.sft.cache_dir)) == 2
    first, second = texts.values()
    untimed = lambda ts: [re.sub(r" in [0-9.]+s\b", " in Ts", t) for t in ts]  # noqa: E731 (pytest's durations)
    assert untimed(first) == untimed(second)  # the same episodes, each in its own tokenizer's ids


@pytest.mark.parametrize("levels", ["1", "12", "123"])
def test_the_bpe_budgets_hold_the_scripted_expert(levels):
    """configs/agent_repo.py:base=code sizes its context, response and length budgets in the base's
    tokens: every expert episode of a few train tasks per level fits the context in one segment,
    passes its held-out tests, and no expert turn is cut at max_response_tokens."""
    from rlcode.tokenizer import load_tokenizer
    from rlcode.train.episodes import episode_kwargs, grade_episode

    cfg = get_config(f"base=code,levels={levels}")
    tok = load_tokenizer(os.path.join(os.path.dirname(__file__), "..", "..", "..", cfg.model.init_from))
    kwargs, pool = episode_kwargs(cfg), LocalExecutor()
    for task in [repo_tasks.generate_task(i, difficulty=int(levels[-1]), split="train") for i in range(6)]:
        turns = repo_tasks.expert_turns(task, cfg.agent.expert_style)
        traj = harness.run_episode(task, harness.ScriptedPolicy(tok, turns), pool, tok,
                                   **dict(kwargs, max_turns=len(turns)))
        assert traj.end_reason == "submitted" and len(traj.segments) == 1, task.task_id
        seg = traj.segments[0]
        assert len(seg.ids) <= cfg.agent.max_context_tokens
        mask = np.asarray(seg.policy_mask, int)
        edges = np.diff(np.concatenate([[0], mask, [0]]))
        assert (np.flatnonzero(edges == -1) - np.flatnonzero(edges == 1)).max() < cfg.agent.max_response_tokens
        assert grade_episode(task, traj, pool, cfg).success, task.task_id


def test_episode_metrics_count_the_tool_calls_that_succeeded(tmp_path):
    """read_ok / edit_ok: the share of episodes with a successful read_file / edit_file call;
    tool_errors: calls the tool refused, per episode. Episodes played through the harness."""
    task = repo_tasks.generate_task(0, difficulty=1)
    path = task.expert_reads[0]
    first_line = task.files[path].splitlines()[0]

    def play(*calls):
        turns = [{"role": "assistant", "content": "", "tool_calls": [{"name": n, "arguments": a}]} for n, a in calls]
        traj = harness.run_episode(task, harness.ScriptedPolicy(TOK, turns + [
            {"role": "assistant", "content": "", "tool_calls": [{"name": "submit", "arguments": {}}]}]),
            LocalExecutor(), TOK, max_turns=len(turns) + 1, root=tmp_path, max_context_tokens=1 << 17,
            max_response_tokens=4096)
        return episodes_lib.Episode(task=task, trajectory=traj, reward=0.0, terms={}, flags=(), valid=True,
                                    hacked=False, success=False)

    missing = "no_such_package/" + path.split("/")[-1]
    eps = [play(("read_file", {"path": missing})),  # a made-up path: one tool error, nothing ok
           play(("read_file", {"path": path}), ("edit_file", {"path": path, "old": "not in the file", "new": "x"})),
           play(("read_file", {"path": path}), ("edit_file", {"path": path, "old": first_line, "new": first_line + "  # edited"}))]
    assert [e.trajectory.num_tool_errors for e in eps] == [1, 1, 0]
    m = episodes_lib.episode_metrics(eps, "eval")
    assert m["eval/read_ok"] == pytest.approx(2 / 3)
    assert m["eval/edit_ok"] == pytest.approx(1 / 3)
    assert m["eval/tool_errors"] == pytest.approx(2 / 3)


def test_hint_follow_ups_count_the_edits_after_a_hinted_failure_and_the_copies(tmp_path):
    """hint_follow_ups / hint_copies: edit_file calls right after one the tool refused with the
    file's closest text, and those whose `old` is that text. Episodes played through the harness
    with the tool's real hint."""
    task = repo_tasks.generate_task(3, family="fix_constant")
    wrong, edit = repo_tasks.misremembered_edit(task), task.edits[0]
    assert wrong is not None

    def play(*olds):
        turns = [{"role": "assistant", "content": "", "tool_calls": [
            {"name": "edit_file", "arguments": {"path": edit.path, "old": old, "new": edit.new}}]} for old in olds]
        turns.insert(1, {"role": "assistant", "content": "", "tool_calls": [  # a call between edits
            {"name": "read_file", "arguments": {"path": edit.path}}]})
        traj = harness.run_episode(task, harness.ScriptedPolicy(TOK, turns), LocalExecutor(), TOK,
                                   max_turns=len(turns), root=tmp_path, max_context_tokens=1 << 17,
                                   max_response_tokens=4096)
        return episodes_lib.Episode(task=task, trajectory=traj, reward=0.0, terms={}, flags=(), valid=True,
                                    hacked=False, success=False)

    unlike = "import nothing_like_this_file\n"  # refused without a hint
    cases = {(wrong.old, edit.old): (1, 1),  # hint copied
             (wrong.old, wrong.old, edit.old): (2, 1),  # the same guess again, then the copy
             (wrong.old, unlike, edit.old): (1, 0),  # a guess after the hint; no hint after it
             (wrong.old, edit.old, edit.new): (1, 1),  # an edit after the applied copy follows no hint
             (edit.old,): (0, 0), (unlike, edit.old): (0, 0)}
    eps = []
    for olds, expected in cases.items():
        eps.append(play(*olds))
        assert episodes_lib.hint_follow_ups(eps[-1].trajectory) == expected, olds
    m = episodes_lib.episode_metrics(eps, "eval")
    assert m["eval/hint_follow_ups"] == pytest.approx(5 / 6) and m["eval/hint_copies"] == pytest.approx(3 / 6)


def test_agent_report_means_over_the_steps_two_runs_share(tmp_path, monkeypatch):
    """--mean_steps: per-step means over steps 1..N only (a shorter run of the same seed compared
    on the steps both made); the evaluations' start and end stay the run's own."""
    from experiments import agent_report

    run = tmp_path / "run"
    (run / "tb").mkdir(parents=True)
    json.dump({"completed": True, "steps_done": 4, "seconds": 600.0}, open(run / "summary.json", "w"))
    json.dump({"job": "agent", "task": {"num_fresh": 1}}, open(run / "config.json", "w"))
    rows = [{"step": 0, "eval_fresh/success": 0.25, "eval_fresh/success_fix_constant": 0.5, "eval_fresh/pass@8": 0.5,
             "eval_fresh/hint_copies": 0.0, "eval_fresh/nothing_kept": 1.0}]
    rows += [{"step": s, "time/sample_s": 10.0 * s, "decode/seconds": float(s), "prefill/tokens_documents": 100.0 * s,
              "rollout/success": s / 8} for s in (1, 2, 3, 4)]
    rows += [{"step": 4, "eval_fresh/success": 0.5, "eval_fresh/success_fix_constant": 0.75, "eval_fresh/pass@8": 0.75,
              "eval_fresh/hint_copies": 0.5, "eval_fresh/nothing_kept": 2.0}]
    with open(run / "tb" / "metrics.jsonl", "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    c = agent_report.curves(str(run))
    every, first = agent_report.run_summary(str(run), c), agent_report.run_summary(str(run), c, mean_steps=(1, 2))
    assert (every["mean_over_steps"], first["mean_over_steps"]) == (4, 2)
    # Per-family success, pass@k and the hint tags are summarised; other tags are not kept.
    assert every["eval_fresh/success_fix_constant"] == {"start": 0.5, "end": 0.75, "change": 0.25, "best": 0.75}
    assert every["eval_fresh/pass@8"]["change"] == 0.25 and every["eval_fresh/hint_copies"]["end"] == 0.5
    assert "eval_fresh/nothing_kept" not in c and "eval_fresh/nothing_kept" not in every
    later = agent_report.run_summary(str(run), c, mean_steps=agent_report.parse_steps("3-4"))
    assert later["mean_time_sample_s"] == 35.0 and later["mean_over_steps"] == 2
    assert agent_report.parse_steps("2") == (1, 2) and agent_report.parse_steps(None) is None
    for bad in ("0", "4-3", "x", "1-", "-2"):
        with pytest.raises(argparse.ArgumentTypeError, match="--mean_steps"):
            agent_report.parse_steps(bad)
    # --name: the report of the pretrained base's runs goes to its own run directory (results/ with --publish).
    monkeypatch.chdir(tmp_path)
    assert agent_report.main(["--runs", str(run), "--no_replay", "--name", "agent_repo_code", "--mean_steps", "2"]) == 0
    report = json.load(open(tmp_path / "runs" / "agent_repo_code" / "agent_repo_code.json"))
    assert report["summary"][0]["mean_time_sample_s"] == 15.0 and not (tmp_path / "results").exists()
    assert every["mean_time_sample_s"] == 25.0 and first["mean_time_sample_s"] == 15.0
    assert first["mean_decode_seconds"] == 1.5 and first["prefill_tokens_per_step_documents"] == 150.0
    assert first["mean_rollout_success"] == 0.1875 and every["mean_rollout_success"] == 0.3125
    assert first["eval_fresh/success"] == every["eval_fresh/success"] == {"start": 0.25, "end": 0.5, "change": 0.25,
                                                                          "best": 0.5}
