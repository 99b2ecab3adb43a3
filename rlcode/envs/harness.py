"""The tool-calling episode loop: policy turns, concurrent tool calls, self-summarisation.

`run_episode` plays one task with any policy: ``policy_fn(token_ids) -> generated token ids``
(the caller wraps its sampler; tests replay scripted turns). Each turn:

1. The context (a list of ids ending in the generation prompt ``<|im_start|>assistant\\n``) goes
   to the policy. Its output is cut after the first stop id (`Tokenizer.stop_ids`) and at
   ``max_response_tokens``; these ids enter the trajectory **unchanged** (re-encoding decoded
   text could change them, and the log-probs of the update must be those of the sampled ids).
   A turn that ended without ``<|im_end|>`` gets one appended, as the template's closing.
2. The decoded text is parsed with `rlcode.tokenizer.parse_tool_calls`. All calls of the turn run
   concurrently in a thread pool; their observations come back, in call order, as one ``tool``
   message whose content is ``<tool_response>\\n{observation}\\n</tool_response>`` per call, joined
   by newlines. Malformed calls (the parse errors, unknown tools, bad arguments) get an error
   observation at their place and are counted. A turn without any call gets a user reminder.
3. The episode ends after a turn that called ``submit``, after ``max_turns`` turns, or when the
   token budget is exhausted.

Masks: the ids of a segment are exactly the concatenation of the built-in template's rendering
of its messages (`Tokenizer.encode_builtin_chat`, which renders message by message; the
``<|im_start|>`` / ``<tool_call>`` format of the Qwen family, so a tokenizer needs those tokens,
and a model's own template is not used here), except that assistant tokens are the sampled ids.
``policy_mask`` is 1 on the sampled ids (including their ``<|im_end|>``) and 0 on everything
else, which is ``encode_builtin_chat``'s assistant mask whenever the
policy's output is the template's rendering of its message (checked in the tests). ``turn_index``
is k on the tokens from the header of generation k through the tool response to it, and on the
prompt before the first generation of a segment.

Budget and self-summarisation: an action turn is generated only if the context has room for it
(header, ``max_response_tokens``, closing) and, after it, for a summary request and a summary of
up to ``max_response_tokens``. When it has not, the agent is asked (a user message holding
`summary_prompt`) to summarise its progress, and the episode continues in a fresh segment whose
context is system + instruction + the summary (a user message). Observations are cut so that
this room stays free; if even empty observations do not fit, the tool message is left out and
the summary request follows. The trajectory keeps every segment (each its own sequence with its
own masks), so one final reward trains all of them. With ``summary_prompt=None`` the episode ends
when the next turn does not fit (``end_reason="context"``). ``max_total_tokens`` optionally
bounds the tokens of all segments together (``end_reason="token_budget"``).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import os
import tempfile
from collections.abc import Callable, Sequence
from typing import Any

from rlcode import tokenizer as tk
from rlcode.envs import tools
from rlcode.envs.tasks import repo as repo_tasks
from rlcode.sandbox import fstree

SYSTEM_PROMPT = """\
You are a software engineer working in a small Python repository. Use the tools to inspect and \
change the repository and to run its tests; call submit when the task is done.

To call a tool, write <tool_call>{{"name": TOOL_NAME, "arguments": {{...}}}}</tool_call> with JSON \
inside the tags. You may make several calls in one reply: they run concurrently, and their results \
come back in the same order, each inside <tool_response>...</tool_response>. Paths are relative to \
the repository root.

