"""Tokenizers behind one interface, the chat / tool-call template, and the assistant loss mask.

Template
--------
A conversation is a list of messages ``{"role": "system"|"user"|"assistant"|"tool",
"content": str}``. An assistant message may carry ``"tool_calls": [{"name": str, "arguments":
dict}]``; a tool message may carry ``"name"`` (kept for the harness, not rendered). Each message
renders as::

    <|im_start|>{role}\\n{content}[<tool_call>{call_json}</tool_call> ...]<|im_end|>\\n

where ``call_json = json.dumps({"name": name, "arguments": arguments}, sort_keys=True)``, one
``<tool_call>...</tool_call>`` block per call, in order. The generation prompt is
``<|im_start|>assistant\\n``. No ``<|bos|>`` is inserted; a caller that wants one prepends
``bos_id``.

Special tokens are ``<|pad|>``, ``<|bos|>``, ``<|eos|>``, ``<|im_start|>``, ``<|im_end|>``,
``<tool_call>`` and ``</tool_call>``. ``<|eos|>`` is a token of its own rather than an alias of
``<|im_end|>``: ``<|im_end|>`` closes one turn of a multi-turn episode, ``<|eos|>`` ends a
document, and keeping them apart lets pre-training style data and chat data share a vocabulary.
A generation stops at either (`Tokenizer.stop_ids`).

Only the template inserts special ids. `Tokenizer.encode` maps any text, including text that
spells a special token such as ``"<|im_end|>"``, to ordinary ids, so a user or a tool output
cannot inject turn boundaries or tool calls (prompt injection), and the loss mask cannot be
shifted by the content of a message.

Loss mask
---------
`Tokenizer.encode_chat` returns ``(ids, assistant_mask)``, two lists of length T.
``assistant_mask[t]`` is 1 exactly on the tokens the policy produced: the content of assistant
messages, their ``<tool_call>...</tool_call>`` blocks, and their closing ``<|im_end|>``. It is 0 on
system, user and tool messages, on every ``<|im_start|>{role}\\n`` header (including the
generation prompt) and on the ``\\n`` after each ``<|im_end|>``, which the template adds after
generation has stopped.
"""

from __future__ import annotations

import abc
import hashlib
import json
import math
import os
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import tokenizers

PAD = "<|pad|>"
BOS = "<|bos|>"
EOS = "<|eos|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
TOOL_CALL_START = "<tool_call>"
TOOL_CALL_END = "</tool_call>"

# The order fixes the ids of ByteTokenizer: 256 + index.
SPECIAL_TOKENS = (PAD, BOS, EOS, IM_START, IM_END, TOOL_CALL_START, TOOL_CALL_END)
# Tokens the template itself writes; their strings are fixed by the template.
TEMPLATE_TOKENS = (IM_START, IM_END, TOOL_CALL_START, TOOL_CALL_END)

ROLES = ("system", "user", "assistant", "tool")

# Error codes of `parse_tool_calls`.
TOOL_CALL_ERRORS = (
    "unclosed_tag",  # <tool_call> with no </tool_call> before the next <tool_call> or the end
    "unopened_tag",  # </tool_call> with no <tool_call> before it
    "invalid_json",  # the block is not valid JSON
    "not_an_object",  # the JSON is not an object
    "missing_name",  # "name" is absent, not a string, or empty
    "invalid_arguments",  # "arguments" is present but not an object
)

Message = Mapping[str, Any]


def format_tool_call(call: Mapping[str, Any]) -> str:
    """The JSON text of one tool call inside ``<tool_call>...</tool_call>``.

    call: ``{"name": str, "arguments": dict}``. Raises ValueError on a malformed call, so a
    conversation that cannot be rendered faithfully is never rendered.
    """
    name = call.get("name")
    arguments = call.get("arguments", {})
    if not isinstance(name, str) or not name:
        raise ValueError(f"tool call needs a non-empty string 'name', got {name!r}")
    if not isinstance(arguments, Mapping):
        kind = type(arguments).__name__
        raise ValueError(f"tool call {name!r}: 'arguments' must be a dict, got {kind}")
    return json.dumps({"name": name, "arguments": dict(arguments)}, sort_keys=True)


def _tool_call_result(raw: str, name: str | None, arguments: dict | None, error: str | None,
                      message: str | None) -> dict[str, Any]:
    return {"name": name, "arguments": arguments, "error": error, "message": message, "raw": raw}


