"""A model's own chat template (Jinja, from its tokenizer_config.json), rendered the way the
Hugging Face `transformers` library renders it, and split into token segments with an
assistant mask.

Rendering: a sandboxed Jinja environment with ``trim_blocks`` and ``lstrip_blocks``, the
``loopcontrols`` extension, a ``tojson`` filter that keeps non-ASCII characters, the globals
``raise_exception`` and ``strftime_now``, and a ``{% generation %}`` block that renders its body.
The template sees ``messages``, ``tools``, ``add_generation_prompt``, the special-token strings
(``bos_token``, ``eos_token``, ``pad_token``) and any extra keyword (e.g. ``enable_thinking``).
Tool calls of assistant messages are passed in the nested form templates expect,
``{"type": "function", "function": {"name", "arguments"}}``.

Segmenting (`ChatTemplate.segments`) keeps two guarantees of the built-in template:

* No message can forge template tokens. Each message's content is rendered as a placeholder,
  so only text the template itself wrote is tokenised with special tokens recognised; the
  contents are tokenised as plain text between those pieces.
* The assistant mask covers exactly what the policy produced. An assistant message's tokens
  are the text after the rendering of the messages before it with the generation prompt (the
  point where sampling starts), up to and including the first end-of-turn string after its
  content (its tool-call blocks lie inside). A template for which that rendering is not a
  prefix of the whole conversation's cannot be masked this way, and raises.
"""

from __future__ import annotations

import datetime
import json
from collections.abc import Mapping, Sequence
from typing import Any

import jinja2
from jinja2 import nodes
from jinja2.ext import Extension
from jinja2.sandbox import ImmutableSandboxedEnvironment

ROLES = ("system", "user", "assistant", "tool")


class _Generation(Extension):
    """``{% generation %}...{% endgeneration %}``: marks assistant text for transformers'
    own masking; here the body renders as it is (masking is done by `ChatTemplate.segments`)."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.Scope(body, lineno=lineno)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _raise(message):
    raise jinja2.exceptions.TemplateError(message)


def _placeholder(i: int) -> str:
    # Private-use characters: no tokenizer text and no template literal contains them.
    return f"\ue000{i}\ue001"


def template_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Messages in the form templates read: tool calls nested under "function"."""
    out = []
    for i, message in enumerate(messages):
        role, content = message.get("role"), message.get("content")
        if role not in ROLES:
            raise ValueError(f"message {i}: role must be one of {ROLES}, got {role!r}")
        if not isinstance(content, str):
            raise ValueError(f"message {i} ({role}): content must be a str, got {type(content).__name__}")
        item = dict(message)
        calls = message.get("tool_calls") or []
        if calls and role != "assistant":
            raise ValueError(f"message {i}: only assistant messages may carry tool_calls, got role {role!r}")
        if calls:
            item["tool_calls"] = [
                c if "function" in c else {"type": "function", "function": {"name": c["name"],
                                                                            "arguments": dict(c.get("arguments", {}))}}
                for c in calls]
        out.append(item)
    return out


class ChatTemplate:
    """One Jinja chat template with the special-token strings it is rendered with.

    source: the template text. special: ``{"bos_token": str | None, "eos_token": ..., ...}``.
    end_of_turn: the strings that close an assistant turn (its stop tokens, e.g. ``<|im_end|>``
    or ``<|eot_id|>``), at least one.
    """

    def __init__(self, source: str, *, special: Mapping[str, str | None], end_of_turn: Sequence[str]):
        if not end_of_turn:
            raise ValueError("a chat template needs at least one end-of-turn string")
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=[_Generation, "jinja2.ext.loopcontrols"])
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise
        env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
        try:
            self._template = env.from_string(source)
        except jinja2.TemplateSyntaxError as e:
            raise ValueError(f"chat template does not parse: {e}") from None
        self.source = source
        self.special = {k: v for k, v in special.items() if v is not None}
        self.end_of_turn = tuple(end_of_turn)

    def render(self, messages: Sequence[Mapping[str, Any]], *, tools: Sequence[Mapping[str, Any]] | None = None,
               add_generation_prompt: bool = False, **kwargs: Any) -> str:
        """The conversation as text, exactly as the template writes it."""
        return self._render(template_messages(messages), tools, add_generation_prompt, kwargs)

    def _render(self, messages, tools, add_generation_prompt, kwargs) -> str:
        return self._template.render(messages=messages, tools=tools or None, documents=None,
                                     add_generation_prompt=add_generation_prompt, **self.special, **kwargs)

    def segments(self, messages: Sequence[Mapping[str, Any]], *, tools: Sequence[Mapping[str, Any]] | None = None,
                 add_generation_prompt: bool = False, **kwargs: Any) -> list[tuple[str, str, bool]]:
        """The rendered conversation as (text, kind, produced) pieces in order: kind "template"
        (text the template wrote: tokenise with special tokens recognised) or "content" (a
        message's content: plain text); produced marks the assistant's own tokens."""
        shown = template_messages(messages)
        for i, message in enumerate(shown):
            if message["content"]:
                message["content"] = _placeholder(i)
        full = self._render(shown, tools, add_generation_prompt, kwargs)
        produced = [False] * len(full)
        for i, message in enumerate(shown):
            if message["role"] != "assistant":
                continue
            prefix = self._render(shown[:i], tools, True, kwargs)
            if not full.startswith(prefix):
                raise ValueError(f"message {i}: the template's rendering of the conversation before this assistant "
                                 "message with the generation prompt is not a prefix of the whole conversation, so "
                                 "the assistant's tokens cannot be marked")
            start = len(prefix)
            after = start
            if message["content"]:
                at = full.find(message["content"], start)
                if at < 0:
                    raise ValueError(f"message {i}: the template did not render the assistant's content")
                after = at + len(message["content"])
            ends = [(full.find(s, after), s) for s in self.end_of_turn]
            ends = [(at, s) for at, s in ends if at >= 0]
            if not ends:
                raise ValueError(f"message {i}: no end-of-turn string {list(self.end_of_turn)} after the assistant turn")
            at, s = min(ends)
            produced[start:at + len(s)] = [True] * (at + len(s) - start)
        contents = {_placeholder(i): m["content"] for i, m in enumerate(messages) if m["content"]}
        pieces: list[tuple[str, str, bool]] = []
        pos = 0
        while pos < len(full):
            at = full.find("\ue000", pos)
            stop = len(full) if at < 0 else at
            # Template text, split where the produced flag changes.
            while pos < stop:
                flag = produced[pos]
                end = pos
                while end < stop and produced[end] == flag:
                    end += 1
                pieces.append((full[pos:end], "template", flag))
                pos = end
            if at >= 0:
                close = full.index("\ue001", at) + 1
                key = full[at:close]
                if key not in contents:
                    raise ValueError("the template rendered a message's content in a form it cannot be traced in")
                pieces.append((contents[key], "content", produced[at]))
                pos = close
        seen = [text for text, kind, _ in pieces if kind == "content"]
        if len(seen) != len(contents):
            raise ValueError(f"the template rendered {len(seen)} message contents, expected {len(contents)} "
                             "(each non-empty content exactly once)")
        if "".join(text for text, _, _ in pieces) != self.render(messages, tools=tools,
                                                                 add_generation_prompt=add_generation_prompt, **kwargs):
            raise ValueError("the template changes message contents as it renders them (e.g. trims them), so its "
                             "output cannot be split into template text and contents; pass contents in the form "
                             "the template keeps")
        return pieces
