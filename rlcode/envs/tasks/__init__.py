"""Generated task families for RL training (program synthesis: `synth`)."""

from rlcode.envs.tasks.synth import (
    LEVELS,
    PRIMITIVES,
    SPLITS,
    SynthTask,
    completion_prompt,
    completion_target,
    generate_task,
    grading_program,
    make_split,
    parse_grading_output,
)

__all__ = [
    "LEVELS",
    "PRIMITIVES",
    "SPLITS",
    "SynthTask",
    "completion_prompt",
    "completion_target",
    "generate_task",
    "grading_program",
    "make_split",
    "parse_grading_output",
]