def _parse_tool_call_body(raw: str) -> dict[str, Any]:
    try:
        obj = json.loads(raw)
    except (ValueError, RecursionError) as e:
        # RecursionError: deeply nested brackets, which a policy can generate.
        return _tool_call_result(raw, None, None, "invalid_json", f"tool call is not valid JSON: {e}")
    if not isinstance(obj, dict):
        return _tool_call_result(raw, None, None, "not_an_object",
                                 f"tool call JSON must be an object, got {type(obj).__name__}")
    name = obj.get("name")
    if not isinstance(name, str) or not name:
        return _tool_call_result(raw, None, None, "missing_name",
                                 f"tool call needs a non-empty string 'name', got {name!r}")
    arguments = obj.get("arguments", {})
    if not isinstance(arguments, dict):
        return _tool_call_result(raw, name, None, "invalid_arguments",
                                 f"tool call {name!r}: 'arguments' must be an object, got "
                                 f"{type(arguments).__name__}")
    return _tool_call_result(raw, name, arguments, None, None)


def parse_tool_calls(text: str) -> list[dict[str, Any]]:
    """Extract the tool calls of generated assistant text; never raises on malformed calls.

    text: decoded assistant output (special tokens rendered as their strings).
    Returns one dict per ``<tool_call>`` block or stray ``</tool_call>``, in order of appearance:
    ``{"name": str | None, "arguments": dict | None, "error": str | None, "message": str | None,
    "raw": str}``. ``error`` is None for a well-formed call, else one of `TOOL_CALL_ERRORS`, with
    a readable ``message``; ``raw`` is the text between the tags (up to the next ``<tool_call>``
    or the end of the text when unclosed). A missing ``"arguments"`` key reads as ``{}``.
    """
    calls: list[dict[str, Any]] = []
    pos = 0
    while True:
        start = text.find(TOOL_CALL_START, pos)
        stray = text.find(TOOL_CALL_END, pos)
        if stray != -1 and (start == -1 or stray < start):
            message = f"{TOOL_CALL_END} at character {stray} has no {TOOL_CALL_START}"
            calls.append(_tool_call_result("", None, None, "unopened_tag", message))
            pos = stray + len(TOOL_CALL_END)
            continue
        if start == -1:
            return calls
        body = start + len(TOOL_CALL_START)
        end = text.find(TOOL_CALL_END, body)
        following = text.find(TOOL_CALL_START, body)
        if end == -1 or (following != -1 and following < end):
            stop = len(text) if following == -1 else following
            calls.append(_tool_call_result(text[body:stop], None, None, "unclosed_tag",
                                           f"{TOOL_CALL_START} at character {start} is never closed"))
            pos = stop
            continue
        calls.append(_parse_tool_call_body(text[body:end]))
        pos = end + len(TOOL_CALL_END)


