"""A simulated deployment: users with hidden preferences, a served policy, delayed outcome events.

The real-time RL job (`rlcode.train.usage`) learns from a usage log; on a CPU with no users this
module writes that log. Simulated time advances one window of `window_s` seconds per `advance`:

* `requests_per_window` requests arrive at uniform times, each from one of `num_users` users and
  for a task drawn from the task pool. The live version of the registry serves them; while a newly
  published version is rolled out, each request goes to it with probability `treatment_share` and
  to the previous version otherwise (the A/B comparison of `rlcode.feedback.ab`).
* The served policy samples a completion (its token ids and behaviour log-probs are logged); the
  sandbox runs the task's hidden tests on it: the fraction passed is the *hidden* quality, seen
  by the simulated user only through its outcomes, never logged.
* Latency: ``latency_base_s + latency_per_token_s * tokens`` seconds (a ``latency`` event).
* User u has a hidden bar b_u ~ U(`bar_low`, `bar_high`) and patience p_u ~
  U(`patience_low_s`, `patience_high_s`). It accepts with probability
  ``sigmoid(accept_sharpness * (quality - b_u)) * exp(-max(0, latency - p_u) / p_u)``
  (``accepted`` a few seconds to minutes later). An accepted edit that passes every test is
  ``kept`` after `keep_after_s` with probability `keep_prob` (else ``reverted``); one that fails
  some is ``reverted`` within `keep_after_s` with probability `revert_prob` (else kept). A
  request not accepted gets a dissatisfied ``followup`` with probability `followup_prob`.
* Delivery: each record reaches the log after an exponential delay of mean `delivery_delay_s`
  (so events arrive out of order, and before or after their interaction), is delivered twice
  with probability `duplicate_rate` (at-least-once delivery) and is torn (a writer dies mid-record;
  the record is sent again later) with probability `torn_rate`.
"""

from __future__ import annotations

import dataclasses
import heapq
import math
from typing import Any

import jax
import ml_collections
import numpy as np

from rlcode.checks import ConfigError, TypedSection, integer, real
from rlcode.feedback import registry
from rlcode.feedback.usage_log import Interaction, LogWriter, Outcome, encode_record

__all__ = ["DeploymentConfig", "deployment_config", "Deployment"]


@dataclasses.dataclass(frozen=True)
class DeploymentConfig(TypedSection):
    """The `deployment` section (module docstring)."""

    SPECS = {"requests_per_window": integer(1), "window_s": real(0, low_open=True), "num_users": integer(1),
             "treatment_share": real(0, 1), "latency_base_s": real(0), "latency_per_token_s": real(0),
             "bar_low": real(0, 1), "bar_high": real(0, 1), "patience_low_s": real(0, low_open=True),
             "patience_high_s": real(0, low_open=True), "accept_sharpness": real(0), "keep_after_s": real(0),
             "keep_prob": real(0, 1), "revert_prob": real(0, 1), "followup_prob": real(0, 1),
             "delivery_delay_s": real(0), "duplicate_rate": real(0, 1), "torn_rate": real(0, 1),
             "seed": integer(0)}
    SECTION = "deployment"

    requests_per_window: int = 32
    window_s: float = 600.0
    num_users: int = 64
    treatment_share: float = 0.5
    latency_base_s: float = 0.5
    latency_per_token_s: float = 0.05
    bar_low: float = 0.5
    bar_high: float = 1.0
    patience_low_s: float = 2.0
    patience_high_s: float = 5.0
    accept_sharpness: float = 10.0
    keep_after_s: float = 1800.0
    keep_prob: float = 0.95
    revert_prob: float = 0.8
    followup_prob: float = 0.6
    delivery_delay_s: float = 30.0
    duplicate_rate: float = 0.05
    torn_rate: float = 0.02
    seed: int = 0

    def __post_init__(self):
        super().__post_init__()
        if self.bar_low > self.bar_high:
            raise ConfigError(f"deployment.bar_low={self.bar_low} must be <= deployment.bar_high={self.bar_high}")
        if self.patience_low_s > self.patience_high_s:
            raise ConfigError(f"deployment.patience_low_s={self.patience_low_s} must be <= "
                              f"deployment.patience_high_s={self.patience_high_s}")


def deployment_config(**overrides: Any) -> ml_collections.ConfigDict:
    return DeploymentConfig.default_section(**overrides)


