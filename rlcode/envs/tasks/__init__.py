"""Generated task families for RL training (program synthesis: `synth`)."""

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
