"""The sandboxed half of the trusted-verdict protocol (`rlcode.envs.verdict`): a program.

This file is run *as source text* inside the sandbox (``python -I -B -c <this file>``, or the
in-process mode of the pool); the candidate's code runs in the same process. It therefore holds
nothing worth stealing: it receives only the inputs of the checks (the candidate's source or the
imports of its package, and the expressions or calls to evaluate, with their arguments) and
returns the values the candidate's code computed. The expected results and the comparison live in
the trusted process that reads this program's report; whatever the candidate does to this
program (rebind its functions, write into its report channel, exit early) can only change the
values it claims, never the verdict on them.

Protocol. Standard input: one JSON object (`rlcode.envs.verdict.request_payload`)::

    {"nonce": str, "cwd_on_path": bool,
     "groups": [{"name": str, "source": str | null, "filename": str, "setup": str,
                 "checks": [{"i": int, "expr": str} | {"i": int, "call": str, "args": [typed]}]}]}

Report (the original standard output; descriptor 1 is pointed at standard error before any
candidate code runs, so the candidate's prints cannot mix with it): one line per event,
``<nonce> <json>``: ``{"ready": n}`` once the request is read (before any candidate code runs),
then per check ``{"i": i, "value": typed}``, ``{"i": i, "raised": {...}}``,
``{"i": i, "unencodable": why}`` or ``{"i": i, "setup_error": {...}}``, then ``{"done": n}``,
after which the process ends with ``os._exit(0)`` (no candidate exit handler runs). With ``"watch": [relative paths]`` in the
request, ``{"watched": event, "path": p}`` reports an attempt to open, list, link or move one of
them (a detector, not a defence: see `_watch`).

Typed values (`encode` / `decode`, used by both sides): JSON lists tagged with the exact type,
``["none"]``, ``["bool", b]``, ``["int", "<decimal>"]``, ``["float", "<float.hex()>"]``,
``["str", s]``, ``["bytes", "<hex>"]``, ``["list", [...]]``, ``["tuple", [...]]``,
``["dict", [[k, v], ...]]``, ``["set", [...]]``, ``["frozenset", [...]]``, and
``["object", "<module.qualname>"]`` for anything else (an instance of a subclass of a builtin type
included: an ``int`` subclass is not an ``int``). Only the exact builtin types are walked, so
encoding never calls a method the candidate defined.

Standard library only: the candidate's filesystem view holds no copy of this package.
"""

import json
import os
import sys

MAX_DEPTH = 64
MAX_NODES = 100_000
MAX_CHARS = 1 << 20


class Unencodable(Exception):
    """A value too deep or too large to report."""


def encode(value, _budget=None, _depth=0):
    """The typed JSON form of `value` (see the module docstring); raises `Unencodable`."""
    budget = [MAX_NODES, MAX_CHARS] if _budget is None else _budget
    budget[0] -= 1
    if budget[0] < 0 or _depth > MAX_DEPTH:
        raise Unencodable("value too large or too deeply nested")
    t = type(value)
    if value is None:
        return ["none"]
    if t is bool:
        return ["bool", value]
    if t is int:
        try:
            text = int.__repr__(value)
        except ValueError as e:  # past the interpreter's int-to-str digit limit
            raise Unencodable(str(e)) from None
        budget[1] -= len(text)
        return ["int", text]
    if t is float:
        return ["float", float.hex(value)]
    if t is str:
        budget[1] -= len(value)
        if budget[1] < 0:
            raise Unencodable("value too large")
        return ["str", value]
    if t is bytes:
        budget[1] -= 2 * len(value)
        if budget[1] < 0:
            raise Unencodable("value too large")
        return ["bytes", bytes.hex(value)]
    if t is list or t is tuple:
        return [t.__name__, [encode(v, budget, _depth + 1) for v in value]]
    if t is dict:
        return ["dict", [[encode(k, budget, _depth + 1), encode(v, budget, _depth + 1)]
                         for k, v in dict.items(value)]]
    if t is set or t is frozenset:
        items = [encode(v, budget, _depth + 1) for v in value]
        items.sort(key=json.dumps)
        return [t.__name__, items]
    return ["object", _type_name(t)]


def decode(obj, _budget=None, _depth=0):
    """The value of a typed JSON form; ValueError for anything malformed (strict: exact shapes,
    known tags, bounded size and depth)."""
    budget = [MAX_NODES] if _budget is None else _budget
    budget[0] -= 1
    if budget[0] < 0 or _depth > MAX_DEPTH:
        raise ValueError("typed value too large or too deeply nested")
    if type(obj) is not list or not obj or type(obj[0]) is not str:
        raise ValueError(f"malformed typed value: {str(obj)[:80]}")
    tag, rest = obj[0], obj[1:]
    if tag == "none" and not rest:
        return None
    if len(rest) != 1:
        raise ValueError(f"malformed typed value: {str(obj)[:80]}")
    arg = rest[0]
    if tag == "bool" and type(arg) is bool:
        return arg
    if tag == "int" and type(arg) is str and arg and len(arg) <= 4300:
        digits = arg[1:] if arg[0] == "-" else arg
        if digits.isascii() and digits.isdigit():
            return int(arg)
    elif tag == "float" and type(arg) is str and len(arg) <= 64:
        try:
            return float.fromhex(arg)
        except (ValueError, OverflowError):
            pass
    elif tag == "str" and type(arg) is str:
        return arg
    elif tag == "bytes" and type(arg) is str:
        try:
            return bytes.fromhex(arg)
        except ValueError:
            pass
    elif tag in ("list", "tuple", "set", "frozenset") and type(arg) is list:
        items = [decode(v, budget, _depth + 1) for v in arg]
        if tag == "list":
            return items
        if tag == "tuple":
            return tuple(items)
        try:
            return set(items) if tag == "set" else frozenset(items)
        except TypeError:
            pass
    elif tag == "dict" and type(arg) is list:
        out = {}
        for pair in arg:
            if type(pair) is not list or len(pair) != 2:
                raise ValueError("malformed dict item")
            try:
                out[decode(pair[0], budget, _depth + 1)] = decode(pair[1], budget, _depth + 1)
            except TypeError:
                raise ValueError("unhashable dict key") from None
        return out
    elif tag == "object" and type(arg) is str and len(arg) <= 300:
        return Opaque(arg)
    raise ValueError(f"malformed typed value: {str(obj)[:80]}")


