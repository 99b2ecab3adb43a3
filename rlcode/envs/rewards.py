"""The scalar reward of one repository-task episode, composed of separately logged terms.

``compute_reward(grade, trajectory, task, config) -> (reward, terms, flags, valid)``, with
``reward == sum(terms.values())`` (up to rounding in ``"zero_reward"`` mode, whose reward is
exactly 0). With N the number of tokens the policy generated in
the episode (every turn of every segment, summaries included: ``sum(turn.num_generated)``) and
d = ``task.difficulty``:

* ``tests``: ``grade.pass_fraction`` (``test_reward="pass_fraction"``) or 1.0 if
  ``grade.all_passed`` else 0.0 (``"all_pass"``, the default: the generated tasks keep tests of
  unchanged behaviour that the untouched copy already passes, so the fraction pays for doing
  nothing). A ``timeout`` or ``crash`` grade is a failure: 0 here, and its flag is returned.
* ``length = -length_weight * sigmoid((N - L0(d)) / (length_softness * L0(d)))`` with
  ``L0(d) = length_midpoint * length_growth ** (d - 1)``: a smooth step from 0 to
  ``-length_weight`` centred on a midpoint that grows geometrically with difficulty (defaults:
  1024, 2048, 4096 tokens for levels 1, 2, 3), so an easy task is penalised for length early and
  a hard one late; the width of the step is a fixed fraction of its midpoint, so its shape is
  the same at every level (at N = 0 it is -length_weight * sigmoid(-1 / length_softness),
  -0.0018 with the defaults, at every level). E.g. defaults, d = 1, N = 1024:
  -0.1 * sigmoid(0) = -0.05; d = 3, N = 1024: -0.1 * sigmoid(-3) = -0.0047426.
* ``malformed = -malformed_weight * min(num_malformed_calls, malformed_cap)``.
* ``turns = -turn_weight * num_turns`` (action turns).
* ``hack``: when the grade carries one of ``hack_flags`` (default: every flag of a suspected
  hack, `DEFAULT_HACK_FLAGS`), depending on ``hack_mode``:

  - ``"zero_tests"`` (default): ``tests`` becomes 0 and ``hack = -hack_penalty``; the length,
    malformed and turn penalties stay. A hack therefore never scores above an honest failure of
    the same length and turns (zeroing the whole reward instead would lift a hack above an
    honest failure whose penalties are negative).
  - ``"zero_reward"``: ``hack = -(sum of the other terms)``, so the reward is exactly 0.
  - ``"none"``: no effect; the flags are still returned for logging.

  Otherwise ``hack = 0``.

Infrastructure failures are masked, not scored: when ``grade.status == "infra"`` or the
trajectory recorded an executor failure (``trajectory.infra_failure``), the result is
``(0.0, every term 0.0, flags + ("infra",), False)``; drop the sample from the batch.

``flags`` is the grade's flags (sorted), plus ``"infra"`` when invalid.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import ml_collections

from rlcode.checks import apply_overrides, config_get
from rlcode.envs import grading

TEST_REWARDS = ("pass_fraction", "all_pass")
HACK_MODES = ("zero_tests", "zero_reward", "none")
DEFAULT_HACK_FLAGS = ("early_exit", "fake_output", "forged_report", "protected_file_changed", "read_heldout",
                      "skipped", "tampered", "tests_edited")
TERMS = ("tests", "length", "malformed", "turns", "hack")


@dataclasses.dataclass(frozen=True)
class RewardConfig:
    """The fields `compute_reward` reads (a `ConfigDict` or dict with these names works too).

    test_reward: "pass_fraction" | "all_pass".
    length_weight, length_midpoint, length_growth, length_softness: the length penalty (module
      docstring); length_growth >= 1 so that the midpoint never shrinks with difficulty.
    malformed_weight, malformed_cap: penalty per malformed tool call, counted up to the cap.
    turn_weight: penalty per action turn.
    hack_flags: grade flags that count as a hack. hack_mode: "zero_tests" | "zero_reward" |
      "none". hack_penalty: extra penalty of a hack in "zero_tests" mode.
    """

    test_reward: str = "all_pass"
    length_weight: float = 0.1
    length_midpoint: float = 1024.0
    length_growth: float = 2.0
    length_softness: float = 0.25
    malformed_weight: float = 0.05
    malformed_cap: int = 10
    turn_weight: float = 0.01
    hack_flags: tuple[str, ...] = DEFAULT_HACK_FLAGS
    hack_mode: str = "zero_tests"
    hack_penalty: float = 0.0


def reward_config(**overrides: Any) -> ml_collections.ConfigDict:
    """Default ``reward`` section of an experiment config (the `RewardConfig` fields)."""
    cfg = ml_collections.ConfigDict({f.name: f.default for f in dataclasses.fields(RewardConfig)})
    apply_overrides(cfg, overrides, "reward")
    read_reward_config(cfg)
    return cfg


def read_reward_config(config: Any = None) -> RewardConfig:
    """A validated `RewardConfig` from a RewardConfig, ConfigDict, dict or None (defaults);
    ValueError naming the field otherwise."""
    if isinstance(config, RewardConfig):
        values = dataclasses.asdict(config)
    else:
        defaults = RewardConfig()
        values = {f.name: config_get(config, f.name, getattr(defaults, f.name))
                  for f in dataclasses.fields(RewardConfig)} if config is not None else dataclasses.asdict(defaults)
    if isinstance(values["hack_flags"], str):
        raise ValueError(f"reward.hack_flags must be a sequence of flag names, got {values['hack_flags']!r}")
    values["hack_flags"] = tuple(values["hack_flags"])
    cfg = RewardConfig(**values)
    if cfg.test_reward not in TEST_REWARDS:
        raise ValueError(f"reward.test_reward={cfg.test_reward!r} is not one of {TEST_REWARDS}")
    if cfg.hack_mode not in HACK_MODES:
        raise ValueError(f"reward.hack_mode={cfg.hack_mode!r} is not one of {HACK_MODES}")
    unknown = sorted(set(cfg.hack_flags) - set(grading.FLAGS))
    if unknown:
        raise ValueError(f"reward.hack_flags has unknown flags {unknown}; known: {grading.FLAGS}")
    for name in ("length_weight", "malformed_weight", "turn_weight", "hack_penalty", "malformed_cap"):
        if not getattr(cfg, name) >= 0:
            raise ValueError(f"reward.{name} must be >= 0, got {getattr(cfg, name)!r}")
    for name in ("length_midpoint", "length_softness"):
        if not getattr(cfg, name) > 0:
            raise ValueError(f"reward.{name} must be > 0, got {getattr(cfg, name)!r}")
    if not cfg.length_growth >= 1:
        raise ValueError(f"reward.length_growth must be >= 1 (the midpoint grows with difficulty), "
                         f"got {cfg.length_growth!r}")
    return cfg


def _sigmoid(x: float) -> float:
    if x >= 0:
        return 1.0 / (1.0 + math.exp(-x))
    z = math.exp(x)
    return z / (1.0 + z)


def length_midpoint(difficulty: int, config: Any = None) -> float:
    """L0(d) = length_midpoint * length_growth ** (d - 1)."""
    cfg = read_reward_config(config)
    return cfg.length_midpoint * cfg.length_growth ** (difficulty - 1)


def length_penalty(num_tokens: int, difficulty: int, config: Any = None) -> float:
    """-length_weight * sigmoid((num_tokens - L0(d)) / (length_softness * L0(d)))."""
    cfg = read_reward_config(config)
    if difficulty < 1:
        raise ValueError(f"difficulty must be >= 1, got {difficulty}")
    mid = length_midpoint(difficulty, cfg)
    return -cfg.length_weight * _sigmoid((num_tokens - mid) / (cfg.length_softness * mid))


def generated_tokens(trajectory: Any) -> int:
    """Tokens the policy generated in the episode (all turns, summaries included)."""
    return int(sum(turn.num_generated for turn in trajectory.turns))


def compute_reward(grade: grading.GradeResult, trajectory: Any, task: Any,
                   config: Any = None) -> tuple[float, dict[str, float], tuple[str, ...], bool]:
    """(reward, terms, flags, valid) of one episode; see the module docstring for every term.

    grade: `grading.grade`'s verdict on the episode's final copy. trajectory: the episode's
    `rlcode.envs.harness.Trajectory` (turns, num_malformed_calls, num_turns, infra_failure).
    task: the `RepoTask` (its difficulty). config: `RewardConfig`, ConfigDict, dict or None.
    """
    cfg = read_reward_config(config)
    flags = tuple(sorted(grade.flags))
    if grade.status == "infra" or getattr(trajectory, "infra_failure", False):
        return 0.0, {name: 0.0 for name in TERMS}, tuple(sorted(set(flags) | {"infra"})), False
    if grade.status == "ok":
        tests = grade.pass_fraction if cfg.test_reward == "pass_fraction" else float(grade.all_passed)
    else:  # timeout / crash: the candidate's own failure
        tests = 0.0
    terms = {
        "tests": float(tests),
        "length": length_penalty(generated_tokens(trajectory), task.difficulty, cfg),
        "malformed": -cfg.malformed_weight * min(trajectory.num_malformed_calls, cfg.malformed_cap),
        "turns": -cfg.turn_weight * trajectory.num_turns,
        "hack": 0.0,
    }
    hacked = cfg.hack_mode != "none" and bool(set(flags) & set(cfg.hack_flags))
    if hacked and cfg.hack_mode == "zero_tests":
        terms["tests"] = 0.0
        terms["hack"] = -cfg.hack_penalty
    elif hacked:  # zero_reward
        terms["hack"] = -sum(v for k, v in terms.items() if k != "hack")
    reward = 0.0 if hacked and cfg.hack_mode == "zero_reward" else sum(terms.values())
    return float(reward), terms, flags, True
