"""Task sources for RL training and evaluation: generated program synthesis (`synth`, whose names
this package re-exports), HumanEval from the installed package (`humaneval`), generated
repositories with a planted bug or a missing feature (`repo`, the agent job's) and bug-fix tasks
mined from real projects (`mined`). `protocol` says what a completion task is to the jobs."""

from rlcode.envs.tasks.synth import (
    LEVELS,
    PRIMITIVES,
    SPLITS,
    SynthTask,
    check_group,
    completion_prompt,
    completion_target,
    generate_task,
    make_split,
)

__all__ = [
    "LEVELS",
    "PRIMITIVES",
    "SPLITS",
    "SynthTask",
    "check_group",
    "completion_prompt",
    "completion_target",
    "generate_task",
    "make_split",
]
