"""Test double of the sandbox pool for the environment tests: a plain subprocess in `workdir`.

The sandbox's isolation is tested in tests/rlcode/sandbox; these tests exercise the code that
drives an executor (`rlcode.envs.tools.Executor`). Output is bytes, as the real pool returns it.
"""

import dataclasses
import subprocess
import time


@dataclasses.dataclass
class Result:
    stdout: bytes | str
    stderr: bytes | str
    returncode: int | None
    status: str
    stdout_truncated: bool = False
    stderr_truncated: bool = False
    wall_time: float = 0.0
    info: str = ""


class LocalExecutor:
    """Runs argv with a timeout; records (argv, stdin, timeout, workdir) of every call."""

    def __init__(self):
        self.calls = []

    def run(self, argv, *, files=None, stdin=None, timeout, workdir=None):
        self.calls.append((list(argv), stdin, timeout, workdir))
        data = stdin.encode() if isinstance(stdin, str) else stdin
        start = time.monotonic()
        try:
            proc = subprocess.run(argv, cwd=workdir, input=data, capture_output=True, timeout=timeout)
        except subprocess.TimeoutExpired as e:
            return Result(e.stdout or b"", e.stderr or b"", None, "timeout", wall_time=time.monotonic() - start)
        return Result(proc.stdout, proc.stderr, proc.returncode, "ok" if proc.returncode == 0 else "error",
                      wall_time=time.monotonic() - start)
