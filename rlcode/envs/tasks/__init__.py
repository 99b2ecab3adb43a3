"""Generated task families for RL training: program synthesis (`synth`, whose names this package
re-exports) and repositories with a planted bug or a missing feature (`repo`, the agent job's)."""

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