class Tokenizer(abc.ABC):
    """Text <-> token ids, with the chat template of this module.

    Subclasses implement `encode` and `decode` and set the attributes below in ``__init__``
    (through `_set_special_ids`). The template methods are shared, so every tokenizer renders a
    conversation the same way.

    Attributes:
      vocab_size: ids lie in [0, vocab_size); the size of the embedding table V.
      pad_id, bos_id, eos_id, im_start_id, im_end_id, tool_call_start_id, tool_call_end_id: the
        ids of the special tokens of the module docstring.
      special_tokens: special-token string -> id.
    """

    vocab_size: int
    pad_id: int
    bos_id: int
    eos_id: int
    im_start_id: int
    im_end_id: int
    tool_call_start_id: int
    tool_call_end_id: int
    special_tokens: dict[str, int]

    @abc.abstractmethod
    def encode(self, text: str) -> list[int]:
        """Ids of `text`, length T, with no special tokens added and none produced from the text.

        `text` must be valid Unicode: a lone surrogate (e.g. from ``errors="surrogateescape"``)
        raises, so decode tool output with ``errors="replace"`` first.
        """

    @abc.abstractmethod
    def decode(self, ids: Iterable[int], skip_special: bool = False) -> str:
        """Text of `ids`; special tokens render as their strings unless `skip_special`."""

    @abc.abstractmethod
    def byte_lengths(self) -> list[int]:
        """[vocab_size] the UTF-8 bytes each id stands for on its own; 0 for special and unused ids
        (converts a loss per token into bits per byte)."""

    def fingerprint(self) -> str:
        """A short identity of the mapping between text and ids: the kind, the special tokens and
        the text of every id. Two tokenizers with the same fingerprint give every text the same
        ids, so anything cached as token ids (e.g. demonstrations) keys on it."""
        h = hashlib.sha256(json.dumps([type(self).__name__, self.vocab_size, sorted(self.special_tokens.items())])
                           .encode())
        for i in range(self.vocab_size):
            h.update(self.decode([i]).encode("utf-8", "surrogatepass") + b"\0")
        return h.hexdigest()[:16]

    def _set_special_ids(self, ids: Mapping[str, int]) -> None:
        """Set the special-id attributes from `SPECIAL_TOKENS` entry -> id (all seven)."""
        self.pad_id = ids[PAD]
        self.bos_id = ids[BOS]
        self.eos_id = ids[EOS]
        self.im_start_id = ids[IM_START]
        self.im_end_id = ids[IM_END]
        self.tool_call_start_id = ids[TOOL_CALL_START]
        self.tool_call_end_id = ids[TOOL_CALL_END]

    @property
    def stop_ids(self) -> list[int]:
        """Ids that end a generation: ``<|im_end|>`` then ``<|eos|>`` (once if they are one id)."""
        return list(dict.fromkeys((self.im_end_id, self.eos_id)))

    def apply_chat_template(self, messages: Sequence[Message],
                            add_generation_prompt: bool = True) -> list[int]:
        """Ids of the rendered conversation, length T; see the module docstring."""
        return self.encode_chat(messages, add_generation_prompt=add_generation_prompt)[0]

    def encode_chat(self, messages: Sequence[Message],
                    add_generation_prompt: bool = True) -> tuple[list[int], list[int]]:
        """Render `messages` with the tokenizer's chat template (the built-in one of this module,
        `encode_builtin_chat`, unless a subclass has its own) and mark the assistant's tokens."""
        return self.encode_builtin_chat(messages, add_generation_prompt)

    def encode_builtin_chat(self, messages: Sequence[Message],
                            add_generation_prompt: bool = True) -> tuple[list[int], list[int]]:
        """Render `messages` with the built-in template and mark the tokens the assistant produced.

        Returns ``(ids, assistant_mask)``, both of length T; ``assistant_mask[t]`` is 1 on
        assistant content, tool-call blocks and the assistant's ``<|im_end|>``, 0 elsewhere.
        Raises ValueError on an unknown role, non-string content, or tool calls on a message
        that is not from the assistant.
        """
        missing = [s for s, i in zip(TEMPLATE_TOKENS, (self.im_start_id, self.im_end_id, self.tool_call_start_id,
                                                        self.tool_call_end_id)) if i is None]
        if missing:
            raise ValueError(f"the built-in chat template needs the tokens {missing}, which this vocabulary lacks")
        ids: list[int] = []
        mask: list[int] = []

        def emit(piece: list[int], produced: int) -> None:
            ids.extend(piece)
            mask.extend([produced] * len(piece))

        for i, message in enumerate(messages):
            role = message.get("role")
            content = message.get("content")
            if role not in ROLES:
                raise ValueError(f"message {i}: role must be one of {ROLES}, got {role!r}")
            if not isinstance(content, str):
                kind = type(content).__name__
                raise ValueError(f"message {i} ({role}): content must be a str, got {kind}")
            calls = message.get("tool_calls") or []
            if calls and role != "assistant":
                raise ValueError(f"message {i}: only assistant messages may carry tool_calls, "
                                 f"got role {role!r}")
            produced = int(role == "assistant")
            emit([self.im_start_id], 0)
            emit(self.encode(role + "\n"), 0)
            emit(self.encode(content), produced)
            for call in calls:
                emit([self.tool_call_start_id], produced)
                emit(self.encode(format_tool_call(call)), produced)
                emit([self.tool_call_end_id], produced)
            emit([self.im_end_id], produced)
            emit(self.encode("\n"), 0)
        if add_generation_prompt:
            emit([self.im_start_id], 0)
            emit(self.encode("assistant\n"), 0)
        return ids, mask


