"""Rollouts: task encoding, sandbox grading (including a worker that dies mid-step), rewards,
dynamic sampling, masking of infrastructure failures in the train batch, and the SFT warm start."""

import dataclasses
import json
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from support import tiny_job

from rlcode.envs import verdict, verdict_child
from rlcode.checks import ConfigError
from rlcode.envs.tasks import synth
from rlcode.envs.tasks.protocol import QUESTION_DEMO, is_question
from rlcode.sampling import SampleOutput, SamplingConfig
from rlcode.sandbox.spec import ExecResult
from rlcode.tokenizer import ByteTokenizer
from rlcode.train import loop, sft
from rlcode.advantages import AdvantageConfig
from rlcode.losses import ObjectiveConfig
from rlcode.recipes import ShapingConfig
from rlcode.envs.rewards import SYNTH_TERMS, SynthRewardConfig
from rlcode.envs.rewards import synth_reward_config as reward_config
from rlcode.train.rollout import Grader, RolloutCollector, encode_tasks, trim_batch

TOK = ByteTokenizer()


@pytest.fixture(scope="module")
def pool(sandbox_pool):
    return sandbox_pool


@pytest.fixture(scope="module")
def tasks():
    return [synth.generate_task(j, 1 + j % 2, "train") for j in range(12)]


def test_encode_tasks_layout_and_filter(tasks):
    enc = encode_tasks(tasks, TOK, max_prompt_len=160, max_new_tokens=80)
    for i, task in enumerate(enc.tasks):
        p = [TOK.bos_id] + TOK.encode(synth.completion_prompt(task))
        t = TOK.encode(synth.completion_target(task)) + [TOK.eos_id]
        assert enc.prompts[i, : len(p)].tolist() == p and enc.prompt_lengths[i] == len(p)
        assert (enc.prompts[i, len(p):] == TOK.pad_id).all()
        assert enc.targets[i, : len(t)].tolist() == t and enc.target_lengths[i] == len(t)
    short = encode_tasks(tasks, TOK, max_prompt_len=160, max_new_tokens=30)
    assert all(len(TOK.encode(synth.completion_target(t))) + 1 <= 30 for t in short.tasks)
    assert len(short) < len(enc)
    with pytest.raises(ValueError, match="no tasks fit"):
        encode_tasks(tasks, TOK, max_prompt_len=10, max_new_tokens=80)


@pytest.mark.slow
def test_grader_scores_reference_wrong_and_broken(pool, tasks):
    t = tasks[0]
    body = synth.completion_target(t)
    frac, valid, timed_out, counts = Grader(pool).grade(
        [t, t, t, t], [body, "    return None\n", "    return (\n", "    while True:\n        pass\n"])
    assert valid.all()
    assert frac[0] == 1.0 and frac[1] == 0.0 and frac[2] == 0.0 and frac[3] == 0.0
    assert timed_out.tolist() == [False, False, False, True] or frac[3] == 0.0
    assert counts["executions"] == 4


@pytest.mark.slow
def test_sandbox_worker_dying_mid_step_is_masked_and_replaced(pool, tasks):
    t = tasks[1]
    slow = "    import time\n    time.sleep(0.3)\n    return None\n"  # per test case: seconds in all
    grader = Grader(pool, timeout=20)
    out = {}
    th = threading.Thread(target=lambda: out.update(r=grader.grade([t] * 4, [slow] * 4)))
    th.start()
    time.sleep(1.0)  # two executions are now running, one per worker
    victim = pool._slots[0].proc
    victim.kill()
    th.join(timeout=60)
    frac, valid, _, counts = out["r"]
    assert (~valid).sum() >= 1 and counts["infra"] == (~valid).sum()
    assert (frac[~valid] == 0).all()
    # The pool replaced the worker: a correct body still grades as correct on every slot.
    body = synth.completion_target(t)
    frac, valid, _, _ = grader.grade([t] * 4, [body] * 4)
    assert valid.all() and (frac == 1.0).all()


class _FakePool:
    """Answers the verdict child's protocol by the candidate text: "PASS" claims the expected
    output of every check (looked up by task id, which the test knows), "INFRA" is an
    infrastructure failure, anything else claims None."""

    def __init__(self, tasks):
        self.calls = 0
        self.tasks = {t.task_id: t for t in tasks}

    def submit_python(self, code, *, stdin, **kw):
        assert code == verdict.CHILD_SOURCE
        self.calls += 1
        return json.loads(stdin)

    def gather(self, requests):
        out = []
        for req in requests:
            (group,) = req["groups"]
            if "INFRA" in group["source"]:
                out.append(ExecResult(status="infra"))
                continue
            task = self.tasks[group["name"]]
            lines = [{"ready": len(group["checks"])}]
            for check, (_, y) in zip(group["checks"], task.tests):
                lines.append({"i": check["i"], "value": verdict_child.encode(y if "PASS" in group["source"] else None)})
            lines.append({"done": len(group["checks"])})
            text = "".join(f"{req['nonce']} {json.dumps(line)}\n" for line in lines)
            out.append(ExecResult(stdout=text.encode(), status="ok", returncode=0))
        return out


