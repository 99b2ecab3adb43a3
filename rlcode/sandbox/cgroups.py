"""Optional cgroup layer of the sandbox: one leaf cgroup per worker slot, where the machine lets us.

Namespaces and rlimits are the sandbox's primary mechanisms; a cgroup adds what they cannot give:
a limit on the *total* memory of all processes of an execution, a pids limit independent of uids,
exact CPU accounting including processes killed before they were reaped, and a kill switch. We
only ever create children of the cgroups this process already belongs to (that is what being
delegated a subtree means) and remove them on close.

Both layouts are handled: cgroup v1 (one hierarchy per controller: pids, memory, cpuacct) and
cgroup v2 (the unified hierarchy, whose core files give `cgroup.kill` and `cpu.stat` even when no
controller is enabled for our subtree; `pids`/`memory` there only if enabled in our parent's
`cgroup.subtree_control`).
"""

from __future__ import annotations

import dataclasses
import errno
import os
import signal
import time


@dataclasses.dataclass(frozen=True)
class Hierarchy:
    version: int  # 1 or 2
    controllers: frozenset[str]  # v1: the mount's controllers; v2: controllers enabled for children
    base: str  # directory of our own cgroup in this hierarchy


def _own_cgroups() -> dict[str, str]:
    """hierarchy key ('v2' or the comma-joined v1 controller list) -> our path in it."""
    out = {}
    with open("/proc/self/cgroup") as f:
        for line in f:
            hid, ctrls, path = line.rstrip("\n").split(":", 2)
            out["v2" if hid == "0" else ctrls] = path
    return out


def discover() -> list[Hierarchy]:
    """Hierarchies in which we may create children of our own cgroup (writable, mkdir works)."""
    try:
        own = _own_cgroups()
        with open("/proc/self/mountinfo") as f:
            mounts = f.read().splitlines()
    except OSError:
        return []
    found, seen = [], set()
    for line in mounts:
        left, _, right = line.partition(" - ")
        fields, rfields = left.split(), right.split()
        if len(fields) < 5 or len(rfields) < 3:
            continue
        root, mountpoint, fstype = fields[3], fields[4], rfields[0]
        if fstype == "cgroup2":
            key = "v2"
            ctrls: set[str] = set()
        elif fstype == "cgroup":
            opts = set(rfields[2].split(","))
            ctrls = opts & {"pids", "memory", "cpuacct"}
            key = next((k for k in own if k != "v2" and set(k.split(",")) <= opts), None)
            if not ctrls or key is None:
                continue
        else:
            continue
        if key in seen or key not in own:
            continue
        path = own[key]
        if not (path == root or path.startswith(root.rstrip("/") + "/")):
            continue
        base = os.path.join(mountpoint, path[len(root):].lstrip("/"))
        if key == "v2":
            try:
                with open(os.path.join(base, "cgroup.subtree_control")) as f:
                    ctrls = set(f.read().split())
            except OSError:
                ctrls = set()
        if not os.access(base, os.W_OK):
            continue
        seen.add(key)
        found.append(Hierarchy(2 if key == "v2" else 1, frozenset(ctrls), base))
    return found


def remove_stale(hierarchies: list[Hierarchy], prefix: str) -> None:
    """rmdir leaf cgroups `<prefix><pid>-...` left by a pool whose process no longer exists (a
    crash skips close()). Only empty ones go: rmdir refuses a cgroup with processes."""
    for h in hierarchies:
        try:
            names = os.listdir(h.base)
        except OSError:
            continue
        for name in names:
            pid = name[len(prefix):].split("-", 1)[0]
            if name.startswith(prefix) and pid.isdigit() and not os.path.exists(f"/proc/{pid}"):
                try:
                    os.rmdir(os.path.join(h.base, name))
                except OSError:
                    pass


def _write(path: str, value: str) -> None:
    with open(path, "w") as f:
        f.write(value)


def _read_kv(path: str) -> dict[str, int]:
    out = {}
    try:
        with open(path) as f:
            for line in f:
                parts = line.split()
                if len(parts) == 2 and parts[1].lstrip("-").isdigit():
                    out[parts[0]] = int(parts[1])
    except OSError:
        pass
    return out