class ByteTokenizer(Tokenizer):
    """UTF-8 bytes as tokens: ids 0..255 are bytes, 256..262 the special tokens in the order of
    `SPECIAL_TOKENS`, and ids from 263 up to `vocab_size` are padding that decodes to "".

    vocab_multiple: `vocab_size` is 263 rounded up to a multiple of this (default 64, giving
    320), so the embedding and output matrices tile evenly on accelerators and shard evenly over
    the vocabulary axis; 1 disables the rounding.
    """

    def __init__(self, vocab_multiple: int = 64):
        if vocab_multiple < 1:
            raise ValueError(f"vocab_multiple must be >= 1, got {vocab_multiple}")
        self.special_tokens = {s: 256 + i for i, s in enumerate(SPECIAL_TOKENS)}
        self._set_special_ids(self.special_tokens)
        num_real = 256 + len(SPECIAL_TOKENS)
        self.vocab_size = math.ceil(num_real / vocab_multiple) * vocab_multiple
        self._strings = {i: s for s, i in self.special_tokens.items()}

    def encode(self, text: str) -> list[int]:
        """The UTF-8 bytes of `text`, length T = its byte count; never a special id."""
        return list(text.encode("utf-8"))

    def byte_lengths(self) -> list[int]:
        """One byte for each of the ids 0..255, none for the special and padding ids."""
        return [1] * 256 + [0] * (self.vocab_size - 256)

    def decode(self, ids: Iterable[int], skip_special: bool = False) -> str:
        """Text of `ids`. Byte runs that are not valid UTF-8 decode with U+FFFD replacements;
        padding ids decode to ""; ids outside [0, vocab_size) raise ValueError."""
        parts: list[str] = []
        run = bytearray()
        for token in ids:
            token = int(token)
            if not 0 <= token < self.vocab_size:
                raise ValueError(f"token id {token} is outside [0, {self.vocab_size})")
            if token < 256:
                run.append(token)
                continue
            # A special token ends the byte run: bytes never combine across it.
            parts.append(run.decode("utf-8", errors="replace"))
            run.clear()
            if token in self._strings and not skip_special:
                parts.append(self._strings[token])
        parts.append(run.decode("utf-8", errors="replace"))
        return "".join(parts)

    def save(self, path: str | os.PathLike) -> None:
        """Write this tokenizer as Hugging Face files into directory `path`: a byte-level
        ``tokenizer.json`` with the same ids (each byte one token, no merges; the padding ids as
        reserved special tokens), ``tokenizer_config.json`` with the built-in template as a Jinja
        chat template (`BUILTIN_CHAT_TEMPLATE`), and ``generation_config.json`` whose stop ids
        are `stop_ids`. `load_tokenizer(path)` then encodes text and conversations to the same ids
        and masks, and a model exported with it can be served by Hugging Face tools."""
        from tokenizers import decoders, models, pre_tokenizers  # noqa: PLC0415

        path = os.fspath(path)
        os.makedirs(path, exist_ok=True)
        table = _byte_level_alphabet()
        tok = tokenizers.Tokenizer(models.BPE({table[b]: b for b in range(256)}, []))
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
        tok.decoder = decoders.ByteLevel()
        reserved = [f"<|reserved_{i}|>" for i in range(256 + len(SPECIAL_TOKENS), self.vocab_size)]
        tok.add_special_tokens([tokenizers.AddedToken(t, special=True, normalized=False)
                                for t in list(SPECIAL_TOKENS) + reserved])
        tok.save(os.path.join(path, "tokenizer.json"))
        config = {"bos_token": BOS, "eos_token": EOS, "pad_token": PAD, "chat_template": BUILTIN_CHAT_TEMPLATE,
                  "tokenizer_class": "PreTrainedTokenizerFast"}
        with open(os.path.join(path, "tokenizer_config.json"), "w", encoding="utf-8") as f:
            json.dump(config, f, indent=2)
            f.write("\n")
        with open(os.path.join(path, "generation_config.json"), "w", encoding="utf-8") as f:
            json.dump({"eos_token_id": self.stop_ids, "pad_token_id": self.pad_id, "bos_token_id": self.bos_id}, f,
                      indent=2)
            f.write("\n")


# The built-in template (module docstring) in Jinja, for the files `ByteTokenizer.save` writes.
BUILTIN_CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message.role }}\n{{ message.content }}"
    "{% for call in message.tool_calls or [] %}{% set fn = call.function if call.function is defined else call %}"
    "<tool_call>{{ {'name': fn.name, 'arguments': fn.arguments} | tojson(ensure_ascii=True, sort_keys=True) }}"
    "</tool_call>{% endfor %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _byte_level_alphabet() -> dict[int, str]:
    """byte -> the printable character byte-level BPE files use for it: printable Latin-1 bytes
    stand for themselves, the others for code points from 256 up, in byte order."""
    keep = [b for b in range(256) if 33 <= b <= 126 or 161 <= b <= 172 or 174 <= b <= 255]
    table = {b: chr(b) for b in keep}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