class Opaque:
    """A decoded ``["object", name]``: a value of a type the protocol does not carry; it equals
    nothing."""

    __slots__ = ("type_name",)

    def __init__(self, type_name):
        self.type_name = type_name

    def __repr__(self):
        return f"<{self.type_name} object>"


def _type_name(t):
    try:
        return f"{t.__module__}.{t.__qualname__}"[:300]
    except Exception:  # noqa: BLE001 - a candidate's metaclass may refuse attribute access
        return "?"


def describe(error):
    """{"types": qualified names of the exception's classes, most derived first, "message": ...}."""
    try:
        types = [_type_name(c) for c in type(error).__mro__]
    except Exception:  # noqa: BLE001
        types = ["?"]
    try:
        message = str(error)[:300]
    except BaseException:  # noqa: BLE001 - a candidate's __str__ may raise anything
        message = ""
    return {"types": types, "message": message}


WATCHED_EVENTS = ("open", "os.listdir", "os.scandir", "os.link", "os.symlink", "os.rename", "os.remove")


def _watch(paths, report):
    """Report (once per path) any attempt to open, list, link or move a watched path: files the
    trusted side never puts here (the held-out tests), so only a search for them touches them.
    Detection only: code in this process can evade it; nothing of the verdict depends on it."""
    prefixes = tuple(p.rstrip("/") + "/" for p in paths)
    seen, busy = set(), [False]

    def hook(event, args):
        if event not in WATCHED_EVENTS or busy[0] or not args:
            return
        busy[0] = True
        try:
            for arg in args[:2]:
                if isinstance(arg, bytes):
                    arg = os.fsdecode(arg)
                if not isinstance(arg, str):
                    continue
                path = os.path.realpath(arg)
                if (path in paths or path.startswith(prefixes)) and path not in seen:
                    seen.add(path)
                    report({"watched": event, "path": path})
        except Exception:  # noqa: BLE001 - detection must never break the checks
            pass
        finally:
            busy[0] = False

    sys.addaudithook(hook)


def _read_all(fd):
    chunks = []
    while True:
        chunk = os.read(fd, 1 << 16)
        if not chunk:
            return b"".join(chunks)
        chunks.append(chunk)


def main():
    report_fd = os.dup(1)
    os.dup2(2, 1)
    request = json.loads(_read_all(0))
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    prefix = request["nonce"] + " "
    write, dumps, exit_now = os.write, json.dumps, os._exit

    def report(event):
        data = (prefix + dumps(event) + "\n").encode("utf-8", "backslashreplace")
        while data:
            data = data[write(report_fd, data):]

    # The same import path in both modes: the working directory only at the end, when asked (a
    # candidate module named like a standard one then shadows nothing the checks rely on).
    sys.path[:] = [p for p in sys.path if p not in ("", ".")]
    if request.get("cwd_on_path"):
        sys.path.append(os.getcwd())
    watched = [os.path.join(os.getcwd(), p) for p in request.get("watch", ())]
    if watched:
        _watch(watched, report)
    groups = request["groups"]
    report({"ready": sum(len(g["checks"]) for g in groups)})
    count = 0
    for group in groups:
        namespace = {"__name__": "__checks__", "__builtins__": __builtins__}
        setup_error = None
        try:
            if group.get("source") is not None:
                exec(compile(group["source"], group.get("filename") or "<candidate>", "exec"), namespace)
            if group.get("setup"):
                exec(compile(group["setup"], "<setup>", "exec"), namespace)
        except BaseException as e:  # noqa: BLE001 - SystemExit included: it ends nothing here
            setup_error = describe(e)
        for check in group["checks"]:
            count += 1
            if setup_error is not None:
                report({"i": check["i"], "setup_error": setup_error})
                continue
            try:
                if "expr" in check:
                    value = eval(compile(check["expr"], "<check>", "eval"), namespace)
                else:
                    function = namespace[check["call"]]
                    value = function(*[decode(a) for a in check["args"]])
            except BaseException as e:  # noqa: BLE001
                report({"i": check["i"], "raised": describe(e)})
                continue
            try:
                event = {"i": check["i"], "value": encode(value)}
            except Unencodable as e:
                event = {"i": check["i"], "unencodable": str(e)}
            report(event)
    for stream in (sys.stdout, sys.stderr):  # the candidate's prints, for the logs (fd 1 is stderr now)
        try:
            stream.flush()
        except BaseException:  # noqa: BLE001
            pass
    report({"done": count})
    exit_now(0)


if __name__ == "__main__":
    main()