Tools (JSON schema of each tool's arguments):
{tools}"""

COMPACT_SYSTEM_PROMPT = """\
Fix the Python repository with tools; call submit when done. Call a tool as \
<tool_call>{{"name": NAME, "arguments": {{...}}}}</tool_call>. Tools:
{tools}"""

SUMMARY_PROMPT = (
    "Your context window is nearly full. Summarise your progress on the task so far: what you have "
    "found, which files you changed and how, what remains to be done, and anything else you need to "
    "continue. The conversation will continue from your summary alone. Do not call tools in this reply.")

SUMMARY_HEADER = "Summary of your progress so far (the earlier conversation was cleared to free context):\n"

NO_CALL_REMINDER = ("Your reply contained no tool call. Call a tool to continue, or call submit "
                    "when the task is done.")

_SUMMARY_SLACK = 8  # tokens of slack for a tokenizer whose encoding of joined texts is longer

END_REASONS = ("submitted", "max_turns", "context", "token_budget")

PolicyFn = Callable[[list[int]], Sequence[int]]


@dataclasses.dataclass
class ToolCallRecord:
    """One call of a turn. status: "ok" | "malformed" | "error" | "infra"; error: the parse error
    code of `rlcode.tokenizer.TOOL_CALL_ERRORS`, "unknown_tool" or "invalid_arguments" for a
    malformed call, else None."""

    turn: int
    name: str | None
    arguments: dict[str, Any] | None
    observation: str
    status: str
    error: str | None = None


@dataclasses.dataclass
class Turn:
    """One generation. kind: "action" or "summary"; truncated: no stop id within the response
    limit; calls: the tool calls of an action turn."""

    index: int
    segment: int
    kind: str
    text: str
    num_generated: int
    truncated: bool
    calls: list[ToolCallRecord] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class Segment:
    """One context: ids, policy_mask and turn_index have the same length; messages render to ids
    (up to the sampled assistant ids, see the module docstring). documents: [start, end) spans of
    `ids` that hold a document: the full observation of a successful call of a `document_tools`
    tool (a file the agent read), in order; under squid attention each is its own document."""

    ids: list[int] = dataclasses.field(default_factory=list)
    policy_mask: list[int] = dataclasses.field(default_factory=list)
    turn_index: list[int] = dataclasses.field(default_factory=list)
    messages: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    documents: list[tuple[int, int]] = dataclasses.field(default_factory=list)

    def extend(self, ids: Sequence[int], mask: int | Sequence[int], turn: int) -> None:
        ids = list(ids)
        self.ids.extend(ids)
        self.policy_mask.extend([mask] * len(ids) if isinstance(mask, int) else list(mask))
        self.turn_index.extend([turn] * len(ids))


@dataclasses.dataclass
class Trajectory:
    """The record of one episode.

    segments: one per context (more than one after self-summarisation); train each segment as
      its own sequence with the episode's reward.
    turns, tool_calls: every generation and every call, in order.
    num_turns: action turns; num_summaries: summary turns; num_malformed_calls,
      num_tool_errors, num_infra_errors: calls by status; num_no_call_turns: action turns without
      any call; num_truncated_turns: generations cut at max_response_tokens.
    submitted: the agent called submit. end_reason: one of `END_REASONS`.
    workdir: the working copy, as the agent left it (for grading).
    """

    task_id: str
    segments: list[Segment]
    turns: list[Turn]
    tool_calls: list[ToolCallRecord]
    num_turns: int
    num_summaries: int
    num_malformed_calls: int
    num_tool_errors: int
    num_infra_errors: int
    num_no_call_turns: int
    num_truncated_turns: int
    submitted: bool
    end_reason: str
    workdir: str

    @property
    def ids(self) -> list[int]:
        """The ids of all segments back to back (each segment is a separate context)."""
        return [t for s in self.segments for t in s.ids]

    @property
    def policy_mask(self) -> list[int]:
        return [m for s in self.segments for m in s.policy_mask]

    @property
    def turn_index(self) -> list[int]:
        return [k for s in self.segments for k in s.turn_index]

    @property
    def messages(self) -> list[dict[str, Any]]:
        """The messages of all segments back to back."""
        return [m for s in self.segments for m in s.messages]

    @property
    def infra_failure(self) -> bool:
        """An executor failure happened: mask the episode out of the batch rather than score it."""
        return self.num_infra_errors > 0


def render_system_prompt(registry=tools.TOOLS, *, compact: bool = False) -> str:
    """The system prompt listing `registry`'s tools: with their JSON schemas, or (`compact`) one
    line per tool, ``name(required, optional=)``, for small models with short contexts."""
    if not compact:
        return SYSTEM_PROMPT.format(tools=tools.render_tool_docs(registry))
    lines = []
    for name, spec in registry.items():
        params = spec.schema()["parameters"]
        required = list(params.get("required", ()))
        optional = [p for p in params.get("properties", {}) if p not in required]
        lines.append(f"{name}({', '.join(required + [p + '=' for p in optional])})")
    return COMPACT_SYSTEM_PROMPT.format(tools="\n".join(lines))


def format_tool_message(observations: Sequence[str]) -> str:
    """The content of the tool message answering one turn's calls (in call order)."""
    return "\n".join(f"<tool_response>\n{o}\n</tool_response>" for o in observations)


class ScriptedPolicy:
    """A policy that replays fixed assistant turns, for tests and expert demonstrations.

    turns: each an assistant message ``{"content", "tool_calls"}`` (emitted as the template
    renders it, so the episode's ids equal ``encode_chat`` of its messages), a str (encoded as
    plain text, then ``<|im_end|>``) or a list of ids (emitted verbatim, e.g. without a stop).
    When the context ends with the summary request, `summary` is emitted instead of a turn
    (None: the text "No summary."). After the last turn it emits an empty turn.
    """

    def __init__(self, tokenizer: tk.Tokenizer, turns: Sequence[Any], *, summary: str | None = None,
                 summary_prompt: str = SUMMARY_PROMPT):
        self.tokenizer = tokenizer
        self.turns = list(turns)
        self.position = 0
        self.summary = summary
        self._summary_request = tokenizer.encode_builtin_chat(
            [{"role": "user", "content": summary_prompt}], add_generation_prompt=True)[0]
        self.contexts: list[list[int]] = []

    def render(self, turn: Any) -> list[int]:
        if isinstance(turn, str):
            return self.tokenizer.encode(turn) + [self.tokenizer.im_end_id]
        if isinstance(turn, (list, tuple)):
            return [int(t) for t in turn]
        message = {"role": "assistant", "content": turn.get("content", ""), "tool_calls": turn.get("tool_calls", [])}
        ids, mask = self.tokenizer.encode_builtin_chat([message], add_generation_prompt=False)
        return [t for t, m in zip(ids, mask) if m]

    def __call__(self, ids: Sequence[int]) -> list[int]:
        ids = list(ids)
        self.contexts.append(ids)
        if ids[-len(self._summary_request):] == self._summary_request:
            return self.render(self.summary if self.summary is not None else "No summary.")
        if self.position >= len(self.turns):
            return [self.tokenizer.im_end_id]
        turn = self.turns[self.position]
        self.position += 1
        return self.render(turn)


def _normalise_generation(tokenizer: tk.Tokenizer, generated: Sequence[int],
                          limit: int) -> tuple[list[int], bool, bool]:
    """(kept ids, ended with <|im_end|>, truncated): cut after the first stop id and at `limit`."""
    stops = set(tokenizer.stop_ids)
    kept: list[int] = []
    for t in generated:
        if len(kept) == limit:
            return kept, False, True
        kept.append(int(t))
        if kept[-1] in stops:
            return kept, kept[-1] == tokenizer.im_end_id, False
    return kept, False, len(kept) == limit


class _Episode:
    """State of one `run_episode` call."""

    def __init__(self, task, policy_fn, workspace, tokenizer, pool, *, max_turns, max_context_tokens,
                 max_response_tokens, summary_prompt, max_total_tokens, system_prompt, registry,
                 document_tools=(), pass_documents=False):
        self.task, self.policy_fn, self.ws, self.tok, self.pool = task, policy_fn, workspace, tokenizer, pool
        self.max_turns, self.max_context = max_turns, max_context_tokens
        self.max_response, self.summary_prompt = max_response_tokens, summary_prompt
        self.max_total, self.registry = max_total_tokens, registry
        self.document_tools, self.pass_documents = frozenset(document_tools), pass_documents
        self.base_messages = [{"role": "system", "content": system_prompt},
                              {"role": "user", "content": task.instruction}]
        self.gen_prompt = tokenizer.encode_builtin_chat([], add_generation_prompt=True)[0]
        self.newline = tokenizer.encode("\n")
        self.summary_request = (tokenizer.encode_builtin_chat([{"role": "user", "content": summary_prompt}])[0]
                                if summary_prompt is not None else None)
        self.segments: list[Segment] = []
        self.turns: list[Turn] = []
        self.calls: list[ToolCallRecord] = []
        self.num_actions = 0
        self._check_budget()

    def _render(self, messages) -> list[int]:
        return self.tok.encode_builtin_chat(messages, add_generation_prompt=False)[0]

    def _check_budget(self) -> None:
        base = len(self._render(self.base_messages))
        need = base + self.action_room
        if self.summary_request is not None:
            # The largest fresh context: base + the summary message (at most max_response
            # tokens of summary plus its header); one action turn must still be allowed there.
            header = len(self._render([{"role": "user", "content": SUMMARY_HEADER}]))
            need += header + self.max_response + _SUMMARY_SLACK
        if need > self.max_context:
            raise ValueError(f"max_context_tokens={self.max_context} is too small: the prompt takes {base} "
                             f"tokens and a context must hold {need} (prompt, a summary, one response of "
                             f"max_response_tokens={self.max_response} and room to summarise after it)")

    @property
    def turn_cost(self) -> int:
        """The most tokens one generation adds: header, response, a closing <|im_end|>, newline."""
        return len(self.gen_prompt) + self.max_response + 1 + len(self.newline)

    @property
    def summary_cost(self) -> int:
        """The most tokens a summary request and its answer add."""
        return len(self.summary_request) + self.max_response + 1 + len(self.newline)

    @property
    def action_room(self) -> int:
        """The room an action turn needs: itself, then (with summarisation) a summary after it."""
        return self.turn_cost + (self.summary_cost if self.summary_request is not None else 0)

    @property
    def after_turn_reserve(self) -> int:
        """The room to keep free after a turn's observations: for a summary, else for a turn."""
        return self.summary_cost if self.summary_request is not None else self.turn_cost

    @property
    def total_tokens(self) -> int:
        return sum(len(s.ids) for s in self.segments)

    def new_segment(self, summary: str | None) -> Segment:
        seg = Segment()
        messages = list(self.base_messages)
        if summary is not None:
            messages.append({"role": "user", "content": SUMMARY_HEADER + summary})
        seg.messages.extend(messages)
        seg.extend(self._render(messages), 0, len(self.turns))
        self.segments.append(seg)
        return seg

    def generate(self, seg: Segment, kind: str) -> Turn:
        index = len(self.turns)
        seg.extend(self.gen_prompt, 0, index)
        if self.pass_documents:
            raw = self.policy_fn(list(seg.ids), list(seg.documents))
        else:
            raw = self.policy_fn(list(seg.ids))
        kept, closed, truncated = _normalise_generation(self.tok, raw, self.max_response)
        seg.extend(kept, 1, index)
        if not closed:
            seg.extend([self.tok.im_end_id], 0, index)  # the template's closing, not sampled
        seg.extend(self.newline, 0, index)
        body = kept[:-1] if kept and kept[-1] in self.tok.stop_ids else kept
        text = self.tok.decode(body)
        turn = Turn(index, len(self.segments) - 1, kind, text, len(kept), truncated)
        self.turns.append(turn)
        return turn

    def assistant_message(self, text: str, parsed: list[dict]) -> dict[str, Any]:
        cut = min((i for i in (text.find(tk.TOOL_CALL_START), text.find(tk.TOOL_CALL_END)) if i != -1),
                  default=len(text))
        calls = [{"name": c["name"], "arguments": c["arguments"]} for c in parsed if c["error"] is None]
        return {"role": "assistant", "content": text[:cut], "tool_calls": calls, "text": text}

    def execute(self, turn: Turn, parsed: list[dict]) -> list[ToolCallRecord]:
        records: list[ToolCallRecord | None] = [None] * len(parsed)
        futures = {}
        for i, call in enumerate(parsed):
            if call["error"] is not None:
                observation = f"Error (malformed tool call): {call['message']}"
                records[i] = ToolCallRecord(turn.index, call["name"], call["arguments"], observation, "malformed",
                                            call["error"])
            else:
                futures[i] = self.pool.submit(tools.call_tool, self.ws, call["name"], call["arguments"],
                                              self.registry)
        for i, future in futures.items():
            outcome = future.result()
            call = parsed[i]
            error = None
            if outcome.status == "malformed":
                error = "unknown_tool" if call["name"] not in self.registry else "invalid_arguments"
            records[i] = ToolCallRecord(turn.index, call["name"], call["arguments"], outcome.observation,
                                        outcome.status, error)
        return records  # type: ignore[return-value]

    def add_message(self, seg: Segment, turn: Turn, message: dict[str, Any], shown: Sequence[str]) -> None:
        """Append the message answering `turn`; `shown` are the observations of its calls as the
        message shows them. Those of `document_tools` calls shown in full are recorded as
        document spans (located in the rendered ids, so a tokenizer that merges across an
        observation's boundary simply yields no document)."""
        seg.messages.append(message)
        rendered = self._render([message])
        offset, cursor = len(seg.ids), 0
        for call, shown in zip(turn.calls, shown):
            enc = self.tok.encode(shown)
            at = _find(rendered, enc, cursor) if enc else -1
            if at < 0:
                continue
            cursor = at + len(enc)
            if call.name in self.document_tools and call.status == "ok" and shown == call.observation:
                seg.documents.append((offset + at, offset + at + len(enc)))
        seg.extend(rendered, 0, turn.index)

    def fit_message(self, seg: Segment, message: dict[str, Any],
                    observations: list[str] | None = None) -> tuple[dict[str, Any] | None, list[str]]:
        """(`message`, the observations as shown) such that `after_turn_reserve` tokens stay
        free: a tool message is built from `observations`, shortened as needed. (None, []) if it
        cannot fit at all."""
        room = self.max_context - len(seg.ids) - self.after_turn_reserve
        if observations is None:
            return (message if len(self._render([message])) <= room else None), []
        cap = max((len(o) for o in observations), default=0)
        while True:
            shown = [o if len(o) <= cap else o[:cap] + "\n[... observation cut to fit the context window]"
                     for o in observations]
            candidate = dict(message, content=format_tool_message(shown))
            size = len(self._render([candidate]))
            if size <= room:
                return candidate, shown
            if cap == 0 or room <= 0:
                return None, []
            cap = max(min(int(cap * room / size), cap - 1) - 1, 0)


def run_episode(task: repo_tasks.RepoTask, policy_fn: PolicyFn, executor: tools.Executor, tokenizer: tk.Tokenizer,
                *, max_turns: int, max_context_tokens: int, max_response_tokens: int,
                summary_prompt: str | None = SUMMARY_PROMPT, max_total_tokens: int | None = None,
                root: str | os.PathLike | None = None, workdir: str | None = None,
                system_prompt: str | None = None, registry=tools.TOOLS,
                limits: tools.ToolLimits = tools.ToolLimits(), python: str | None = None,
                max_parallel_calls: int = 8, command_concurrency: int | None | str = "auto",
                document_tools: Sequence[str] = ("read_file",), pass_documents: bool = False) -> Trajectory:
    """Play `task` with `policy_fn` until submit, `max_turns` action turns or the token budget.

    policy_fn: context ids -> generated ids (cut here after the first stop id and at
      `max_response_tokens`). executor: runs the commands of the tools in the working copy.
    max_context_tokens: the most tokens one segment (context) may hold.
    summary_prompt: the request for a progress summary when the context is full; None disables
      self-summarisation.
    max_total_tokens: optional bound on the tokens of all segments together.
    root: where the private copy is created (a new directory per call; default: the system
      temporary directory). workdir: use this already materialised copy instead.
    max_parallel_calls: threads executing the calls of one turn.
    command_concurrency: most executor commands of the episode running at once (None: no
      limit). "auto": 1 when the executor reports ``distinct_uid_per_worker`` in its
      ``guarantees()`` (`rlcode.sandbox.SandboxPool` runs the executions of one working copy one
      after another, each on a private copy brought back at its end, so more at once would only
      hold pool workers waiting), else no limit.
    document_tools: tools whose full observations are recorded as document spans
      (`Segment.documents`). pass_documents: call ``policy_fn(ids, documents)`` with the
      segment's spans (a sampler that reuses document KV under squid attention) instead of
      ``policy_fn(ids)``.
    Returns the `Trajectory`; its `workdir` holds the final copy (the caller removes it).
    Raises ValueError when max_context_tokens cannot hold the prompt, a summary and one turn.
    """
    if max_turns < 1 or max_response_tokens < 1:
        raise ValueError(f"max_turns and max_response_tokens must be >= 1, got {max_turns}, {max_response_tokens}")
    system_prompt = render_system_prompt(registry) if system_prompt is None else system_prompt
    if command_concurrency == "auto":
        command_concurrency = 1 if _distinct_uid_per_worker(executor) else None
    created = workdir is None
    if created:
        workdir = repo_tasks.materialize(task, root if root is not None else tempfile.gettempdir())
    try:
        protected = (repo_tasks.HELDOUT_DIR, *task.heldout_tests)
        ws = tools.Workspace(workdir, executor, test_paths=task.visible_test_files, protected=protected,
                             limits=limits, command_concurrency=command_concurrency,
                             **({"python": python} if python else {}))
        with concurrent.futures.ThreadPoolExecutor(max_workers=max_parallel_calls,
                                                   thread_name_prefix="rlcode-tool") as pool:
            ep = _Episode(task, policy_fn, ws, tokenizer, pool, max_turns=max_turns,
                          max_context_tokens=max_context_tokens, max_response_tokens=max_response_tokens,
                          summary_prompt=summary_prompt, max_total_tokens=max_total_tokens,
                          system_prompt=system_prompt, registry=registry, document_tools=document_tools,
                          pass_documents=pass_documents)
            end_reason = _loop(ep)
    except BaseException:
        if created:  # no trajectory points at the copy: do not leave it behind
            fstree.remove(workdir)  # never raises, whatever the episode left in the copy
        raise
    counts = {s: sum(c.status == s for c in ep.calls) for s in ("malformed", "error", "infra")}
    actions = [t for t in ep.turns if t.kind == "action"]
    return Trajectory(
        task_id=task.task_id, segments=ep.segments, turns=ep.turns, tool_calls=ep.calls,
        num_turns=len(actions), num_summaries=len(ep.turns) - len(actions),
        num_malformed_calls=counts["malformed"], num_tool_errors=counts["error"],
        num_infra_errors=counts["infra"], num_no_call_turns=sum(not t.calls for t in actions),
        num_truncated_turns=sum(t.truncated for t in ep.turns), submitted=ws.submitted,
        end_reason=end_reason, workdir=ws.root)


def _distinct_uid_per_worker(executor: Any) -> bool:
    guarantees = getattr(executor, "guarantees", None)
    if not callable(guarantees):
        return False
    try:
        return bool(guarantees().get("distinct_uid_per_worker"))
    except Exception:  # an executor whose report fails: be safe
        return True


def _loop(ep: _Episode) -> str:
    seg = ep.new_segment(None)
    while True:
        if ep.num_actions >= ep.max_turns:
            return "max_turns"
        if len(seg.ids) + ep.action_room > ep.max_context:
            if ep.summary_request is None:
                return "context"
            if len(seg.messages) == len(ep.base_messages) + 1:
                return "context"  # a fresh context that cannot take a turn: do not summarise again
            if ep.max_total is not None and ep.total_tokens + ep.summary_cost > ep.max_total:
                return "token_budget"
            seg.messages.append({"role": "user", "content": ep.summary_prompt})
            seg.extend(ep.summary_request[:-len(ep.gen_prompt)], 0, len(ep.turns))
            turn = ep.generate(seg, "summary")
            seg.messages.append({"role": "assistant", "content": turn.text, "tool_calls": [], "text": turn.text})
            seg = ep.new_segment(_cap_summary(ep, turn.text))
            continue
        if ep.max_total is not None and ep.total_tokens + ep.turn_cost > ep.max_total:
            return "token_budget"
        turn = ep.generate(seg, "action")
        ep.num_actions += 1
        parsed = tk.parse_tool_calls(turn.text)
        seg.messages.append(ep.assistant_message(turn.text, parsed))
        if parsed:
            turn.calls = ep.execute(turn, parsed)
            ep.calls.extend(turn.calls)
            if ep.ws.submitted:
                return "submitted"
        if ep.num_actions >= ep.max_turns:
            return "max_turns"
        if parsed:
            names = ",".join(c.name or "?" for c in turn.calls)
            message, shown = ep.fit_message(seg, {"role": "tool", "content": "", "name": names},
                                            [c.observation for c in turn.calls])
        else:
            message, shown = ep.fit_message(seg, {"role": "user", "content": NO_CALL_REMINDER})
        if message is None:
            # No room for the observations: without summarisation the episode cannot go on;
            # with it, the summary request (for which room is reserved) follows.
            if ep.summary_request is None:
                return "context"
            continue
        ep.add_message(seg, turn, message, shown)


def _find(seq: list[int], sub: list[int], start: int) -> int:
    """First index >= start where `sub` occurs in `seq`, else -1."""
    first, n = sub[0], len(sub)
    for i in range(start, len(seq) - n + 1):
        if seq[i] == first and seq[i:i + n] == sub:
            return i
    return -1


def _cap_summary(ep: _Episode, text: str) -> str:
    """The summary text, cut so that its re-encoding stays within max_response_tokens."""
    while len(ep.tok.encode(text)) > ep.max_response:
        text = text[: max(len(text) * 9 // 10 - 1, 0)]
    return text


def expert_demonstration(task: repo_tasks.RepoTask, executor: tools.Executor, tokenizer: tk.Tokenizer, *,
                         root: str | os.PathLike | None = None, max_context_tokens: int = 1 << 17,
                         max_response_tokens: int = 4096, style: str = "full", **kwargs) -> Trajectory:
    """The scripted expert (`repo_tasks.expert_turns`) played through `run_episode`.

    The trajectory's messages are an SFT demonstration in the tokenizer's message format
    (assistant messages with ``tool_calls``, ``tool`` messages with the real observations); its
    ids and policy mask are the training sequence."""
    turns = repo_tasks.expert_turns(task, style)
    return run_episode(task, ScriptedPolicy(tokenizer, turns), executor, tokenizer, max_turns=len(turns),
                       max_context_tokens=max_context_tokens, max_response_tokens=max_response_tokens,
                       root=root, **kwargs)