class HFTokenizer(Tokenizer):
    """A Hugging Face ``tokenizers`` tokenizer (a ``tokenizer.json``) behind `Tokenizer`.

    path_or_tokenizer: path of a ``tokenizer.json``, or a ``tokenizers.Tokenizer`` (copied; the
      caller's object is not modified).
    pad_token, bos_token, eos_token: the strings of those three tokens in the file, as the model
      defines them (`load_tokenizer` reads them from ``tokenizer_config.json``).
    chat_template: the model's own Jinja chat template (`rlcode.chat_template`). Without one, the
      built-in template of this module is used and its four tokens must be in the vocabulary
      (unless `require_template_tokens` is False: then `encode_builtin_chat` raises instead);
      with one, template tokens the vocabulary lacks have id None. Only EOS is required: BOS
      None gives ``bos_id = None`` (nothing is prepended), PAD None pads with the EOS id.
      `encode_builtin_chat` renders the built-in template whatever the tokenizer's own is.
    end_of_turn: strings that end an assistant turn besides EOS (e.g. ``<|eot_id|>``); they join
      `stop_ids`. config: the ``tokenizer_config.json`` dict, written back by `save`.

    Every special string must be in the file's vocabulary (as an added token or a model token),
    else ValueError naming it. `vocab_size` is one more than the largest id of the file,
    without rounding: the file fixes the ids.

    User text never becomes special ids: the copy registers the special strings as special added
    tokens and encodes with ``encode_special_tokens=True``, which makes ``tokenizers`` pass
    special strings through the model as plain text instead of matching them (by default
    ``encode(..., add_special_tokens=False)`` still maps ``"<|im_end|>"`` in the text to its
    id). A tokenizer whose model itself maps a special string to the special id (for example a
    word-level vocabulary holding ``"<|im_end|>"``) cannot give this guarantee and is rejected
    with ValueError when constructed. Truncation and padding stored in the file are disabled so
    `encode` never drops text. Under a model's chat template only the text the template writes
    is tokenised with special tokens recognised; message contents are plain text
    (`rlcode.chat_template`). Tool definitions and tool-call arguments are written by the
    template, so they are tokenised as template text.
    """

    def __init__(self, path_or_tokenizer: str | os.PathLike | tokenizers.Tokenizer, *,
                 pad_token: str | None = PAD, bos_token: str | None = BOS, eos_token: str = EOS,
                 chat_template: str | None = None, end_of_turn: Sequence[str] = (),
                 config: Mapping[str, Any] | None = None, require_template_tokens: bool = True):
        if isinstance(path_or_tokenizer, tokenizers.Tokenizer):
            tok = tokenizers.Tokenizer.from_str(path_or_tokenizer.to_str())
            source = "the given tokenizer"
        else:
            tok = tokenizers.Tokenizer.from_file(os.fspath(path_or_tokenizer))
            source = os.fspath(path_or_tokenizer)
        self._file_json = tok.to_str()
        tok.no_truncation()
        tok.no_padding()

        def token_id(string: str, what: str, required: bool) -> int | None:
            found = tok.token_to_id(string)
            if found is None and required:
                what = what if what == string else f"{what} (as {string!r})"
                raise ValueError(f"special token {what} is missing from the vocabulary of {source}")
            return found

        if eos_token is None:
            raise ValueError(f"{source}: an EOS token is required")
        own_template = chat_template is not None
        ids = {EOS: token_id(eos_token, EOS, True),
               BOS: None if bos_token is None else token_id(bos_token, BOS, True),
               PAD: None if pad_token is None else token_id(pad_token, PAD, True)}
        ids.update({s: token_id(s, s, not own_template and require_template_tokens) for s in TEMPLATE_TOKENS})
        turn_ids = [token_id(s, "end_of_turn", True) for s in end_of_turn]
        strings = {PAD: pad_token, BOS: bos_token, EOS: eos_token, **{s: s for s in TEMPLATE_TOKENS}}
        registered = [strings[role] for role, i in ids.items() if i is not None] + list(end_of_turn)
        registered = list(dict.fromkeys(registered))
        # Registering an existing token keeps its id and only marks it special, which is what
        # `encode_special_tokens` acts on (files may store e.g. <tool_call> as a plain added token).
        self._template_tok = tokenizers.Tokenizer.from_str(tok.to_str())
        tok.add_special_tokens(
            [tokenizers.AddedToken(s, special=True, normalized=False) for s in registered])
        tok.encode_special_tokens = True

        self._tok = tok
        self.pad_id = ids[PAD] if ids[PAD] is not None else ids[EOS]
        self.bos_id = ids[BOS]
        self.eos_id = ids[EOS]
        self.im_start_id, self.im_end_id = ids[IM_START], ids[IM_END]
        self.tool_call_start_id, self.tool_call_end_id = ids[TOOL_CALL_START], ids[TOOL_CALL_END]
        self.special_tokens = {strings[role]: i for role, i in ids.items() if i is not None}
        self.special_tokens.update(dict(zip(end_of_turn, turn_ids)))
        self._special_ids = frozenset(self.special_tokens.values())
        self._turn_ids = [i for i in turn_ids if i is not None]
        self.vocab_size = max(tok.get_vocab(with_added_tokens=True).values()) + 1
        self.config = dict(config or {})
        self.chat_template = None
        if own_template:
            from rlcode.chat_template import ChatTemplate  # noqa: PLC0415

            self.chat_template = ChatTemplate(
                chat_template, special={"bos_token": bos_token, "eos_token": eos_token, "pad_token": pad_token},
                end_of_turn=list(dict.fromkeys(list(end_of_turn) + [eos_token])))
        self.tool_call_format = "tags" if self.tool_call_start_id is not None else "json"
        for string in registered:
            for probe in (string, f"a{string}b", f" {string} ", f"\n{string}\n"):
                leaked = self._special_ids.intersection(self._raw_encode(probe))
                if leaked:
                    raise ValueError(
                        f"{source} encodes the plain text {probe!r} to special id(s) "
                        f"{sorted(leaked)}; its model keeps the special string whole, so user "
                        "text could forge template tokens")

    @property
    def stop_ids(self) -> list[int]:
        """Ids that end a generation: the end-of-turn tokens, ``<|im_end|>`` and EOS."""
        ids = self._turn_ids + ([self.im_end_id] if self.im_end_id is not None else []) + [self.eos_id]
        return list(dict.fromkeys(ids))

    def _raw_encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode(self, text: str) -> list[int]:
        """Ids of `text`, length T; never a special id (ValueError if the model would produce one)."""
        ids = self._raw_encode(text)
        leaked = self._special_ids.intersection(ids)
        if leaked:
            # Construction probes the special strings themselves; this guards the rest, e.g. a
            # normalizer or merges that turn other text into a special string.
            raise ValueError(f"text encodes to special id(s) {sorted(leaked)}; "
                             "refusing to forge template tokens")
        return ids

    def decode(self, ids: Iterable[int], skip_special: bool = False) -> str:
        """Text of `ids` through the file's decoder. `skip_special` drops every special token of
        the file (the template's are registered as special); ids outside [0, vocab_size) raise
        ValueError."""
        ids = [int(token) for token in ids]
        for token in ids:
            if not 0 <= token < self.vocab_size:
                raise ValueError(f"token id {token} is outside [0, {self.vocab_size})")
        return self._tok.decode(ids, skip_special_tokens=skip_special)

    def byte_lengths(self) -> list[int]:
        """The UTF-8 bytes each id stands for on its own, 0 for special ids: exact for a
        byte-level vocabulary (each character of such a token is one byte), else the length of
        the id's decoded text (a token holding part of a character counts what decodes)."""
        decoder = json.loads(self._file_json).get("decoder") or {}
        byte_level = decoder.get("type") == "ByteLevel"
        out = []
        for i in range(self.vocab_size):
            piece = None if i in self._special_ids else self._tok.id_to_token(i)
            if piece is None:
                out.append(0)
            else:
                out.append(len(piece) if byte_level else len(self._tok.decode([i]).encode("utf-8")))
        return out

    def encode_chat(self, messages: Sequence[Message], add_generation_prompt: bool = True, *,
                    tools: Sequence[Mapping[str, Any]] | None = None,
                    **template_kwargs: Any) -> tuple[list[int], list[int]]:
        """`Tokenizer.encode_chat` through the model's own chat template when it has one (tools
        and template keywords such as ``enable_thinking`` are passed to it); otherwise the
        built-in template (which takes neither)."""
        if self.chat_template is None:
            if tools or template_kwargs:
                raise ValueError("tools and template keywords need the model's own chat template")
            return self.encode_builtin_chat(messages, add_generation_prompt)
        ids: list[int] = []
        mask: list[int] = []
        for text, kind, produced in self.chat_template.segments(
                messages, tools=tools, add_generation_prompt=add_generation_prompt, **template_kwargs):
            piece = self.encode(text) if kind == "content" else self._template_tok.encode(
                text, add_special_tokens=False).ids
            ids.extend(piece)
            mask.extend([int(produced)] * len(piece))
        return ids, mask

    def parse_tool_calls(self, text: str) -> list[dict[str, Any]]:
        """Tool calls of generated assistant text in this model's format: ``<tool_call>`` blocks
        (`parse_tool_calls`) or, for templates without those tags (Llama 3), the whole turn as
        one JSON object (`parse_json_tool_call`)."""
        return parse_tool_calls(text) if self.tool_call_format == "tags" else parse_json_tool_call(text)

    def save(self, path: str | os.PathLike) -> None:
        """Write ``tokenizer.json`` (as read) and ``tokenizer_config.json`` into directory `path`."""
        path = os.fspath(path)
        os.makedirs(path, exist_ok=True)
        with open(os.path.join(path, "tokenizer.json"), "w", encoding="utf-8") as f:
            f.write(self._file_json)
        strings = {i: s for s, i in self.special_tokens.items()}
        config = dict(self.config)
        config.update(bos_token=strings.get(self.bos_id) if self.bos_id is not None else None,
                      eos_token=strings[self.eos_id],
                      pad_token=strings.get(self.pad_id))
        if self.chat_template is not None:
            config["chat_template"] = self.chat_template.source
        with open(os.path.join(path, "tokenizer_config.json"), "w", encoding="utf-8") as f:
            json.dump(config, f, indent=2, ensure_ascii=False)
            f.write("\n")
        if self._turn_ids:  # end-of-turn tokens live in generation_config.json (its other fields kept)
            generation_file = os.path.join(path, "generation_config.json")
            generation = {}
            if os.path.isfile(generation_file):
                with open(generation_file, encoding="utf-8") as f:
                    generation = json.load(f)
            generation["eos_token_id"] = self._turn_ids
            with open(generation_file, "w", encoding="utf-8") as f:
                json.dump(generation, f, indent=2)
                f.write("\n")