@dataclasses.dataclass
class SlotCgroup:
    """The leaf cgroups (one per usable hierarchy) of one worker slot."""

    dirs: list[tuple[Hierarchy, str]]

    @classmethod
    def create(cls, name: str, hierarchies: list[Hierarchy]) -> "SlotCgroup":
        dirs = []
        for h in hierarchies:
            d = os.path.join(h.base, name)
            try:
                os.mkdir(d)
            except FileExistsError:
                pass
            except OSError:
                continue
            dirs.append((h, d))
        return cls(dirs)

    def _has(self, controller: str) -> list[tuple[Hierarchy, str]]:
        return [(h, d) for h, d in self.dirs if controller in h.controllers]

    @property
    def capabilities(self) -> dict[str, bool]:
        return {
            "pids": bool(self._has("pids")) and any(os.path.exists(os.path.join(d, "pids.max"))
                                                    for _, d in self._has("pids")),
            "memory": bool(self._has("memory")),
            "cpu": bool(self._has("cpuacct")) or any(h.version == 2 for h, _ in self.dirs),
            "kill": any(h.version == 2 and os.path.exists(os.path.join(d, "cgroup.kill"))
                        for h, d in self.dirs),
            "any": bool(self.dirs),
        }

    def join(self) -> None:
        """Move the calling process into the slot's cgroups."""
        for _, d in self.dirs:
            _write(os.path.join(d, "cgroup.procs"), "0")

    def set_limits(self, pids: int | None, memory_bytes: int | None) -> None:
        for h, d in self._has("pids"):
            _write(os.path.join(d, "pids.max"), "max" if pids is None else str(pids))
        for h, d in self._has("memory"):
            value = "max" if memory_bytes is None else str(memory_bytes)
            if h.version == 2:
                _write(os.path.join(d, "memory.max"), value)
                if os.path.exists(os.path.join(d, "memory.swap.max")):
                    _write(os.path.join(d, "memory.swap.max"), "0")
                _write(os.path.join(d, "memory.oom.group"), "1")
            else:
                v1 = "-1" if memory_bytes is None else value
                sw = os.path.join(d, "memory.memsw.limit_in_bytes")
                # memsw must stay >= limit: order the writes so that each one is valid.
                try:
                    _write(os.path.join(d, "memory.limit_in_bytes"), v1)
                    if os.path.exists(sw):
                        _write(sw, v1)
                except OSError:
                    if os.path.exists(sw):
                        _write(sw, v1)
                    _write(os.path.join(d, "memory.limit_in_bytes"), v1)

    def oom_kills(self) -> int:
        total = 0
        for h, d in self._has("memory"):
            name = "memory.events" if h.version == 2 else "memory.oom_control"
            total += _read_kv(os.path.join(d, name)).get("oom_kill", 0)
        return total

    def cpu_seconds(self) -> float | None:
        for h, d in self.dirs:
            if h.version == 1 and "cpuacct" in h.controllers:
                try:
                    with open(os.path.join(d, "cpuacct.usage")) as f:
                        return int(f.read()) / 1e9
                except (OSError, ValueError):
                    continue
        for h, d in self.dirs:
            if h.version == 2:
                usec = _read_kv(os.path.join(d, "cpu.stat")).get("usage_usec")
                if usec is not None:
                    return usec / 1e6
        return None

    def pids(self) -> set[int]:
        out: set[int] = set()
        for _, d in self.dirs:
            try:
                with open(os.path.join(d, "cgroup.procs")) as f:
                    out.update(int(x) for x in f.read().split())
            except (OSError, ValueError):
                pass
        return out

    def kill_all(self, timeout: float = 5.0, exclude: frozenset[int] = frozenset()) -> bool:
        """SIGKILL every process in the slot's cgroups but `exclude`; True when none is left.

        Without exclusions, cgroup v2's `cgroup.kill` does it atomically (forks in flight
        included); otherwise processes are killed one by one until none remains."""
        if not exclude:
            for h, d in self.dirs:
                if h.version == 2:
                    try:
                        _write(os.path.join(d, "cgroup.kill"), "1")
                    except OSError:
                        pass
        end = time.monotonic() + timeout
        while True:
            left = self.pids() - exclude
            if not left:
                return True
            if time.monotonic() > end:
                return False
            for pid in left:
                try:
                    os.kill(pid, signal.SIGKILL)
                except OSError:
                    pass
            time.sleep(0.01)

    def remove(self) -> None:
        self.kill_all()
        for _, d in self.dirs:
            for _ in range(50):
                try:
                    os.rmdir(d)
                    break
                except FileNotFoundError:
                    break
                except OSError as e:
                    if e.errno != errno.EBUSY:
                        break
                    time.sleep(0.02)
        self.dirs = []
