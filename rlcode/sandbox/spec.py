"""Value types of the sandbox: resource limits of one execution and its result (docs/threat_model.md).

Kept free of any process machinery so that the pool, the fork-server worker and the one-shot
launcher share them, and so that importing them costs nothing.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

Status = Literal["ok", "error", "timeout", "memory", "output_limit", "infra"]
STATUSES: tuple[str, ...] = ("ok", "error", "timeout", "memory", "output_limit", "infra")

MiB = 2**20
GiB = 2**30


@dataclasses.dataclass(frozen=True)
class Limits:
    """Per-execution limits. All are hard: the program cannot raise them.

    cpu_seconds: RLIMIT_CPU of every process of the execution (soft = this, hard = this + 1 s; the
      kernel sends SIGXCPU at the soft and SIGKILL at the hard limit). Per process, so a program
      that forks is bounded in total by `processes * cpu_seconds` and, always, by the wall clock.
    wall_seconds: default wall-clock timeout of `run(..., timeout=None)`. On expiry the execution's
      PID namespace is killed (every process in it, however it detached itself).
    address_space_bytes: RLIMIT_AS of every process (allocation past it fails with ENOMEM;
      virtual size, so runtimes that reserve large address ranges need a larger value).
    memory_bytes: memory cgroup limit of the whole execution (all processes, tmpfs and page cache
      included; the OOM killer ends it, status "memory") where the machine lets the pool create a
      memory cgroup; None = address_space_bytes. Without one, an execution's memory is bounded
      only by processes * address_space_bytes: size those two accordingly.
    file_size_bytes: RLIMIT_FSIZE (largest file any process may write; SIGXFSZ past it).
    open_files: RLIMIT_NOFILE.
    processes: most processes (and threads) alive at once in the execution: RLIMIT_NPROC counted in
      the execution's own user namespace, and pids.max of its cgroup where one is available.
    output_bytes: cap of each of stdout and stderr as returned; past it the execution is killed
      and reported with status "output_limit" (the first `output_bytes` bytes are kept).
    tmp_bytes: size of the execution's private tmpfs (/tmp, which also holds the private working
      copy when `files` are given without a `workdir`) and of /dev/shm.
    workdir_bytes, workdir_inodes: size and entry count of the private working copy of a
      `workdir` (a tmpfs the host workdir is copied into and whose changes are brought back when
      the execution ends): writes past them fail with ENOSPC, and the result's `info` says which
      was reached. A workdir larger than either does not run (status "infra"). `workdir_inodes`
      also bounds the entries of /tmp and /dev/shm. Defaults: 256 MiB and 20000 entries, well
      above a repository's source and a test run's caches, far below what fills a disk.
    hidden_paths: host paths subtracted from what is visible (replaced by an empty read-only
      directory or an empty file where they lie inside a visible path), e.g. the held-out tests.
      /root, /home, the pool's repository checkout and this project's packages are always hidden.
    exposed_paths: host paths added, read-only, to what is visible (which is otherwise only the
      system's program and library directories, the Python installation the pool runs and a
      minimal /etc; see `isolation.py`); an exposed path deeper than a hidden one stays visible.
      Not "/".
    """

    cpu_seconds: float = 10.0
    wall_seconds: float = 30.0
    address_space_bytes: int = 4 * GiB
    memory_bytes: int | None = None
    file_size_bytes: int = 64 * MiB
    open_files: int = 256
    processes: int = 64
    output_bytes: int = 1 * MiB
    tmp_bytes: int = 256 * MiB
    workdir_bytes: int = 256 * MiB
    workdir_inodes: int = 20_000
    hidden_paths: tuple[str, ...] = ()
    exposed_paths: tuple[str, ...] = ()

    def __post_init__(self):
        for name in ("cpu_seconds", "wall_seconds", "address_space_bytes", "file_size_bytes",
                     "open_files", "processes", "output_bytes", "tmp_bytes", "workdir_bytes",
                     "workdir_inodes"):
            if getattr(self, name) <= 0:
                raise ValueError(f"Limits.{name} must be positive, got {getattr(self, name)!r}")
        for name in ("hidden_paths", "exposed_paths"):
            paths = tuple(getattr(self, name))
            if any(not p.startswith("/") for p in paths):
                raise ValueError(f"Limits.{name} must be absolute paths, got {paths!r}")
            object.__setattr__(self, name, paths)
        if any(p.rstrip("/") == "" for p in self.exposed_paths):
            raise ValueError("Limits.exposed_paths cannot expose the whole filesystem ('/')")

    @property
    def effective_memory_bytes(self) -> int:
        return self.address_space_bytes if self.memory_bytes is None else self.memory_bytes

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


@dataclasses.dataclass
class ExecResult:
    """Outcome of one execution.

    stdout, stderr: raw bytes as the program wrote them (decode with `stdout_text`), each cut at
      `Limits.output_bytes`; `stdout_truncated` / `stderr_truncated` say whether more was written.
    returncode: exit status like `subprocess`: >= 0 exit code, -N killed by signal N, None when the
      program never ran (status "infra").
    status:
      "ok"           returncode 0, within all limits.
      "error"        nonzero exit or killed by a signal of its own doing (incl. command not found,
                     returncode 127).
      "timeout"      wall-clock timeout (the sandbox killed it), or the CPU rlimit killed it.
      "memory"       the memory cgroup killed it, or it exited nonzero reporting an allocation
                     failure (MemoryError / bad_alloc / ENOMEM text on stderr) under RLIMIT_AS.
      "output_limit" stdout or stderr exceeded `output_bytes`; the sandbox killed it.
      "infra"        not the program's fault: the sandbox could not start, its worker died, or the
                     execution was cancelled (see `info`). Mask, do not score.
    wall_time: seconds from the start of the sandbox to the end of its last process.
    cpu_time: user + system CPU seconds of all processes of the execution (from the execution's
      cgroup where available, else from the rusage of reaped processes; None when unknown).
    info: short free-form note from the sandbox (why infra, which limit, ...); empty when ok unless
      the working copy reached `Limits.workdir_bytes` or `workdir_inodes` (said even then).
    """

    stdout: bytes = b""
    stderr: bytes = b""
    returncode: int | None = None
    status: str = "infra"
    wall_time: float = 0.0
    cpu_time: float | None = None
    stdout_truncated: bool = False
    stderr_truncated: bool = False
    info: str = ""

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    @property
    def stdout_text(self) -> str:
        return self.stdout.decode("utf-8", errors="replace")

    @property
    def stderr_text(self) -> str:
        return self.stderr.decode("utf-8", errors="replace")

    @classmethod
    def infra(cls, info: str, wall_time: float = 0.0) -> "ExecResult":
        return cls(status="infra", info=info, wall_time=wall_time)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)