def parse_json_tool_call(text: str) -> list[dict[str, Any]]:
    """The tool call of an assistant turn written as one JSON object (Llama 3's format:
    ``{"name": ..., "parameters": {...}}``, optionally after ``<|python_tag|>``); [] when the
    turn is not JSON-shaped (plain prose is not a call). Results are shaped like those of
    `parse_tool_calls`; "parameters" is read as "arguments"."""
    body = text.strip()
    if body.startswith("<|python_tag|>"):
        body = body[len("<|python_tag|>"):].strip()
    if not body.startswith("{"):
        return []
    result = _parse_tool_call_body(body.replace('"parameters"', '"arguments"', 1) if '"arguments"' not in body else body)
    result["raw"] = body
    return [result]


def _token_string(value: Any) -> str | None:
    """A special-token entry of tokenizer_config.json: a string, an AddedToken dict, or null."""
    if isinstance(value, Mapping):
        return value.get("content")
    return value


def load_tokenizer(spec: str) -> Tokenizer:
    """``"byte"`` -> `ByteTokenizer`; a ``tokenizer.json`` path -> `HFTokenizer` with the
    built-in template and token names; a directory holding ``tokenizer.json`` -> `HFTokenizer`
    as its ``tokenizer_config.json`` defines it (bos/eos/pad, the chat template, also from a
    ``chat_template.jinja`` file; the end-of-turn ids of ``generation_config.json``). Raises
    ValueError for anything else."""
    if spec == "byte":
        return ByteTokenizer()
    if os.path.isdir(spec):
        path = os.path.join(spec, "tokenizer.json")
        config_file = os.path.join(spec, "tokenizer_config.json")
        if os.path.isfile(path) and os.path.isfile(config_file):
            return _from_directory(spec, path, config_file)
    else:
        path = spec
    if os.path.isfile(path):
        return HFTokenizer(path)
    raise ValueError(f"tokenizer spec {spec!r} is neither 'byte' nor a tokenizer.json file "
                     "or a directory holding one")


