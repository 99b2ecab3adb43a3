"""The pytest runner of `rlcode.envs.grading` (`run_heldout`): a program, shipped as text.

`rlcode.envs.grading.RUNNER` is this file's source; the executor runs it inside the sandbox as
``python -I -B -c <this file> <ini> <copy> <heldout dir> <test paths...>`` with the run's nonce on
standard input, and the candidate's code runs in the same process. The steps it takes before any
candidate code runs, the report it writes and what it cannot prevent are described in
`rlcode.envs.grading` (section "The pytest runner").

The whole program is the function `_runner`: its state (the nonce, the report descriptor, the
reporter plugin) lives in that function's locals and closures, not in the globals of ``__main__``,
which any module can import and rebind, and the builtins it needs for the exit code are bound on
its first line. A ``-c`` program runs as ``__main__``, so the guard at the end starts it there;
importing this module (tests, the linter) defines the function and runs nothing. Standard
library and pytest only: nothing else is importable in the grading interpreter.
"""


def _runner():
    import os, sys
    _int, _exit, _write, _str = int, os._exit, os.write, str
    nonce = sys.stdin.readline().strip()
    _null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(_null, 0)
    os.close(_null)
    report_fd = os.dup(1)
    os.dup2(2, 1)
    import re, threading, linecache

    ini, src, held_dir, *paths = sys.argv[1:]
    ini = os.path.abspath(ini)
    os.chdir(src)
    src = os.getcwd()
    held_dir = os.path.join(src, held_dir)
    held_files = [os.path.join(src, p) for p in paths]
    HELD = frozenset(held_files) | {held_dir}
    HELD_PREFIX = held_dir + os.sep
    CANDIDATE_PREFIX = src + os.sep
    PASSED_WORD = re.compile(r"\bPASSED\b")
    WATCHED = frozenset({"gc.get_objects", "gc.get_referrers", "gc.get_referents", "ctypes.string_at",
                         "ctypes.wstring_at", "ctypes.cdata", "sys.settrace", "sys.setprofile",
                         "sys.addaudithook", "sys._getframe"})
    MOVES = frozenset({"os.link", "os.symlink", "os.rename"})
    MEM = re.compile(r"^/proc/[^/]+(/task/[^/]+)?/mem$")
    local = threading.local()
    phase = {"call": False}
    sent = set()


    def emit(kind, text=""):
        text = _str(text).replace("\r", "\\r").replace("\n", "\\n")
        data = ("\n%s %s %s\n" % (nonce, kind, text)).encode("utf-8", "backslashreplace")
        while data:
            data = data[_write(report_fd, data):]


    def emit_once(kind, text):
        if (kind, text) not in sent:
            sent.add((kind, text))
            emit(kind, text)


    def candidate_on_stack():
        frame = sys._getframe(2)
        while frame is not None:
            name = frame.f_code.co_filename
            if name.startswith(CANDIDATE_PREFIX) and not name.startswith(HELD_PREFIX):
                return True
            frame = frame.f_back
        return False


    def source_trap(path):
        """A lazy linecache entry for a deleted held-out file: a lookup of its source (inspect,
        traceback, linecache) finds nothing and is reported like an open."""
        def trap():
            if phase["call"] or candidate_on_stack():
                emit_once("READ", path)
            return None
        return trap


    def resolve(path):
        if isinstance(path, bytes):
            path = os.fsdecode(path)
        if not isinstance(path, str):
            return None
        try:
            return os.path.realpath(path)
        except (OSError, ValueError):
            return None


    def is_held(path):
        return path is not None and (path in HELD or path.startswith(HELD_PREFIX))


    def audit(event, args):
        if event != "open" and event not in MOVES and event not in WATCHED:
            return
        if getattr(local, "busy", False):
            return
        local.busy = True
        try:
            if event in WATCHED:
                if phase["call"] or candidate_on_stack():
                    emit_once("TAMPER", event)
                return
            targets = [resolve(args[0])] if event == "open" else [resolve(a) for a in args[:2]]
            for path in targets:
                if is_held(path):
                    if phase["call"] or candidate_on_stack():
                        emit_once("READ", path)
                elif path is not None and event == "open" and MEM.match(path):
                    if phase["call"] or candidate_on_stack():
                        emit_once("TAMPER", "open " + path)
        finally:
            local.busy = False


    sys.addaudithook(audit)
    for key in [k for k in os.environ if k.startswith("PYTEST_")]:
        del os.environ[key]
    os.environ["PYTEST_DISABLE_PLUGIN_AUTOLOAD"] = "1"
    import builtins, importlib
    import pytest, pluggy


    def watched_objects():
        """(label, namespace, shadows): `shadows(name)` says whether a name added to the namespace
        would hide another binding (None: additions do not matter)."""
        out = [("builtins", builtins.__dict__, None), ("pytest", pytest.__dict__, None)]
        for name in ("_pytest.runner", "_pytest.python", "_pytest.reports", "_pytest.outcomes",
                     "_pytest.main", "_pytest.nodes", "_pytest.skipping", "_pytest.raises",
                     "_pytest.python_api", "_pytest.fixtures", "pluggy._callers", "pluggy._hooks",
                     "pluggy._manager", "pluggy._result"):
            try:
                module = importlib.import_module(name)
            except ImportError:
                continue
            out.append((name, module.__dict__, None))
            for attr in ("Function", "Module", "TestReport", "BaseReport", "CollectReport", "CallInfo",
                         "Session", "Node", "Item", "HookCaller", "PluginManager", "Result",
                         "RaisesExc", "RaisesContext", "FixtureRequest", "HookImpl"):
                cls = module.__dict__.get(attr)
                if isinstance(cls, type) and cls.__module__ == name:
                    out.append((name + "." + attr, cls.__dict__, inherited(cls)))
        return out


    def inherited(cls):
        return lambda key: any(key in base.__dict__ for base in cls.__mro__[1:])


    def is_builtin(key):
        return key in builtins.__dict__


    def snapshot(namespaces):
        return [(label, ns, shadows, dict(ns)) for label, ns, shadows in namespaces]


    def changed(snap, ignore=("__warningregistry__",)):
        for label, ns, shadows, before in snap:
            for key, value in before.items():
                if key not in ignore and (key not in ns or ns[key] is not value):
                    return "%s.%s" % (label, key)
            if shadows is not None and len(ns) > len(before):  # no removals (checked above)
                for key in list(ns):
                    if key not in before and key not in ignore and shadows(key):
                        return "%s.%s (added)" % (label, key)
        return None


    class Reporter:
        def __init__(self):
            self.phases = {}
            self.snap = []
            self.functions = {}

        def check(self):
            what = changed(self.snap)
            if what is None:
                for nodeid, (item, obj, code) in self.functions.items():
                    now = getattr(item, "obj", None)
                    if now is not obj or getattr(now, "__code__", None) is not code:
                        what = "test function " + nodeid
                        break
            if what is not None:
                emit_once("TAMPER", what)

        @pytest.hookimpl(hookwrapper=True, tryfirst=True)
        def pytest_collection(self, session):
            self.snap = snapshot(watched_objects() + [("Reporter", Reporter.__dict__, inherited(Reporter))])
            yield

        def pytest_collection_finish(self, session):
            modules = {}
            for item in session.items:
                module = getattr(item, "module", None)
                if module is not None:
                    modules[id(module)] = module
                obj = getattr(item, "obj", None)
                self.functions[item.nodeid] = (item, obj, getattr(obj, "__code__", None))
            self.snap += snapshot([("test module " + m.__name__, m.__dict__, is_builtin) for m in modules.values()])
            for path in held_files:
                try:
                    os.unlink(path)
                except OSError:
                    pass
                for key in {path, os.path.realpath(path)}:
                    linecache.cache[key] = (source_trap(path),)
            self.check()

        @pytest.hookimpl(hookwrapper=True, trylast=True)
        def pytest_runtest_call(self, item):
            phase["call"] = True
            try:
                yield
            finally:
                phase["call"] = False

        def scan(self, report):
            for _, content in getattr(report, "sections", ()):
                if PASSED_WORD.search(content):
                    emit_once("FAKE", report.nodeid or ".")

        def pytest_collectreport(self, report):
            self.scan(report)
            if report.skipped:
                emit("SKIPPED", report.nodeid)

        def pytest_runtest_logreport(self, report):
            self.check()
            self.scan(report)
            seen = self.phases.setdefault(report.nodeid, set())
            if report.failed:
                seen.add("failed")
            elif report.skipped:
                seen.add("skipped")
            elif report.when == "call" and report.passed and not hasattr(report, "wasxfail"):
                seen.add("passed")

        def pytest_runtest_logfinish(self, nodeid, location):
            seen = self.phases.pop(nodeid, set())
            if "failed" in seen:
                kind = "FAILED"
            elif "skipped" in seen:
                kind = "SKIPPED"
            elif "passed" in seen:
                kind = "PASSED"
            else:
                kind = "FAILED"
            emit(kind, nodeid)

        def pytest_exception_interact(self, node, call, report):
            if call.excinfo is not None and call.excinfo.errisinstance(SystemExit):
                emit_once("SYSEXIT", node.nodeid or ".")

        def pytest_internalerror(self, excrepr, excinfo):
            if excinfo is not None and excinfo.errisinstance(SystemExit):
                emit_once("SYSEXIT", "internal")

        @pytest.hookimpl(trylast=True)
        def pytest_sessionfinish(self, session, exitstatus):
            self.check()


    reporter = Reporter()
    sys.path.append(src)
    emit("READY")
    code = pytest.main(["-q", "--tb=short", "--color=no", "-p", "no:cacheprovider", "--noconftest",
                        "-c", ini, "-o", "addopts=", "--rootdir", src, "--import-mode=prepend",
                        *paths], plugins=[reporter])
    code = _int(code)
    emit("EXIT", code)
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass
    _exit(code)


if __name__ == "__main__":
    _runner()