def _fake_sampler(plan):
    """sample_fn emitting, for call c, the completions plan[c] (a list of B strings)."""
    state = {"call": 0}

    def sample_fn(graphdef, params, prompts, prompt_lengths, key, *, group_size, cfg):
        texts = plan[state["call"] % len(plan)]
        state["call"] += 1
        B, M = prompts.shape[0] * group_size, cfg.max_new_tokens
        tokens = np.full((B, M), cfg.pad_id, np.int32)
        mask = np.zeros((B, M), bool)
        for b, s in enumerate(texts):
            ids = (TOK.encode(s) + [TOK.eos_id])[:M]
            tokens[b, : len(ids)] = ids
            mask[b, : len(ids)] = True
        return SampleOutput(tokens, np.where(mask, -0.5, 0.0).astype(np.float32), mask, mask.sum(-1).astype(np.int32))

    return sample_fn


def _collector(tasks, plan, shaping=None, reward=None, G=2):
    enc = encode_tasks(tasks, TOK, 160, 48)
    sampling = SamplingConfig(max_new_tokens=48, stop_ids=(TOK.eos_id,), pad_id=TOK.pad_id)
    shaping = ShapingConfig.from_config(shaping or {"dynamic_sampling": False, "overlong_cache_length": 0})
    reward = SynthRewardConfig.from_config(reward or reward_config())
    return RolloutCollector(None, enc, TOK, Grader(_FakePool(tasks)), sampling, reward, shaping, G,
                            sample_fn=_fake_sampler(plan))


def _prepare_fn(cfg, graphdef, G):
    """`loop.make_prepare_fn` with the typed sections `loop.run` builds from the job's config."""
    return loop.make_prepare_fn(ObjectiveConfig.from_config(cfg.loss), AdvantageConfig.from_config(cfg.advantage),
                                SamplingConfig.from_config(cfg.sampling), graphdef, G, TOK.pad_id)


def test_rewards_valid_and_terms(tasks):
    c = _collector(tasks, [["PASS", "x", "INFRA", "PASS"]], reward=reward_config(truncation_penalty=0.5))
    r = c.sample_and_grade(None, np.array([0, 1]), jax.random.key(0), version=3)
    assert r.version == 3 and r.texts == ["PASS", "x", "INFRA", "PASS"]
    assert r.rewards.tolist() == [1.0, 0.0, 0.0, 1.0]
    assert r.valid.tolist() == [True, True, False, True]
    assert r.passed.tolist() == [True, False, False, True]
    assert set(r.terms) == set(SYNTH_TERMS)
    assert not r.terms["preference"].any()  # the tests are the reward by default
    np.testing.assert_allclose(sum(r.terms.values()), r.rewards)
    # A row that hits max_new_tokens without the stop token is truncated and penalised.
    c = _collector(tasks, [["PASS" * 20, "x", "x", "x"]], reward=reward_config(truncation_penalty=0.5))
    r = c.sample_and_grade(None, np.array([0, 1]), jax.random.key(0), version=0)
    assert r.terms["truncated"].tolist() == [-0.5, 0, 0, 0] and r.stats["truncated"] == 1


def test_questions_are_not_run_and_earn_the_question_reward(tasks):
    """With questions allowed, a completion whose first line asks is never sent to the sandbox and
    earns reward.question_reward; a wrong answer pays reward.wrong_penalty; behaviour rows say
    which rows answered, asked, and whose program does not parse."""
    texts = ["PASS", "  # ask: which type?\nPASS", "x", "return (", "\n    # ASK: no", "# ask:"]
    reward = reward_config(wrong_penalty=1.0, question_reward=-0.25)

    def collect(allow):
        c = _collector(tasks, [texts], reward=reward, G=3)
        c.allow_questions = allow
        return c, c.sample_and_grade(None, np.array([0, 1]), jax.random.key(0), version=0)

    c, r = collect(True)
    asked = [False, True, False, False, False, True]  # the mark is case-sensitive
    assert r.behaviour["question_rate"].tolist() == asked
    assert r.behaviour["answer_rate"].tolist() == [not a for a in asked]
    assert c.grader.pool.calls == 4 and r.stats["executions"] == 4 and r.stats["questions"] == 2
    assert r.terms["question"].tolist() == [0, -0.25, 0, 0, 0, -0.25]
    assert r.terms["wrong"].tolist() == [0, 0, -1, -1, -1, 0]
    # Its tests are not run, so a question passes nothing even where its text would have.
    assert r.terms["tests"].tolist() == [1, 0, 0, 0, 0, 0] and r.passed.tolist() == [True] + [False] * 5
    np.testing.assert_allclose(r.rewards, [1, -0.25, -1, -1, -1, -0.25])
    # "return (" does not compile, nor a body that is only a comment (the upper-case "# ASK" is
    # not a question); "x" does (and fails the tests).
    assert r.behaviour["malformed_rate"].tolist() == [False, False, False, True, True, False]
    assert r.behaviour["length"].tolist() == [len(t) + 1 for t in texts]

    # A batch of questions only runs nothing.
    c = _collector(tasks, [["# ask: a"] * 6], reward=reward, G=3)
    c.allow_questions = True
    r = c.sample_and_grade(None, np.array([0, 1]), jax.random.key(0), version=0)
    assert c.grader.pool.calls == 0 and r.stats["executions"] == 0 and r.valid.all()
    np.testing.assert_allclose(r.rewards, -0.25)

    c, r = collect(False)  # not allowed: every completion is an answer, graded
    assert c.grader.pool.calls == 6 and not r.behaviour["question_rate"].any() and not r.terms["question"].any()
    assert r.terms["tests"][1] == 1.0  # the commented line then PASS


