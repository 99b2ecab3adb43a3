"""Rewards, composed of separately logged terms: of a repository-task episode (the agent job,
`compute_reward`) and of graded program-synthesis completions (the synthesis job,
`synth_rewards`, at the end of this module).

``compute_reward(grade, trajectory, task, config) -> (reward, terms, flags, valid)``, with
``reward == sum(terms.values())`` (up to rounding in ``"zero_reward"`` mode, whose reward is
exactly 0). With N the number of tokens the policy generated in
the episode (every turn of every segment, summaries included: ``sum(turn.num_generated)``) and
d = ``task.difficulty``:

* ``tests``: ``grade.pass_fraction`` (``test_reward="pass_fraction"``) or 1.0 if
  ``grade.all_passed`` else 0.0 (``"all_pass"``, the default: the generated tasks keep tests of
  unchanged behaviour that the untouched copy already passes, so the fraction pays for doing
  nothing). A ``timeout`` or ``crash`` grade is a failure: 0 here, and its flag is returned.
  0 with ``source="reward_model"``.
* ``preference``: with ``source="reward_model"``, ``preference_weight`` times the reward model's
  score of the episode's change (the unified diff of its final copy against the task's files,
  `rlcode.envs.grading.patch_text`, after the task's instruction); else 0.
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

  - ``"zero_tests"`` (default): ``tests`` (and ``preference``) become 0 and ``hack = -hack_penalty``; the length,
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

import jax.numpy as jnp
import ml_collections
import numpy as np

from rlcode import advantages as adv_lib
from rlcode.checks import ConfigError, TypedSection, expect_type, integer, real, sequence, text
from rlcode.envs import grading

TEST_REWARDS = ("pass_fraction", "all_pass")
HACK_MODES = ("zero_tests", "zero_reward", "none")
DEFAULT_HACK_FLAGS = ("early_exit", "fake_output", "forged_report", "protected_file_changed", "read_heldout",
                      "skipped", "tampered", "tests_edited")
TERMS = ("tests", "preference", "length", "malformed", "turns", "hack")
REWARD_SOURCES = ("tests", "reward_model")


# The valid values of the `reward` section's fields (the agent job's schema uses the same Specs).
REWARD_SPECS = {
    "test_reward": text(TEST_REWARDS), "length_weight": real(0), "length_midpoint": real(0, low_open=True),
    "length_growth": real(1), "length_softness": real(0, low_open=True), "malformed_weight": real(0),
    "malformed_cap": integer(0), "turn_weight": real(0), "hack_flags": sequence(text(grading.FLAGS)),
    "hack_mode": text(HACK_MODES), "hack_penalty": real(0), "source": text(REWARD_SOURCES, required=False),
    "reward_model": text(required=False), "preference_weight": real(0, low_open=True, required=False),
}


@dataclasses.dataclass(frozen=True)
class RewardConfig(TypedSection):
    """The agent job's `reward` section, validated and frozen (hashable): what `compute_reward`
    reads. Build it from a section with `from_config`; constructing it directly validates too.

    test_reward: "pass_fraction" | "all_pass".
    length_weight, length_midpoint, length_growth, length_softness: the length penalty (module
      docstring); length_growth >= 1 so that the midpoint never shrinks with difficulty.
    malformed_weight, malformed_cap: penalty per malformed tool call, counted up to the cap.
    turn_weight: penalty per action turn.
    hack_flags: grade flags that count as a hack. hack_mode: "zero_tests" | "zero_reward" |
      "none". hack_penalty: extra penalty of a hack in "zero_tests" mode.
    source: "tests" (the held-out tests pay) or "reward_model" (the reward model saved in
      directory `reward_model` scores the episode's change, times `preference_weight`; the tests
      pay nothing and are logged as gold through the success rate).
    """

    SPECS = REWARD_SPECS
    SECTION = "reward"

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
    source: str = "tests"
    reward_model: str = ""
    preference_weight: float = 1.0

    def __post_init__(self):
        super().__post_init__()
        if self.source == "reward_model" and not self.reward_model:
            raise ConfigError("reward.source='reward_model' needs reward.reward_model (a directory written by "
                              "rlcode.feedback.reward_model.RewardModel.save)")


def reward_config(**overrides: Any) -> ml_collections.ConfigDict:
    """Default ``reward`` section of an experiment config (the `RewardConfig` fields)."""
    return RewardConfig.default_section(**overrides)


def _reward_config(config: RewardConfig | None) -> RewardConfig:
    return RewardConfig() if config is None else expect_type(config, RewardConfig, "config")


def _sigmoid(x: float) -> float:
    if x >= 0:
        return 1.0 / (1.0 + math.exp(-x))
    z = math.exp(x)
    return z / (1.0 + z)


def length_midpoint(difficulty: int, config: RewardConfig | None = None) -> float:
    """L0(d) = length_midpoint * length_growth ** (d - 1); config None: the defaults."""
    cfg = _reward_config(config)
    return cfg.length_midpoint * cfg.length_growth ** (difficulty - 1)


def length_penalty(num_tokens: int, difficulty: int, config: RewardConfig | None = None) -> float:
    """-length_weight * sigmoid((num_tokens - L0(d)) / (length_softness * L0(d))); config None:
    the defaults."""
    cfg = _reward_config(config)
    if difficulty < 1:
        raise ValueError(f"difficulty must be >= 1, got {difficulty}")
    mid = length_midpoint(difficulty, cfg)
    return -cfg.length_weight * _sigmoid((num_tokens - mid) / (cfg.length_softness * mid))


def generated_tokens(trajectory: Any) -> int:
    """Tokens the policy generated in the episode (all turns, summaries included)."""
    return int(sum(turn.num_generated for turn in trajectory.turns))


def compute_reward(grade: grading.GradeResult, trajectory: Any, task: Any, config: RewardConfig | None = None,
                   preference: float | None = None) -> tuple[float, dict[str, float], tuple[str, ...], bool]:
    """(reward, terms, flags, valid) of one episode; see the module docstring for every term.

    grade: `grading.grade`'s verdict on the episode's final copy. trajectory: the episode's
    `rlcode.envs.harness.Trajectory` (turns, num_malformed_calls, num_turns, infra_failure).
    task: the `RepoTask` (its difficulty). config: the `RewardConfig` (`RewardConfig.from_config`
    of the `reward` section), or None for the defaults. preference: the reward model's score of
    the episode's change, required with ``source="reward_model"``.
    """
    cfg = _reward_config(config)
    learned = cfg.source == "reward_model"
    if learned and (preference is None or not math.isfinite(preference)):
        raise ValueError(f"reward.source='reward_model' needs a finite reward-model score, got {preference!r}")
    flags = tuple(sorted(grade.flags))
    if grade.status == "infra" or getattr(trajectory, "infra_failure", False):
        return 0.0, {name: 0.0 for name in TERMS}, tuple(sorted(set(flags) | {"infra"})), False
    if grade.status == "ok":
        tests = grade.pass_fraction if cfg.test_reward == "pass_fraction" else float(grade.all_passed)
    else:  # timeout / crash: the candidate's own failure
        tests = 0.0
    terms = {
        "tests": 0.0 if learned else float(tests),
        "preference": cfg.preference_weight * float(preference) if learned else 0.0,
        "length": length_penalty(generated_tokens(trajectory), task.difficulty, cfg),
        "malformed": -cfg.malformed_weight * min(trajectory.num_malformed_calls, cfg.malformed_cap),
        "turns": -cfg.turn_weight * trajectory.num_turns,
        "hack": 0.0,
    }
    hacked = cfg.hack_mode != "none" and bool(set(flags) & set(cfg.hack_flags))
    if hacked and cfg.hack_mode == "zero_tests":
        terms["tests"] = terms["preference"] = 0.0
        terms["hack"] = -cfg.hack_penalty
    elif hacked:  # zero_reward
        terms["hack"] = -sum(v for k, v in terms.items() if k != "hack")
    reward = 0.0 if hacked and cfg.hack_mode == "zero_reward" else sum(terms.values())
    return float(reward), terms, flags, True


# --------------------------------------------------------------------------------------------
# Program synthesis (the synthesis job's rewards)
# --------------------------------------------------------------------------------------------

SYNTH_TEST_REWARDS = ("all_pass", "pass_fraction")
SYNTH_REWARD_SOURCES = ("tests", "reward_model")
SYNTH_TERMS = ("tests", "preference", "overlong", "truncated", "wrong", "question")
SYNTH_REWARD_SPECS = {"tests": text(SYNTH_TEST_REWARDS), "truncation_penalty": real(0),
                      "timeout": real(0, low_open=True), "source": text(SYNTH_REWARD_SOURCES, required=False),
                      "reward_model": text(required=False), "preference_weight": real(0, low_open=True, required=False),
                      "wrong_penalty": real(0, required=False), "question_reward": real(required=False)}


@dataclasses.dataclass(frozen=True)
class SynthRewardConfig(TypedSection):
    """The synthesis job's `reward` section, validated and frozen (`synth_rewards`).

    tests: "all_pass" | "pass_fraction". truncation_penalty: subtracted from a row that hit
    max_new_tokens without its stop token. timeout: seconds one graded execution may run.
    source: "tests" (the held-out tests are the reward) or "reward_model" (a learned reward: the
    score of the reward model saved in directory `reward_model`, times `preference_weight`; the
    tests still run and are logged as the gold objective, but pay nothing).
    wrong_penalty: subtracted from an answer that does not pass every test (0: a wrong answer
    costs nothing beyond the tests it missed). question_reward: the reward of a clarifying
    question (a job that allows them: ``task.allow_questions``); the tests term of a question is 0.
    """

    SPECS = SYNTH_REWARD_SPECS
    SECTION = "reward"

    tests: str = "all_pass"
    truncation_penalty: float = 0.0
    timeout: float = 5.0
    source: str = "tests"
    reward_model: str = ""
    preference_weight: float = 1.0
    wrong_penalty: float = 0.0
    question_reward: float = 0.0

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.source == "reward_model" and not self.reward_model:
            raise ConfigError("reward.source='reward_model' needs reward.reward_model (a directory written by "
                              "rlcode.feedback.reward_model.RewardModel.save)")


def synth_reward_config(**overrides: Any) -> ml_collections.ConfigDict:
    """The synthesis job's `reward` config section: the `SynthRewardConfig` defaults."""
    return SynthRewardConfig.default_section(**overrides)


