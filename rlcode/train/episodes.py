"""Episodes of the agent job: many played concurrently, every turn generated in one batch.

`play_episodes` runs one thread per episode (`rlcode.envs.harness.run_episode`: tool calls run
in the sandbox pool, malformed calls are answered with an error, a context that fills up is
summarised by the policy and continued). Each thread's policy call blocks in a `TurnBatcher`,
which generates the turns of all waiting episodes in one `SessionSampler.generate` call. The
final working copy is graded on held-out checks (`rlcode.envs.grading.grade`) and scored by
`rlcode.envs.rewards.compute_reward` (`grade_episode`).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import tempfile
import threading
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from rlcode.envs import grading, harness, rewards, tools
from rlcode.envs.tasks import repo as repo_tasks
from rlcode.sandbox import fstree
from rlcode.session_sampling import SessionSampler
from rlcode.tokenizer import Tokenizer


class TurnBatcher:
    """Collects the policy calls of concurrently running episodes and answers them in batches.

    Each episode thread calls `policy(row)(ids, documents)` and blocks; `serve` (in the calling
    thread) waits until every live episode is waiting, generates all their turns in one
    `SessionSampler.generate` call, and hands the results back. `done(row)` removes an episode
    that ended. A failure of the sampler is raised in `serve` and in every waiting episode.
    """

    def __init__(self, sampler: SessionSampler, rows: Sequence[int]):
        self.sampler = sampler
        self._cv = threading.Condition()
        self._pending: dict[int, tuple[list[int], list]] = {}
        self._results: dict[int, list[int]] = {}
        self._live = set(rows)
        self._error: BaseException | None = None

    def policy(self, row: int) -> Callable[..., list[int]]:
        def fn(ids, documents=()):
            with self._cv:
                self._pending[row] = (list(ids), list(documents))
                self._cv.notify_all()
                while row not in self._results:
                    if self._error is not None:
                        raise RuntimeError("the sampler failed") from self._error
                    self._cv.wait()
                return self._results.pop(row)
        return fn

    def done(self, row: int) -> None:
        with self._cv:
            self._live.discard(row)
            self._cv.notify_all()

    def serve(self) -> None:
        while True:
            with self._cv:
                while self._live and not self._live <= set(self._pending):
                    self._cv.wait()
                if not self._live:
                    return
                batch, self._pending = self._pending, {}
            try:
                out = self.sampler.generate(batch)
            except BaseException as e:
                with self._cv:
                    self._error = e
                    self._cv.notify_all()
                raise
            with self._cv:
                self._results.update(out)
                self._cv.notify_all()


@dataclasses.dataclass
class Episode:
    """One played and graded episode."""

    task: repo_tasks.RepoTask
    trajectory: harness.Trajectory
    reward: float
    terms: dict[str, float]
    flags: tuple[str, ...]
    valid: bool
    hacked: bool  # the grade raised one of reward.hack_flags
    success: bool  # every held-out test passed and no hack flag was raised
    behavior_logp: np.ndarray | None = None  # the sampler's log-probs of the sampled tokens, in order


def episode_kwargs(cfg: Any) -> dict[str, Any]:
    a = cfg.agent
    registry = {name: tools.TOOLS[name] for name in a.tools} if a.tools else tools.TOOLS
    # A config without agent.edit_hints was written before failed edits showed the closest text.
    return dict(max_turns=a.max_turns, max_context_tokens=a.max_context_tokens,
                max_response_tokens=a.max_response_tokens,
                summary_prompt=harness.SUMMARY_PROMPT if a.summarize else None,
                system_prompt=harness.render_system_prompt(registry, compact=a.compact_prompt), registry=registry,
                limits=tools.ToolLimits(edit_hints=bool(a.get("edit_hints", False))))


_SCORERS: dict[str, Any] = {}
_SCORERS_LOCK = threading.Lock()


def reward_model_for(path: str) -> Any:
    """The reward model saved in `path`, loaded once per process (episodes are graded in threads)."""
    with _SCORERS_LOCK:
        if path not in _SCORERS:
            from rlcode.feedback.reward_model import load_reward_model  # noqa: PLC0415

            _SCORERS[path] = load_reward_model(path, batch_size=1)
        return _SCORERS[path]


def grade_episode(task: repo_tasks.RepoTask, traj: harness.Trajectory, pool: Any, cfg: Any) -> Episode:
    """Grade the episode's final copy and score it; a flagged hack scores no test reward. With
    ``reward.source="reward_model"`` the reward model scores the copy's change
    (`grading.patch_text`, after the task's instruction) instead of the tests."""
    grade = grading.grade(task, traj.workdir, pool, timeout=cfg.sandbox.timeout)
    config = rewards.RewardConfig.from_config(cfg.reward)
    preference = None
    if config.source == "reward_model":
        files, _ = grading.read_workdir(traj.workdir)
        scorer = reward_model_for(config.reward_model)
        preference = float(scorer.score([task.instruction], [grading.patch_text(task, files)])[0])
    reward, terms, flags, valid = rewards.compute_reward(grade, traj, task, config, preference)
    hacked = bool(set(flags) & set(cfg.reward.hack_flags))
    success = valid and grade.status == "ok" and grade.all_passed and not hacked
    return Episode(task, traj, reward, terms, flags, valid, hacked, success)


def play_episodes(tasks: Sequence[repo_tasks.RepoTask], sampler: SessionSampler, params: Any, key: jax.Array,
                  pool: Any, tokenizer: Tokenizer, cfg: Any, *, record: bool = False) -> list[Episode]:
    """Play and grade one episode per entry of `tasks` (len <= sampler.rows), concurrently."""
    if len(tasks) > sampler.rows:
        raise ValueError(f"{len(tasks)} episodes > the sampler's {sampler.rows} rows")
    sampler.start(params, key, record=record)
    batcher = TurnBatcher(sampler, range(len(tasks)))
    kwargs = episode_kwargs(cfg)
    root = tempfile.mkdtemp(prefix="rlcode_agent_")

    def play(row: int) -> Episode:
        task = tasks[row]
        try:
            traj = harness.run_episode(task, batcher.policy(row), pool, tokenizer, root=root, pass_documents=True,
                                       **kwargs)
        finally:
            batcher.done(row)
        try:
            episode = grade_episode(task, traj, pool, cfg)
        finally:
            fstree.remove(traj.workdir)
        episode.behavior_logp = np.concatenate(sampler.logprobs[row] or [np.zeros(0, np.float32)])
        return episode

    try:
        with concurrent.futures.ThreadPoolExecutor(max_workers=len(tasks), thread_name_prefix="rlcode-episode") as ex:
            futures = [ex.submit(play, row) for row in range(len(tasks))]
            batcher.serve()
            return [f.result() for f in futures]
    finally:
        fstree.remove(root)


def called_ok(trajectory: Any, tool: str) -> bool:
    """Whether a call of `tool` in the trajectory succeeded."""
    return any(c.name == tool and c.status == "ok" for c in trajectory.tool_calls)


def hint_follow_ups(trajectory: Any) -> tuple[int, int]:
    """(edits that followed a hinted failure, those whose `old` is the hinted text): each
    ``edit_file`` call right after one the tool refused with the file's closest text
    (`rlcode.envs.tools.edit_hint`), and whether it copied that text."""
    hinted, followed, copied = None, 0, 0
    for call in trajectory.tool_calls:
        if call.name != "edit_file" or call.status not in ("ok", "error"):
            continue
        if hinted is not None:
            followed += 1
            copied += (call.arguments or {}).get("old") == hinted
        hinted = tools.edit_hint(call.observation) if call.status == "error" else None
    return followed, copied


def episode_metrics(episodes: Sequence[Episode], prefix: str) -> dict[str, float]:
    trajs = [e.trajectory for e in episodes]
    hints = np.asarray([hint_follow_ups(t) for t in trajs], np.float64).reshape(-1, 2)
    out = {
        f"{prefix}/success": float(np.mean([e.success for e in episodes])),
        f"{prefix}/reward": float(np.mean([e.reward for e in episodes])),
        f"{prefix}/turns": float(np.mean([t.num_turns for t in trajs])),
        f"{prefix}/generated_tokens": float(np.mean([rewards.generated_tokens(t) for t in trajs])),
        f"{prefix}/malformed_calls": float(np.mean([t.num_malformed_calls for t in trajs])),
        # Calls the tool refused (a path that does not exist, an edit whose `old` text is absent).
        f"{prefix}/tool_errors": float(np.mean([t.num_tool_errors for t in trajs])),
        # Episodes with at least one read_file / edit_file that succeeded: whether the policy names
        # a real file (copies the path from its context) before it can fix anything.
        f"{prefix}/read_ok": float(np.mean([called_ok(t, "read_file") for t in trajs])),
        f"{prefix}/edit_ok": float(np.mean([called_ok(t, "edit_file") for t in trajs])),
        # Edits per episode made right after a failed edit that showed the file's closest text,
        # and those that copied it: whether the policy reads the hint or guesses again.
        f"{prefix}/hint_follow_ups": float(np.mean(hints[:, 0])),
        f"{prefix}/hint_copies": float(np.mean(hints[:, 1])),
        f"{prefix}/submitted": float(np.mean([t.submitted for t in trajs])),
        f"{prefix}/summaries": float(np.mean([t.num_summaries for t in trajs])),
        f"{prefix}/invalid": float(np.mean([not e.valid for e in episodes])),
        f"{prefix}/hack_flagged": float(np.mean([e.hacked for e in episodes])),
    }
    for term in rewards.TERMS:
        out[f"{prefix}/reward_{term}"] = float(np.mean([e.terms.get(term, 0.0) for e in episodes]))
    return out