def test_question_demos_replace_a_fraction_of_the_targets(tasks):
    enc = encode_tasks(tasks, TOK, 160, 80)
    demos = loop.question_demos(enc, 0.25, TOK, seed=0)
    question = TOK.encode(QUESTION_DEMO) + [TOK.eos_id]
    changed = [i for i in range(len(enc)) if not np.array_equal(demos.targets[i], enc.targets[i])]
    assert len(changed) == round(0.25 * len(enc))
    for i in changed:
        assert demos.targets[i, :demos.target_lengths[i]].tolist() == question
        assert (demos.targets[i, len(question):] == TOK.pad_id).all()
        assert is_question(TOK.decode(question[:-1]))
    assert np.array_equal(demos.prompts, enc.prompts)
    assert changed == [i for i in range(len(enc))
                       if not np.array_equal(loop.question_demos(enc, 0.25, TOK, seed=0).targets[i], enc.targets[i])]
    with pytest.raises(ConfigError, match="max_new_tokens"):
        loop.question_demos(dataclasses.replace(enc, targets=enc.targets[:, :8]), 0.5, TOK, seed=0)


def test_dynamic_sampling_keeps_informative_groups_and_refills(tasks):
    G = 2
    # Draw 1: group 0 informative, group 1 all-pass, group 2 all-fail. Draw 2: groups 0, 1 informative.
    plan = [["PASS", "x", "PASS", "PASS", "x", "x"], ["x", "PASS", "PASS", "x", "x", "x"]]
    c = _collector(tasks, plan, shaping={"dynamic_sampling": True, "overlong_cache_length": 0})
    r = c.collect(None, np.random.default_rng(0), jax.random.key(0), 0, num_prompts=3, dynamic_sampling=True,
                  max_draws=4)
    assert r.stats["draws"] == 2 and r.stats["dropped_groups"] == 3 and r.stats["filled"] == 0
    assert r.stats["executions"] == 12  # both draws counted once
    groups = r.rewards.reshape(-1, G)
    assert (np.ptp(groups, axis=1) > 0).all()
    assert len(r.texts) == 6 and r.prompts.shape[0] == 3
    # Only degenerate groups and one draw allowed: the batch is filled with dropped groups.
    c = _collector(tasks, [["x"] * 6], shaping={"dynamic_sampling": True, "overlong_cache_length": 0})
    r = c.collect(None, np.random.default_rng(0), jax.random.key(0), 0, num_prompts=3, dynamic_sampling=True,
                  max_draws=1)
    assert r.stats["filled"] == 3 and r.rewards.shape == (6,)


def test_trim_batch():
    batch = {"inputs": jnp.zeros((2, 100)), "mask": jnp.zeros((2, 100), bool), "kv_lengths": jnp.array([5, 7])}
    out = trim_batch(batch, 40, 32)
    assert out["inputs"].shape == (2, 64) and out["mask"].shape == (2, 64) and out["kv_lengths"].shape == (2,)
    assert trim_batch(batch, 99, 32)["inputs"].shape == (2, 100)