def synth_rewards(pass_fraction: np.ndarray, valid: np.ndarray, truncated: np.ndarray, lengths: np.ndarray,
                  max_new_tokens: int, config: SynthRewardConfig, overlong_cache_length: int = 0,
                  preference: np.ndarray | None = None,
                  questions: np.ndarray | None = None) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """(rewards [B], terms {name: [B]}) of B graded completions, ``rewards == sum(terms)``:

    * ``tests``: 1 if every held-out check passed (``tests="all_pass"``) or the fraction passed
      (``"pass_fraction"``); 0 with ``source="reward_model"``;
    * ``preference``: ``preference_weight`` times the reward model's scores `preference` with
      ``source="reward_model"`` (then required), else 0;
    * ``overlong``: DAPO's soft overlong punishment when ``overlong_cache_length > 0``
      (docs/reference.md §3; `rlcode.advantages.overlong_penalty`);
    * ``truncated``: ``-truncation_penalty`` for a row that hit ``max_new_tokens`` without its
      stop token (its body is cut, so it usually fails anyway; the term makes the reason visible).
    * ``wrong``: ``-wrong_penalty`` for an answer that did not pass every test;
    * ``question``: ``question_reward`` for a row of `questions` (a clarifying question instead of
      an answer: not executed, so its ``tests`` and ``wrong`` terms are 0).

    A row that is not `valid` (an infrastructure failure) gets 0 in every term: it is masked,
    never scored as a failure of the policy.
    """
    expect_type(config, SynthRewardConfig, "reward")
    frac = np.asarray(pass_fraction, np.float32)
    tests = (frac >= 1.0).astype(np.float32) if config.tests == "all_pass" else frac
    learned = np.zeros_like(tests)
    if config.source == "reward_model":
        if preference is None or np.shape(preference) != tests.shape:
            raise ValueError(f"reward.source='reward_model' needs one reward-model score per row ({tests.shape[0]}), "
                             f"got {None if preference is None else np.shape(preference)}")
        learned = config.preference_weight * np.asarray(preference, np.float32)
        if not np.isfinite(learned[np.asarray(valid, bool)]).all():
            raise FloatingPointError("the reward model scored a completion as non-finite")
        tests = np.zeros_like(tests)
    asked = np.zeros(tests.shape, bool) if questions is None else np.asarray(questions, bool)
    if asked.shape != tests.shape:
        raise ValueError(f"questions has shape {asked.shape}, expected {tests.shape}")
    wrong = -config.wrong_penalty * ((frac < 1.0) & ~asked).astype(np.float32)
    terms = {"tests": np.where(asked, 0.0, tests), "preference": learned,
             "truncated": -config.truncation_penalty * np.asarray(truncated, np.float32),
             "wrong": wrong, "question": config.question_reward * asked.astype(np.float32)}
    if overlong_cache_length:
        terms["overlong"] = np.asarray(adv_lib.overlong_penalty(jnp.asarray(lengths), max_new_tokens,
                                                                overlong_cache_length), np.float32)
    else:
        terms["overlong"] = np.zeros_like(tests)
    terms = {k: np.where(valid, v, 0.0).astype(np.float32) for k, v in terms.items()}
    return sum(terms.values()).astype(np.float32), terms