def _from_directory(directory: str, path: str, config_file: str) -> HFTokenizer:
    with open(config_file, encoding="utf-8") as f:
        config = json.load(f)
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: the default one
        named = {t.get("name"): t.get("template") for t in template}
        template = named.get("default")
    jinja_file = os.path.join(directory, "chat_template.jinja")
    if template is None and os.path.isfile(jinja_file):
        with open(jinja_file, encoding="utf-8") as f:
            template = f.read()
    eos = _token_string(config.get("eos_token"))
    if eos is None:
        raise ValueError(f"{config_file}: eos_token is not set")
    end_of_turn: list[str] = []
    generation = os.path.join(directory, "generation_config.json")
    if os.path.isfile(generation):
        with open(generation, encoding="utf-8") as f:
            stop = json.load(f).get("eos_token_id")
        raw = tokenizers.Tokenizer.from_file(path)
        for token_id in ([stop] if isinstance(stop, int) else stop or []):
            string = raw.id_to_token(int(token_id))
            if string is None:
                raise ValueError(f"{generation}: eos_token_id {token_id} is not in the vocabulary")
            end_of_turn.append(string)
    return HFTokenizer(path, pad_token=_token_string(config.get("pad_token")),
                       bos_token=_token_string(config.get("bos_token")), eos_token=eos, chat_template=template,
                       end_of_turn=end_of_turn, config=config, require_template_tokens=False)