class Deployment:
    """Serves the registry's live version(s) to simulated users and writes the usage log.

    collector: a `rlcode.train.rollout.RolloutCollector` over the users' task pool (its sampler
    and grader serve and grade requests). template: parameters of the served model's structure
    (to load published versions into). key: the records are signed with it (`LogWriter`)."""

    def __init__(self, cfg: DeploymentConfig, collector: Any, registry_root: str, log_path: str, template: Any,
                 key: bytes | None = None):
        self.cfg, self.collector, self.root, self.template = cfg, collector, registry_root, template
        self.writer = LogWriter(log_path, key=key)
        self.rng = np.random.default_rng([cfg.seed, 23])
        self.key = jax.random.key(cfg.seed + 1)
        u = np.random.default_rng([cfg.seed, 29])
        self.bars = u.uniform(cfg.bar_low, cfg.bar_high, cfg.num_users)
        self.patience = u.uniform(cfg.patience_low_s, cfg.patience_high_s, cfg.num_users)
        self.now = 0.0
        self.windows = 0
        self.served: list[tuple[int, Any]] = []  # (version, params): [previous, live] while rolling out
        self._queue: list[tuple[float, int, bytes, bool]] = []  # (arrival, seq, line, may tear)
        self._seq = 0
        self.counts = {"requests": 0, "written": 0, "duplicated": 0, "torn": 0}

    # -------------------------------------------------------------------- serving

    def _refresh(self) -> None:
        live = registry.current(self.root)
        if live is None:
            raise RuntimeError(f"nothing is published in {self.root}: the deployment has no version to serve")
        if self.served and self.served[-1][0] == live["version"]:
            return
        params = registry.load(self.root, live["version"], target=self.template)
        previous = self.served[-1:]  # the version rolled out before keeps serving its share
        self.served = previous + [(int(live["version"]), params)]

    def _serve(self, version: int, params: Any, task_ids: np.ndarray) -> Any:
        n = len(task_ids)
        size = max(4, 1 << (n - 1).bit_length())  # a few fixed shapes for the sampler
        ids = np.concatenate([task_ids, np.resize(task_ids, size - n)])
        self.key, sub = jax.random.split(self.key)
        return self.collector.sample_and_grade(params, ids, sub, version=version, group_size=1), n

    def advance(self) -> float:
        """Serve one more window of requests and deliver every record due by its end; returns the
        new time."""
        c = self.cfg
        self._refresh()
        start, end = self.now, self.now + c.window_s
        n = c.requests_per_window
        times = np.sort(self.rng.uniform(start, end, n))
        users = self.rng.integers(c.num_users, size=n)
        tasks = self.rng.integers(len(self.collector.tasks), size=n)
        arm = np.zeros(n, np.int64)
        if len(self.served) == 2:
            arm = (self.rng.random(n) < c.treatment_share).astype(np.int64)
        for a, (version, params) in enumerate(self.served):
            rows = np.flatnonzero(arm == a) if len(self.served) == 2 else np.arange(n)
            if len(rows) == 0:
                continue
            r, k = self._serve(version, params, tasks[rows])
            for j, i in enumerate(rows[:k]):
                self._answer(version, float(times[i]), int(users[i]), int(tasks[i]), r, j)
        self.counts["requests"] += n
        self.windows += 1
        self.now = end
        self._deliver(end)
        return end

    def _answer(self, version: int, t: float, user: int, task_id: int, r: Any, j: int) -> None:
        c, rng = self.cfg, self.rng
        task = self.collector.tasks.tasks[task_id]
        L = int(r.lengths[j])
        plen = int(self.collector.tasks.prompt_lengths[task_id])
        iid = f"i{self.windows:06d}-{self._seq:08d}"
        self._seq += 1
        latency = c.latency_base_s + c.latency_per_token_s * L
        shown = t + latency
        it = Interaction(id=iid, version=version, time=t, user=f"u{user}", request=task.completion_prompt(),
                         prompt_ids=tuple(int(x) for x in self.collector.tasks.prompts[task_id, :plen]),
                         completion=r.texts[j], completion_ids=tuple(int(x) for x in r.tokens[j, :L]),
                         logprobs=tuple(min(0.0, float(x)) for x in r.logprobs[j, :L]))
        self._send(it.record(), shown)
        events = [("latency", shown, latency)]
        quality = float(r.pass_fraction[j]) if r.valid[j] else 0.0
        p_acc = 1.0 / (1.0 + math.exp(-c.accept_sharpness * (quality - self.bars[user])))
        p_acc *= math.exp(-max(0.0, latency - self.patience[user]) / self.patience[user])
        if rng.random() < p_acc:
            t_acc = shown + rng.exponential(30.0)
            events.append(("accepted", t_acc, 1.0))
            works = bool(r.passed[j]) and bool(r.valid[j])
            if rng.random() < (1 - c.keep_prob if works else c.revert_prob):
                events.append(("reverted", t_acc + rng.uniform(0.0, c.keep_after_s), 1.0))
            else:
                events.append(("kept", t_acc + c.keep_after_s, 1.0))
        elif rng.random() < c.followup_prob:
            events.append(("followup", shown + rng.exponential(120.0), 1.0))
        for kind, when, value in events:
            self._send(Outcome(id=f"{iid}-{kind}", interaction=iid, kind=kind, time=when, value=value).record(), when)

    # -------------------------------------------------------------------- delivery

    def _send(self, record: dict, when: float) -> None:
        c, rng = self.cfg, self.rng
        copies = 2 if rng.random() < c.duplicate_rate else 1
        self.counts["duplicated"] += copies - 1
        for _ in range(copies):
            arrival = when + (rng.exponential(c.delivery_delay_s) if c.delivery_delay_s else 0.0)
            heapq.heappush(self._queue, (arrival, self._seq, record, True))
            self._seq += 1

    def _deliver(self, until: float) -> None:
        while self._queue and self._queue[0][0] <= until:
            arrival, _, record, may_tear = heapq.heappop(self._queue)
            line = encode_record(dict(record, logged_at=arrival), self.writer.key)
            if may_tear and self.rng.random() < self.cfg.torn_rate:
                cut = int(self.rng.integers(1, len(line) - 1))
                self.writer.write_raw(line[:cut])  # the writer dies here; the record is sent again
                self.counts["torn"] += 1
                retry = arrival + 1.0 + self.rng.exponential(max(self.cfg.delivery_delay_s, 1.0))
                heapq.heappush(self._queue, (retry, self._seq, record, False))
                self._seq += 1
                continue
            self.writer.write_raw(line)
            self.counts["written"] += 1

    def close(self) -> None:
        self.writer.close()