def test_prepare_masks_invalid_rows_and_matches_oracle(tmp_path, tasks):
    """The train batch of a rollout: invalid rows get no mask and zero advantage; advantages are
    the group-normalised rewards of the valid rows; old log-probs are the model's."""
    cfg = tiny_job.tiny_config(tmp_path)
    cfg.loss.kl_coef = 0.0
    from rlcode.models.transformer import init_model
    from flax import nnx

    model = init_model(cfg.model, 0)
    graphdef, state = nnx.split(model)
    params = nnx.to_pure_dict(state)
    G = 4
    c = _collector(tasks, [["PASS", "x", "INFRA", "PASS", "x", "x", "PASS", "x"]], G=G)
    r = c.sample_and_grade(None, np.array([0, 1]), jax.random.key(0), version=0)
    batch = _prepare_fn(cfg, graphdef, G)(params, None, r)
    mask = np.asarray(batch["mask"])
    assert not mask[2].any() and mask[[0, 1, 3]].any(-1).all()
    adv = np.asarray(batch["advantages"])
    for g in range(2):
        rows = [b for b in range(g * G, (g + 1) * G) if r.valid[b]]
        rew = r.rewards[rows]
        expect = (rew - rew.mean()) / (rew.std(ddof=1) + cfg.advantage.eps)
        for b, e in zip(rows, expect):
            np.testing.assert_allclose(adv[b][mask[b]], e, rtol=1e-5, atol=1e-6)
    assert (adv[2] == 0).all()
    # Old log-probs are the current model's, at exactly the generated tokens.
    from rlcode.train.step import make_logprob_fn

    full = make_logprob_fn(graphdef)(params, {k: batch[k] for k in ("inputs", "targets", "positions", "kv_lengths")})[0]
    np.testing.assert_allclose(np.asarray(batch["old_logp"])[mask], np.asarray(full)[mask], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(batch["behavior_logp"])[mask], -0.5)


@pytest.mark.slow
def test_sft_learns_and_is_cached(tmp_path, tasks):
    cfg = tiny_job.tiny_config(tmp_path)
    cfg.sft.update(steps=30, batch_size=8, lr=3e-3)
    demos = encode_tasks(tasks, TOK, 160, 80)
    logs = []
    params, info = sft.load_or_train(cfg.model, cfg.sft, demos, 0, log=logs.append)
    nll = [h["nll"] for h in info["history"]]
    assert not info["cached"] and len(nll) == 30
    assert np.mean(nll[-5:]) < 0.6 * np.mean(nll[:3])
    again, info2 = sft.load_or_train(cfg.model, cfg.sft, demos, 0, log=logs.append)
    assert info2["cached"] and info2["key"] == info["key"] and any("reusing" in m for m in logs)
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(again)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    # Anything that changes the result changes the key: seed, steps, demonstrations.
    assert sft.cache_key(cfg.model, cfg.sft, demos, 1) != info["key"]
    other = encode_tasks(tasks[:-1], TOK, 160, 80)
    assert sft.cache_key(cfg.model, cfg.sft, other, 0) != info["key"]
    # The value head is not part of the key: PPO starts from the same warm start.
    cfg.model.value_head = True
    assert sft.cache_key(cfg.model, cfg.sft, demos, 0) == info["key"]


def test_merge_params_loads_into_a_model_with_a_value_head():
    target = {"a": jnp.zeros((2, 3)), "value_head": {"w": jnp.ones(3)}}
    merged = sft.merge_params(target, {"a": np.full((2, 3), 2.0)})
    assert (np.asarray(merged["a"]) == 2).all() and (np.asarray(merged["value_head"]["w"]) == 1).all()
    with pytest.raises(ValueError, match="cannot load"):
        sft.merge_params(target, {"a": np.zeros((3, 2))})


def test_prepare_kl_as_reward_penalty(tmp_path, tasks):
    """kl_penalty='reward': advantages come from R - beta * sum_t (logp - ref_logp) over the
    generated tokens (k1), with the reference's log-probs from `ref_params`."""
    cfg = tiny_job.tiny_config(tmp_path)
    cfg.loss.update(kl_coef=0.5, kl_penalty="reward")
    from flax import nnx

    from rlcode.models.transformer import init_model

    graphdef, state = nnx.split(init_model(cfg.model, 0))
    params = nnx.to_pure_dict(state)
    ref_params = nnx.to_pure_dict(nnx.split(init_model(cfg.model, 1))[1])
    G = 4
    c = _collector(tasks, [["PASS", "x", "x", "PASS", "x", "x", "PASS", "x"]], G=G)
    r = c.sample_and_grade(None, np.array([0, 1]), jax.random.key(0), version=0)
    batch = _prepare_fn(cfg, graphdef, G)(params, ref_params, r)
    mask = np.asarray(batch["mask"])
    kl = ((np.asarray(batch["old_logp"], np.float64) - np.asarray(batch["ref_logp"], np.float64)) * mask).sum(-1)
    shaped = r.rewards - 0.5 * kl
    adv = np.asarray(batch["advantages"])
    for g in range(2):
        rew = shaped[g * G:(g + 1) * G]
        expect = (rew - rew.mean()) / (rew.std(ddof=1) + cfg.advantage.eps)
        got = [adv[b][mask[b]][0] for b in range(g * G, (g + 1) * G)]
        np.testing.assert_allclose(got, expect, rtol=1e-4, atol=1e-4)
