"""What a completion task is to the jobs and the evaluator, whichever source it comes from.

A completion task gives the policy a text prompt and grades the text it writes. The synthesis
tasks (`rlcode.envs.tasks.synth.SynthTask`) and HumanEval (`rlcode.envs.tasks.humaneval`)
implement it; the synthesis job's pools (`rlcode.train.rollout.EncodedTasks`), its grader
(`rlcode.train.rollout.Grader`) and the evaluator see only this protocol.

Grading always goes through the trusted-verdict path (`rlcode.envs.verdict`): `check_groups`
returns what the sandboxed child evaluates (the candidate's program and the inputs, never an
expected result), and `score` reads the `Verdict` in this, the trusted, process. A verdict whose
report channel was forged scores 0 whatever `score` says (the grader enforces it).

`SOURCES` names the task sources a config may choose (``task.source``): "synth" (the generated
program-synthesis tasks) and "humaneval" for the completion job; the repository tasks of the agent
job ("repo") follow their own protocol (`rlcode.envs.tasks.repo`).

Clarifying questions: where a job allows them (the synthesis job's ``task.allow_questions``), a
completion whose first non-blank line starts with `QUESTION_MARK` (``# ask:``, after indentation)
is a question to the user instead of an answer: it is not executed, and its reward is the
question's (``reward.question_reward``). `is_question` decides; `QUESTION_DEMO` is the question
the demonstrations ask (``task.question_demos``).
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from rlcode.envs import verdict

COMPLETION_SOURCES = ("synth", "humaneval")
QUESTION_MARK = "# ask:"
QUESTION_DEMO = "    # ask: what about other inputs?\n"


def is_question(completion: str) -> bool:
    """Whether `completion` asks instead of answering: its first non-blank line, without its
    indentation, starts with `QUESTION_MARK`."""
    for line in completion.splitlines():
        if line.strip():
            return line.lstrip().startswith(QUESTION_MARK)
    return False


@runtime_checkable
class CompletionTask(Protocol):
    """task_id: unique within its source; source: e.g. "synth"; split: the source's split name;
    difficulty: a small positive level (what it measures is the source's, e.g. program depth)."""

    task_id: str
    split: str
    difficulty: int

    @property
    def source(self) -> str: ...

    def completion_prompt(self) -> str:
        """The prompt a base model continues."""

    def completion_target(self) -> str:
        """A reference continuation of the prompt (an SFT demonstration; it passes)."""

    def check_groups(self, completion: str) -> list[verdict.CheckGroup]:
        """What the sandboxed child runs for this completion (no expected values)."""

    def score(self, v: verdict.Verdict) -> float:
        """The fraction of the task's checks passed, in [0, 1] (1: solved), judged here."""
