"""The simulated deployment (users' outcomes against their hidden preferences, delivery faults,
A/B serving of a new release) and the registry it serves from."""

import math
import types

import numpy as np
import pytest

from rlcode.feedback import ab, registry
from rlcode.feedback.deployment import Deployment, DeploymentConfig
from rlcode.feedback.usage_log import LogReader, read_log
from rlcode.train.checkpoint import CheckpointError

M = 12


class _Tasks(types.SimpleNamespace):
    def __len__(self):
        return len(self.tasks)


class FakeCollector:
    """Serves completions of a fixed length whose hidden quality is the served parameters' `q`."""

    def __init__(self, num_tasks=5, length=10):
        task = types.SimpleNamespace(completion_prompt=lambda: "def f(x):\n")
        self.tasks = _Tasks(tasks=[task] * num_tasks, prompts=np.ones((num_tasks, 4), np.int32),
                            prompt_lengths=np.full(num_tasks, 3))
        self.length = length

    def sample_and_grade(self, params, task_ids, key, version, group_size=1):
        n, q = len(task_ids), float(params["q"])
        return types.SimpleNamespace(
            lengths=np.full(n, self.length), texts=["    return x\n"] * n, tokens=np.full((n, M), 7, np.int32),
            logprobs=np.full((n, M), -0.25, np.float32), pass_fraction=np.full(n, q, np.float32),
            passed=np.full(n, q == 1.0), valid=np.ones(n, bool))


def deployment(tmp_path, **kw):
    return Deployment(DeploymentConfig(**kw), FakeCollector(), str(tmp_path / "registry"),
                      str(tmp_path / "usage.jsonl"), template={"q": np.zeros(())})


def test_registry_publishes_atomically_and_only_newer_versions(tmp_path):
    root = str(tmp_path / "reg")
    assert registry.current(root) is None and registry.history(root) == []
    registry.publish(root, 0, {"q": np.float32(0.25)}, {"score": 0.1})
    registry.publish(root, 5, {"q": np.float32(0.5)}, {"score": 0.2})
    assert registry.current(root)["version"] == 5 and registry.current(root)["score"] == 0.2
    assert [h["version"] for h in registry.history(root)] == [0, 5]
    assert float(registry.load(root, 0, target={"q": np.zeros((), np.float32)})["q"]) == 0.25
    with pytest.raises(ValueError, match="not newer"):
        registry.publish(root, 5, {"q": np.float32(1.0)})
    with pytest.raises(CheckpointError):
        registry.load(root, 3)


def test_nothing_published_is_a_clear_error(tmp_path):
    with pytest.raises(RuntimeError, match="nothing is published"):
        deployment(tmp_path).advance()


@pytest.mark.parametrize("q", [1.0, 0.6, 0.0])
def test_outcomes_follow_the_users_hidden_preferences(tmp_path, q):
    d = deployment(tmp_path, requests_per_window=100, torn_rate=0.0, duplicate_rate=0.0)
    registry.publish(d.root, 0, {"q": np.float32(q)})
    for _ in range(20):
        d.advance()
    d.now += 10**5
    d._deliver(math.inf)
    rows, _ = read_log(d.writer.path)
    assert len(rows) == 2000
    # The acceptance probability of each request, from the users' hidden bar and patience.
    c = d.cfg
    latency = c.latency_base_s + c.latency_per_token_s * 10
    p = [1 / (1 + math.exp(-c.accept_sharpness * (q - d.bars[int(it.user[1:])])))
         * math.exp(-max(0.0, latency - d.patience[int(it.user[1:])]) / d.patience[int(it.user[1:])]) for it, _ in rows]
    kinds = [{o.kind for o in outs} for _, outs in rows]
    accepted = np.array(["accepted" in k for k in kinds])
    assert abs(accepted.mean() - np.mean(p)) < 4 * math.sqrt(np.mean(p) * (1 - np.mean(p)) / len(rows)) + 1e-9
    assert all("latency" in k for k in kinds)
    if accepted.sum() > 50:
        kept = np.mean(["kept" in k for k, a in zip(kinds, accepted) if a])
        want = c.keep_prob if q == 1.0 else 1 - c.revert_prob
        assert abs(kept - want) < 4 * math.sqrt(want * (1 - want) / accepted.sum()) + 0.01
        assert all(("kept" in k) != ("reverted" in k) for k, a in zip(kinds, accepted) if a)
    follow = np.mean(["followup" in k for k, a in zip(kinds, accepted) if not a])
    assert abs(follow - c.followup_prob) < 0.06
    # No outcome of a request that was not accepted says it was kept or reverted.
    assert not any(("kept" in k or "reverted" in k) for k, a in zip(kinds, accepted) if not a)


def test_delivery_tears_duplicates_and_reorders_records_and_the_log_survives(tmp_path):
    d = deployment(tmp_path, requests_per_window=50, torn_rate=0.05, duplicate_rate=0.1)
    registry.publish(d.root, 0, {"q": np.float32(1.0)})
    for _ in range(10):
        d.advance()
    d._deliver(math.inf)  # everything still in flight (a torn record's retry included)
    rows, counts = read_log(d.writer.path)
    assert len(rows) == 500  # every interaction arrives despite torn writes (they are re-sent)
    assert counts["torn"] == d.counts["torn"] > 0
    assert counts["duplicates"] == d.counts["duplicated"] > 0
    logged = [rec for rec in LogReader(d.writer.path).poll()]
    by_id = {rec.id: rec for rec in logged}
    early = [rec for rec in logged if rec.__class__.__name__ == "Outcome"
             and rec.logged_at < by_id[rec.interaction].logged_at]
    assert early, "some outcome should reach the log before its interaction"
    times = [rec.logged_at for rec in logged]
    assert times == sorted(times)  # appended in arrival order; event times are not
    assert any(b.time < a.time for a, b in zip(logged, logged[1:]))


def test_a_new_release_shares_traffic_with_its_predecessor_and_the_ab_test_sees_the_difference(tmp_path):
    d = deployment(tmp_path, requests_per_window=100, treatment_share=0.3, torn_rate=0.0, duplicate_rate=0.0)
    registry.publish(d.root, 0, {"q": np.float32(0.0)})
    for _ in range(3):
        d.advance()
    registry.publish(d.root, 4, {"q": np.float32(1.0)})
    for _ in range(10):
        d.advance()
    d._deliver(math.inf)
    rows, _ = read_log(d.writer.path)
    versions = [it.version for it, _ in rows]
    assert versions[:300] == [0] * 300
    share = np.mean([v == 4 for v in versions[300:]])
    assert abs(share - 0.3) < 4 * math.sqrt(0.21 / 1000)
    (period,) = ab.rollout_periods(rows)
    assert (period["a"], period["b"]) == (0, 4)
    c = ab.compare(period["rows_a"], period["rows_b"])
    assert c["acceptance"]["diff_ci"][0] > 0.3  # q 1.0 vs 0.0: far more accepted
    assert c["followup"]["diff_ci"][1] < 0