# Text whose ids two tokenizers must agree on to feed the same model (`id_mismatch`): code with
# the identifiers, literals, indentation and non-ASCII text any trained vocabulary splits its own way.
ID_PROBE = (
    "import os\nfrom collections import defaultdict\n\n\nclass Inventory:\n"
    "    \"\"\"Counts of items per warehouse, e.g. {'north': 12}.\"\"\"\n\n"
    "    def __init__(self, path: str, limit: int = 1024) -> None:\n"
    "        self.counts = defaultdict(int)\n        self.path = os.path.join(path, 'stock.json')\n\n"
    "    def add(self, name, amount=1):\n        if amount <= 0:\n"
    "            raise ValueError(f\"amount must be positive, got {amount!r}\")\n"
    "        self.counts[name] += amount  # caf\u00e9 \u2192 \u03bb\n        return self.counts[name] * 3.5e-2\n"
)


def id_mismatch(a: Tokenizer, b: Tokenizer, text: str = ID_PROBE) -> str | None:
    """None when `a` and `b` give `text` the same ids (as far as a model trained on one can be fed
    the other's), else where they first differ, in words."""
    ids_a, ids_b = a.encode(text), b.encode(text)
    if ids_a == ids_b:
        return None
    i = next((k for k, (x, y) in enumerate(zip(ids_a, ids_b)) if x != y), min(len(ids_a), len(ids_b)))
    return (f"they encode the same text differently from token {i} on "
            f"({ids_a[i:i + 4]} vs {ids_b[i:i + 4]}; {len(ids_a)} vs {len(ids_b)} tokens in all)")


def job_tokenizer(spec: str, init_from: str = "") -> Tokenizer:
    """The tokenizer of a job's ``tokenizer`` field: ``"byte"``, a path (`load_tokenizer`), or
    ``"init_from"`` for the tokenizer files of the checkpoint in ``model.init_from``.

    With ``init_from`` a checkpoint that holds its tokenizer's files and `spec` any other
    tokenizer, the two must give text the same ids (`id_mismatch`): a model fed another
    vocabulary's ids reads noise (a corpus tokenizer retrained on different files is such a
    vocabulary), so that is a ValueError naming both rather than a run that learns nothing."""
    if spec == "init_from":
        if not init_from:
            raise ValueError("tokenizer='init_from' needs model.init_from (a checkpoint directory)")
        return load_tokenizer(init_from)
    tokenizer = load_tokenizer(spec)
    if init_from and os.path.isfile(os.path.join(init_from, "tokenizer.json")):
        problem = id_mismatch(tokenizer, load_tokenizer(init_from))
        if problem is not None:
            raise ValueError(f"tokenizer={spec!r} is not the tokenizer of model.init_from={init_from!r}: {problem}; "
                             "use tokenizer='init_from', or the tokenizer that checkpoint was trained with")
    return tokenizer
