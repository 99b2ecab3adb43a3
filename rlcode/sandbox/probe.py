"""The start-up probe: what `SandboxPool.guarantees()` claims, measured from inside executions.

A pool runs the probe once, on its first worker, before it accepts work: executions with the
pool's own plan, limits and hidden paths, each a small Python program (`PROBE_SOURCE`,
`SCAN_SOURCE`; standard library only) that tries what the sandbox forbids and reports what
happened as one JSON line. Before them the worker makes, on the host, a small workdir (below
its temporary directory) and a canary directory outside the filesystem view (in /var/tmp, or
next to the repository checkout); it removes both afterwards.

  1. in place (the program runs in the fork of the warm worker interpreter), on a private copy
     of the workdir with small limits (`PROBE_WORKDIR_BYTES`, `PROBE_WORKDIR_ENTRIES`): measures,
     holds a random marker in its code (a comment) and one in its heap (made at run time, and
     printed), then plants what must not outlive it: an abstract unix socket holding its own
     descriptor and a TCP listener in flight (SCM_RIGHTS), SysV shared memory, semaphore and
     message queue, files in /tmp and /dev/shm, a setsid'd daemon whose command name is a fresh
     token;
  2. the worker looks for the daemon's token in /proc (the whole process tree must be gone), and
     for the file the execution wrote in its working copy in the host workdir;
  3. exec'd (a fresh `python -c`), on the same workdir: measures again, and looks for everything
     planted in 1; the worker again looks for its file in the host workdir;
  4. in place: scans its own memory (/proc/self/maps, /proc/self/mem) for the markers of 1, and
     for a code and a heap marker of its own as the control that the scan finds what is there.
     Markers are passed to it cut in two, so that a whole one is in its memory only if carried
     over (an exec'd program starts from a fresh image: this one applies in place only).

What each execution of 1 and 3 measures (`measure()` in the source): /proc/self/status (CapInh,
CapPrm, CapEff, CapBnd, CapAmb must be 0, NoNewPrivs 1, Seccomp 2); its namespaces against the
worker's (inode of /proc/self/ns/*); its uid and uid map; its environment's keys; its rlimits;
the pids in /proc; the network interfaces and non-blocking connects to 127.0.0.1 and a public
address; the read-only flag of /, /usr and the Python prefix and a write into /; /tmp, /dev and
/dev/shm in its mount table and the device nodes in /dev; what /root and /home show beyond the
paths exposed on purpose (the Python installation may live there); the filesystem view: what /,
/etc, the system directories and every hidden directory (the repository checkout, this project's
packages, `Limits.hidden_paths`) list, whether the exposed paths and the canary are there, and
whether the import system finds this project's packages with readable source (`derive` compares
this with `_expected_view`, worked out from the host and the rules' inputs); the working copy:
a file written within its limits, then bytes and then entries written past them until the first
error (ENOSPC expected); and system calls, each with arguments under which the kernel alone
would let it succeed here or fail otherwise than the filter does (unshare, clone and clone3 of
a user namespace, raising max_user_namespaces, a nested mount namespace and a tmpfs mount,
chroot, open_tree, fsopen, keyctl, add_key, request_key, ptrace(TRACEME), process_vm_readv,
kcmp, pidfd_getfd, bpf, perf_event_open on its own task, io_uring_setup, userfaultfd,
name_to_handle_at, fanotify_init, an AF_ALG socket, an x32 system call). Calls that would change
the probe itself if they succeeded run in a forked child.

`derive()` turns the measurements into one (holds, evidence) pair per claim; the pool ANDs each
with what the worker's plan promises, so that a claim holds only where the plan makes it and the
probe confirms it. The probe costs about 0.12 s of the first worker's start-up (`seconds`;
stage 4, the memory scan, about 0.03 s of it: its cost grows with the worker's heap).
"""

from __future__ import annotations

import json
import os
import platform
import tempfile
import time
import uuid

import rlcode
from rlcode.sandbox import fstree
from rlcode.sandbox import isolation
from rlcode.sandbox import seccomp

NAMESPACES = ("user", "pid", "mnt", "net", "ipc", "uts", "cgroup")
CAP_SETS = ("CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb")
ALLOWED_ENV = {"PATH", "HOME", "LANG", "TMPDIR"}
HARMLESS_DEVICES = {"null", "zero", "full", "random", "urandom", "tty", "ptmx"}
# Refused by the seccomp filter, and allowed by the kernel alone under the probe's arguments (or
# refused with another errno): an EPERM for each shows that the filter is in force.
FILTER_EPERM = ("unshare_user", "clone_newuser", "open_tree", "keyctl", "add_key", "request_key",
                "ptrace", "process_vm_readv", "kcmp", "pidfd_getfd", "perf_event_open",
                "io_uring_setup", "userfaultfd", "name_to_handle_at", "fanotify_init")
NESTED_USERNS = ("unshare_user", "clone_newuser", "clone3_newuser", "raise_userns_limit")
MOUNTS = ("unshare_mount", "mount_tmpfs", "fsopen", "chroot")
KEYRING = ("keyctl", "add_key", "request_key")
UNREACHABLE = ("ENETUNREACH", "EADDRNOTAVAIL", "EAFNOSUPPORT")  # connect answers without a route
KERNEL_SURFACE = ("bpf", "ptrace", "perf_event_open", "io_uring_setup", "userfaultfd",
                  "process_vm_readv", "kcmp", "pidfd_getfd", "fanotify_init", "name_to_handle_at")

PROBE_SOURCE = r'''
import ctypes, errno, json, os, resource, socket, struct, sys, time

A = json.loads(sys.argv[1])
NR = A["nr"]
HELD = A.get("held", "")[::-1]  # made at run time: this execution's heap marker
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long


def call(name, *args, fd=False):
    nr = NR.get(name) if isinstance(name, str) else name
    if nr is None:
        return "absent"
    ret = libc.syscall(ctypes.c_long(nr), *args)
    if ret == -1:
        return errno.errorcode.get(ctypes.get_errno(), "E?")
    if fd and ret >= 0:
        os.close(ret)
    return "ok"


def err(fn):
    try:
        fn()
        return "ok"
    except OSError as e:
        return errno.errorcode.get(e.errno, "E?")


def in_child(fn):
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.close(r)
            os.write(w, json.dumps(fn()).encode())
        finally:
            os._exit(0)
    os.close(w)
    data = b""
    while True:
        chunk = os.read(r, 65536)
        if not chunk:
            break
        data += chunk
    os.close(r)
    os.waitpid(pid, 0)
    return json.loads(data) if data else {"child": "no answer"}


def risky():
    """Calls that would change the calling process if they succeeded (ptrace last: it makes
    the parent a tracer of this child)."""
    out = {}

    def write_limit():
        with open("/proc/sys/user/max_user_namespaces", "w") as f:
            f.write("100")

    def cloned(ret):
        """The outcome of a raw clone: the child exits at once, the parent reaps it."""
        if ret == 0:
            os._exit(0)
        if ret < 0:
            return errno.errorcode.get(ctypes.get_errno(), "E?")
        os.waitpid(ret, 0)
        return "ok"

    def raw_clone(flags):
        return cloned(libc.syscall(ctypes.c_long(NR["clone"]), ctypes.c_ulong(flags | 17), 0, 0, 0, 0))

    def clone3(flags):
        args = ctypes.create_string_buffer(struct.pack("QQQQQQQQ", flags, 0, 0, 0, 17, 0, 0, 0))
        return cloned(libc.syscall(ctypes.c_long(NR["clone3"]), args, ctypes.c_size_t(64)))

    out["raise_userns_limit"] = err(write_limit)
    out["clone_newuser"] = raw_clone(0x10000000)
    out["clone3_newuser"] = clone3(0x10000000)
    out["unshare_mount"] = call("unshare", 0x00020000)
    out["unshare_user"] = call("unshare", 0x10000000)
    out["unshare_net"] = call("unshare", 0x40000000)
    try:
        os.mkdir("/tmp/.rlcode-probe-mnt")
    except OSError:
        pass
    out["mount_tmpfs"] = call("mount", b"none", b"/tmp/.rlcode-probe-mnt", b"tmpfs", 0, None)
    out["chroot"] = call("chroot", b"/")
    out["ptrace"] = call("ptrace", 0, 0, 0, 0)
    return out


def status():
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb"):
                out[key] = int(value, 16)
            elif key in ("NoNewPrivs", "Seccomp"):
                out[key] = int(value)
    return out


def mounts():
    out = {}
    with open("/proc/self/mountinfo") as f:
        for line in f:
            fields = line.split()
            sep = fields.index("-")
            out[fields[4]] = fields[sep + 1]
    return out


def connect(addr):
    def attempt():
        with socket.socket(socket.AF_INET6 if ":" in addr[0] else socket.AF_INET) as s:
            s.setblocking(False)
            s.connect(addr)
    return err(attempt)


def writable(path):
    def touch():
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        os.close(fd)
        os.unlink(path)
    return err(touch)


def listing(path):
    """The names in a directory, "-> target" for a symlink, or why there is nothing to list."""
    try:
        if os.path.islink(path):
            return "-> " + os.readlink(path)
        return sorted(os.listdir(path))
    except FileNotFoundError:
        return "absent"
    except NotADirectoryError:
        return "a file"
    except OSError:
        return "unreadable"


def project_source(name, home=None):
    """Whether the import system finds package `name` and its source can be read. `home` is
    where this project's package of that name lives on the host: a package of the same name
    found anywhere else is someone else's ("elsewhere"; a third-party distribution may ship a
    top-level package called `kernels`), not this project's code. Without `home` every find counts."""
    import importlib.util
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return "absent"
    if spec is None:
        return "absent"
    places = list(spec.submodule_search_locations or ())
    if spec.has_location and spec.origin:
        places.append(os.path.dirname(spec.origin))
    if home is not None and places and not any(_within(p, home) for p in places):
        return "elsewhere"
    if not spec.has_location:
        return "readable" if any(listing(p) not in ("absent", "unreadable", []) for p in places) else "empty"
    try:
        with open(spec.origin, "rb") as f:
            f.read(1)
        return "readable"
    except OSError as e:
        return errno.errorcode.get(e.errno, "E?")


def _within(path, home):
    path, home = os.path.realpath(path), os.path.realpath(home)
    return path == home or path.startswith(home.rstrip("/") + "/")


def fill_workdir(w):
    """In the working copy (the cwd): a file within the limits, then bytes and then entries past
    them until the first error; the fillers are removed again (so little is brought back)."""
    import signal
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # past RLIMIT_FSIZE: EFBIG, then the next file
    with open(w["keep"], "w") as f:
        f.write(A["token"])
    out = {}
    block, written, files, stop = bytes(4096), 0, [], None
    while stop is None and written <= 2 * w["bytes"]:
        files.append(f"fill{len(files)}")
        try:
            fd = os.open(files[-1], os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except OSError as e:
            stop = errno.errorcode.get(e.errno, "E?")
            files.pop()
            break
        try:
            while written <= 2 * w["bytes"]:
                written += os.write(fd, block)
        except OSError as e:
            if e.errno != errno.EFBIG:
                stop = errno.errorcode.get(e.errno, "E?")
        finally:
            os.close(fd)
    out["bytes"], out["bytes_stop"] = written, stop or "none"
    for name in files:
        os.unlink(name)
    made, stop = 0, None
    while made <= 2 * w["entries"]:
        try:
            os.close(os.open(f"entry{made}", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
        except OSError as e:
            stop = errno.errorcode.get(e.errno, "E?")
            break
        made += 1
    out["entries"], out["entries_stop"] = made, stop or "none"
    for i in range(made):
        os.unlink(f"entry{i}")
    return out


def measure():
    m = {"status": status(), "pid": os.getpid(), "uid": os.getuid(),
         "procs": sorted(int(p) for p in os.listdir("/proc") if p.isdigit())}
    m["ns"] = {n: os.stat(f"/proc/self/ns/{n}").st_ino for n in A["namespaces"]
               if os.path.exists(f"/proc/self/ns/{n}")}
    with open("/proc/self/uid_map") as f:
        m["uid_map"] = [[int(x) for x in line.split()] for line in f if line.strip()]
    m["env"] = sorted(os.environ)
    m["rlimits"] = {name: list(resource.getrlimit(getattr(resource, "RLIMIT_" + name)))
                    for name in ("CPU", "AS", "FSIZE", "NOFILE", "NPROC", "CORE")}
    with open("/proc/net/dev") as f:
        m["interfaces"] = sorted(line.split(":")[0].strip() for line in f.read().splitlines()[2:])
    m["connect"] = {"127.0.0.1": connect(("127.0.0.1", 9)), "::1": connect(("::1", 9)),
                    "1.1.1.1": connect(("1.1.1.1", 53))}
    m["readonly"] = {p: bool(os.statvfs(p).f_flag & os.ST_RDONLY) for p in ("/", "/usr", sys.prefix)
                     if os.path.isdir(p)}
    m["write_root"] = writable("/.rlcode-probe")
    mt = mounts()
    m["mounts"] = {p: mt.get(p) for p in ("/tmp", "/dev", "/dev/shm")}
    m["devices"] = sorted(n for n in os.listdir("/dev") if not os.path.islink("/dev/" + n)
                          and not os.path.isdir("/dev/" + n))
    exposed = [e.rstrip("/") + "/" for e in A["exposed"]]
    m["hidden"] = {}
    for p in ("/root", "/home"):
        try:
            m["hidden"][p] = sorted(n for n in os.listdir(p)
                                    if not any(e.startswith(f"{p}/{n}/") for e in exposed))
        except FileNotFoundError:
            m["hidden"][p] = "absent"
        except OSError:  # not a directory, or one the program may not list
            m["hidden"][p] = "unreadable" if os.path.isdir(p) else "a file"
    m["view"] = {"listed": {p: listing(p) for p in A["view"]["list"]},
                 "exposed_missing": [p for p in A["view"]["exposed"] if not os.path.exists(p)],
                 "canary": os.path.lexists(A["view"]["canary"]) if A["view"]["canary"] else None,
                 "project_code": {name: project_source(name, home) for name, home in A["view"]["packages"].items()}}
    if A.get("workdir"):
        m["workdir"] = fill_workdir(A["workdir"])
    if A.get("held"):
        m["held"] = HELD
    risky_calls = in_child(risky)
    buf = ctypes.create_string_buffer(64)
    iov = ctypes.create_string_buffer(struct.pack("PL", ctypes.addressof(buf), 8))
    perf_attr = ctypes.create_string_buffer(struct.pack("IIQQQQ", 1, 128, 1, 0, 0, 0x60) + bytes(80))
    handle = ctypes.create_string_buffer(struct.pack("Ii", 128, 0) + bytes(128))
    mount_id = ctypes.c_int()
    pidfd = os.pidfd_open(os.getpid())
    calls = dict(risky_calls)
    calls.update({
        "open_tree": call("open_tree", -100, b"/", 0, fd=True),
        "fsopen": call("fsopen", b"tmpfs", 0, fd=True),
        "keyctl": call("keyctl", 0, -3, 0),
        "add_key": call("add_key", b"user", b"rlcode-probe", b"x", 1, -2),
        "request_key": call("request_key", b"user", b"rlcode-probe-absent", None, 0),
        "process_vm_readv": call("process_vm_readv", os.getpid(), iov, 1, iov, 1, 0),
        "kcmp": call("kcmp", os.getpid(), os.getpid(), 0, 0, 0),
        "pidfd_getfd": call("pidfd_getfd", pidfd, 0, 0, fd=True),
        "bpf": call("bpf", 0, bytes(72), 72, fd=True),
        "perf_event_open": call("perf_event_open", perf_attr, 0, -1, -1, 0, fd=True),
        "io_uring_setup": call("io_uring_setup", 1, ctypes.create_string_buffer(120), fd=True),
        "userfaultfd": call("userfaultfd", 0o2000000 | 1, fd=True),
        "name_to_handle_at": call("name_to_handle_at", -100, b"/", handle, ctypes.byref(mount_id), 0),
        "fanotify_init": call("fanotify_init", 0x200, 0, fd=True),
        "clone3": call("clone3", None, 0),
    })
    os.close(pidfd)
    try:
        socket.socket(38, socket.SOCK_SEQPACKET).close()  # AF_ALG
        calls["af_alg"] = "ok"
    except OSError as e:
        calls["af_alg"] = errno.errorcode.get(e.errno, "E?")
    if A["x86_64"]:
        calls["x32"] = call(0x40000000 | 39)
    m["calls"] = calls
    return m


def plant(token, port):
    import array
    name = ("\0rlcode-probe-" + token).encode()
    u = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    u.bind(name)
    t = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    t.bind(("0.0.0.0", port))
    t.listen()
    fds = array.array("i", [u.fileno(), t.fileno()])
    u.sendmsg([b"x"], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, fds)], 0, name)  # in flight, on itself
    key = int(token[:7], 16)
    libc.shmget(key, 4096, 0o1600)
    libc.semget(key, 1, 0o1600)
    libc.msgget(key, 0o1600)
    for path in ("/tmp/rlcode-probe-" + token, "/dev/shm/rlcode-probe-" + token):
        with open(path, "w") as f:
            f.write(token)
    if os.fork() == 0:
        os.setsid()
        if os.fork() == 0:
            libc.prctl(15, A["comm"].encode(), 0, 0, 0)  # PR_SET_NAME
            os.closerange(0, 1 << 16)
            time.sleep(60)
        os._exit(0)
    os.wait()
    sys.stdout.flush()


def look(token, port):
    out = {}
    with open("/proc/net/unix") as f:
        out["unix_name"] = token in f.read()
    u = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    try:
        u.sendto(b"y", ("\0rlcode-probe-" + token).encode())
        out["unix_reach"] = "ok"
    except OSError as e:
        out["unix_reach"] = errno.errorcode.get(e.errno, "E?")
    u.close()
    t = socket.socket()
    out["tcp_port"] = err(lambda: t.bind(("0.0.0.0", port)))
    t.close()
    key = int(token[:7], 16)
    found = {"shm": libc.shmget(key, 0, 0), "sem": libc.semget(key, 0, 0), "msg": libc.msgget(key, 0)}
    out["sysv"] = [k for k, ipc_id in found.items() if ipc_id >= 0]
    paths = ("/tmp/rlcode-probe-" + token, "/dev/shm/rlcode-probe-" + token)
    out["files"] = [p for p in paths if os.path.exists(p)]
    return out


result = {"measured": measure()}
if A.get("look"):
    result["carried"] = look(A["token"], A["port"])
print(json.dumps(result), flush=True)
if A.get("plant"):
    plant(A["token"], A["port"])
'''

# Stage 4 (see above). Read-only file mappings hold no run-time data and are skipped, and so is
# the scan's own buffer, which holds only copies (read while it is being overwritten, it could
# join two pieces that are not adjacent in memory). Every marker starts with the probe's
# `prefix`: one pass over memory finds them all.
SCAN_SOURCE = r'''
import ctypes, json, os, sys

A = json.loads(sys.argv[1])
held = A["held"][::-1]
seek = {name: (head.encode(), tail.encode()) for name, (head, tail) in A["seek"].items()}
cut = len(A["prefix"]) + 8
seek["own_code"] = (A["own"][:cut].encode(), A["own"][cut:].encode())
seek["own_heap"] = (held[:cut].encode(), held[cut:].encode())
prefix = A["prefix"].encode()
span = max(len(h) + len(t) for h, t in seek.values())
chunk = 1 << 20
buf = bytearray(chunk + span)
view = memoryview(buf)
b0 = ctypes.addressof(ctypes.c_char.from_buffer(buf))
b1 = b0 + len(buf)
found = set()


def scan(fd, lo, hi):
    at = lo
    while at < hi:
        start = max(lo, at - span)  # the chunks overlap by a marker's length
        try:
            n = os.preadv(fd, [view[:min(hi, at + chunk) - start]], start)
        except OSError:
            return
        i = buf.find(prefix, 0, n)
        while i >= 0:
            for name, (head, tail) in seek.items():
                if buf.startswith(head, i, n) and buf.startswith(tail, i + len(head), n):
                    found.add(name)
            i = buf.find(prefix, i + 1, n)
        at += chunk


with open("/proc/self/maps") as f:
    regions = [line.split() for line in f]
fd = os.open("/proc/self/mem", os.O_RDONLY)
for fields in regions:
    perms, path = fields[1], fields[5] if len(fields) > 5 else ""
    if perms[0] != "r" or ("w" not in perms and path.startswith("/")) or path.startswith("[vvar"):
        continue
    lo, hi = (int(x, 16) for x in fields[0].split("-"))
    for a, b in ((lo, min(hi, b0)), (max(lo, b1), hi)):
        if a < b:
            scan(fd, a, b)
os.close(fd)
print(json.dumps({"found": sorted(found)}))
'''
PROBE_WORKDIR_BYTES = 64 * 1024  # the working copy's limits in the probe (cheap to fill)
PROBE_WORKDIR_ENTRIES = 64


def run(worker, python: str) -> dict:
    """Run the probe through `worker` (a `worker.Worker` whose plan is decided) and return its
    report: {"modes": {"inprocess": ..., "exec": ...}, "carried": ..., "tree_killed": bool,
    "heap": {"found": [...]}, "view": what the view may show, "workdir": the host workdir and
    the working copy's limits in the probe, "worker": ..., "seconds": float, "errors": [...], and "skipped":
    {"exec": why} where the pool's Python cannot be exec'd in the sandbox}."""
    t0 = time.monotonic()
    token = uuid.uuid4().hex
    comm = "rlprobe" + token[:8]
    worker_ns = {}
    for n in NAMESPACES:
        try:
            worker_ns[n] = os.stat(f"/proc/self/ns/{n}").st_ino
        except OSError:
            pass
    with open("/proc/self/uid_map") as f:
        worker_map = [[int(x) for x in line.split()] for line in f if line.strip()]
    limits = worker.cfg["limits"]
    exposed = [*worker.expose, *limits["exposed_paths"]]
    hidden = [*limits["hidden_paths"], *worker.cfg.get("hide", ()), *worker.hide]
    idx = 1 if platform.machine() in ("aarch64", "arm64") else 0
    args = {"nr": {k: v[idx] for k, v in seccomp.SYSCALLS.items() if v[idx] is not None},
            "namespaces": NAMESPACES, "x86_64": platform.machine() == "x86_64", "token": token,
            "port": 20000 + int(token[:4], 16) % 40000, "comm": comm,
            "exposed": [os.path.realpath(p) for p in exposed]}
    report = {"modes": {}, "carried": None, "tree_killed": None, "heap": None, "errors": [],
              "worker": {"ns": worker_ns, "uid_map": worker_map},
              "workdir": {"bytes": PROBE_WORKDIR_BYTES, "entries": PROBE_WORKDIR_ENTRIES}}
    workdir = canary = None
    try:
        workdir = report["workdir"]["path"] = tempfile.mkdtemp(prefix="rlcode-probe-", dir=worker.tmp_root)
        canary = _make_canary(exposed, hidden)
        report["view"] = args["view"] = _expected_view(exposed, hidden, canary, workdir)
        _run_modes(worker, python, args, comm, report, workdir)
    except Exception as e:  # noqa: BLE001 - a probe that breaks proves nothing: every claim fails
        report["errors"].append(f"the probe crashed: {type(e).__name__}: {e}")
    finally:
        if workdir is not None:
            fstree.remove(workdir)
        if canary is not None:
            fstree.remove(canary)
        for planted in (f"/tmp/rlcode-probe-{token}", f"/dev/shm/rlcode-probe-{token}"):
            fstree.remove(planted)  # found on the host only where /tmp or /dev/shm is not private
    report["seconds"] = time.monotonic() - t0
    return report


def _shown(path: str, exposed: list[str], hidden: list[str]) -> bool:
    """Whether the view's rules show `path`: the nearest rule at or above it is a visible one."""
    system = [os.path.realpath(p) for p in isolation.SYSTEM_PATHS if os.path.lexists(p)]
    rules = isolation.view_rules([*system, *exposed], [*isolation.ALWAYS_HIDDEN, *hidden])
    nearest = [(len(p), vis) for p, vis in rules if isolation.under(path, p)]
    return bool(nearest) and max(nearest)[1]


def _make_canary(exposed: list[str], hidden: list[str]) -> str | None:
    """A directory made on the host for the probe outside what the view shows (not in /tmp,
    which executions see privately): in /var/tmp, or else next to the repository checkout or
    the project's packages. None where no such place can be written."""
    places = ["/var/tmp", *(os.path.dirname(os.path.realpath(h)) for h in hidden)]
    for place in places:
        if (not os.path.isdir(place) or any(isolation.under(place, d) for d in ("/tmp", "/dev", "/proc"))
                or _shown(os.path.join(place, "x"), exposed, hidden)):
            continue
        try:
            return tempfile.mkdtemp(prefix="rlcode-probe-canary-", dir=place)
        except OSError:
            continue
    return None


def _expected_view(exposed: list[str], hidden: list[str], canary: str | None, workdir: str) -> dict:
    """What the allow-list view may show, worked out from the rules' inputs (the host, the
    system directories, the exposed and hidden paths), not from the code that builds it:
    "within": directories whose names must be among those given ("/": the system directories,
    the first component of every exposed path, /etc, /dev, /proc, /tmp; "/etc": the minimal set,
    unless /etc itself is exposed; each hidden directory: only the way to an exposed path inside
    it); "same": the system directories and symlinks, each as on the host; "exposed": exposed
    paths that must be there; "canary": a directory made outside the view; "packages": this
    project's packages, whose source must not be readable."""
    shown = sorted({os.path.realpath(p) for p in exposed if os.path.exists(p)})
    covered = {os.path.realpath(p) for p in hidden if os.path.lexists(p)}

    def names_below(d: str, paths) -> set[str]:
        return {p[len(d):].lstrip("/").split("/")[0] for p in paths if p != d and isolation.under(p, d)}

    top = {"dev", "proc", "tmp", "etc"} | names_below("/", [*shown, *(p for p in isolation.SYSTEM_PATHS
                                                                    if os.path.lexists(p))])
    if not isolation.under(workdir, "/tmp"):
        top |= names_below("/", [workdir])
    within = {"/": sorted(top)}
    if "/etc" not in shown:
        minimal = {*isolation.ETC_FROM_HOST, *isolation._etc_files(isolation.INNER_UID, isolation.INNER_UID)}
        within["/etc"] = sorted(minimal | names_below("/etc", shown))
    private = ("/tmp", "/dev", "/proc")
    for h in sorted(covered):
        if os.path.isdir(h) and not os.path.islink(h) and not any(isolation.under(h, d) for d in private):
            within[h] = sorted(names_below(h, shown))
    same = {}
    for p in isolation.SYSTEM_PATHS:
        if any(isolation.under(p, h) for h in covered):
            continue
        if os.path.islink(p):
            same[p] = "-> " + os.readlink(p)
        elif os.path.isdir(p):
            same[p] = sorted(os.listdir(p))
    present = [p for p in shown if p not in covered and not any(isolation.under(p, d) for d in private[1:])]
    return {"within": within, "same": same, "exposed": present, "canary": canary,
            "packages": {name: _package_home(name) for name in isolation.PROJECT_PACKAGES},
            "list": sorted({*within, *same})}


def _package_home(name: str) -> str | None:
    """The host directory of this project's package `name`: beside `rlcode` (where the project
    is installed or checked out), None where there is none."""
    home = os.path.join(os.path.dirname(os.path.dirname(os.path.realpath(rlcode.__file__))), name)
    return home if os.path.isdir(home) else None


def _run_modes(worker, python: str, args: dict, comm: str, report: dict, workdir: str) -> None:
    """Stages 1 to 4 of the module's docstring: 1 in place and 3 exec'd, both on a small working
    copy of `workdir`, 4 in place. Where the pool's Python cannot be exec'd in the sandbox at all
    (a plan note says so, and exec'd Python fails anyway), 3 runs in place too and the exec mode
    is reported as skipped rather than failed."""
    prefix = "rlprobe-" + uuid.uuid4().hex[:8]
    markers = {k: prefix + uuid.uuid4().hex for k in ("code", "heap", "own_code", "own_heap")}
    cut = len(prefix) + 8
    scan = {"prefix": prefix, "own": markers["own_code"], "held": markers["own_heap"][::-1],
            "seek": {k: [markers[k][:cut], markers[k][cut:]] for k in ("code", "heap")}}
    limits = worker.cfg["limits"]
    small = dict(limits, workdir_bytes=PROBE_WORKDIR_BYTES, workdir_inodes=PROBE_WORKDIR_ENTRIES)
    fill = {"bytes": PROBE_WORKDIR_BYTES, "entries": PROBE_WORKDIR_ENTRIES}
    stages = [("inprocess", {"plant": True, "held": markers["heap"][::-1],
                             "workdir": dict(fill, keep="kept-inprocess")}),
              ("exec", {"look": True, "workdir": dict(fill, keep="kept-exec")}),
              ("scan", scan)]
    while stages:
        mode, extra = stages.pop(0)
        req = {"timeout": 30.0, "limits": small, "workdir": workdir, "hide": list(worker.cfg.get("hide", ()))}
        if mode == "scan":
            req.update(inprocess_code=SCAN_SOURCE, args=[json.dumps(extra)], limits=limits, workdir=None)
        elif mode == "exec":
            req.update(argv=[python, "-c", PROBE_SOURCE, json.dumps(dict(args, **extra))])
        else:
            code = f"# {markers['code']}\n{PROBE_SOURCE}" if mode == "inprocess" else PROBE_SOURCE
            req.update(inprocess_code=code, args=[json.dumps(dict(args, **extra))])
        res = worker.execute(req, probe=True)
        if mode == "exec" and res["returncode"] in (126, 127) and b"sandbox: cannot execute" in res["stderr"]:
            report["skipped"] = {"exec": res["stderr"][-300:].decode(errors="replace").strip()}
            stages.insert(0, ("inprocess_look", extra))
            continue
        try:
            if res["status"] != "ok":
                raise ValueError(f"status {res['status']}")
            got = json.loads(res["stdout"].splitlines()[-1])
        except (ValueError, IndexError) as e:
            report["errors"].append(f"{mode} probe failed ({e}; {res['info']!r}; "
                                    f"{res['stderr'][-400:].decode(errors='replace')!r})")
            continue
        if mode == "scan":
            report["heap"] = got
            continue
        if mode != "inprocess_look":
            measured = report["modes"][mode] = got["measured"]
            measured["workdir"]["back"] = _came_back(workdir, extra["workdir"]["keep"], args["token"])
        if "carried" in got:
            report["carried"] = got["carried"]
        if mode == "inprocess":
            worker.finish_pending()
            report["tree_killed"] = not _processes_named(comm)


def _came_back(workdir: str, name: str, token: str) -> str:
    """"ok" if the file the execution wrote in its working copy is in the host `workdir` with
    what it wrote, else what is there."""
    try:
        data = fstree.read_file(workdir, name, max_bytes=4096)
    except OSError as e:
        return f"{name}: {e.strerror or e}"
    return "ok" if data == token.encode() else f"{name} holds {data[:100]!r}"


def _processes_named(comm: str) -> list[int]:
    """Pids (in our /proc) whose command name is `comm`; each one found is SIGKILLed."""
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/comm") as f:
                if f.read().strip() != comm:
                    continue
        except OSError:
            continue
        found.append(int(name))
        try:
            os.kill(int(name), 9)
        except OSError:
            pass
    return found


def _map_out(uid_map: list[list[int]], uid: int) -> int | None:
    for inner, outer, count in uid_map:
        if inner <= uid < inner + count:
            return outer + uid - inner
    return None


def _few(names, n: int = 8) -> str:
    names = list(names)
    return ", ".join(map(str, names[:n])) + (f" and {len(names) - n} more" if len(names) > n else "")


def derive(plan: dict, report: dict, limits: dict, expected_uid: int | None) -> dict[str, tuple[bool, str]]:
    """{claim: (measured to hold, evidence where it does not)} from a `run()` report, for the
    pool's `Limits` (as a dict; the probe's working copy had the smaller ones in the report's
    "workdir") and the host uid the plan gives slot 0 (None when it gives none). A claim about
    the program holds only if it held in both modes; without a report of both, nothing holds
    (unless the exec mode was skipped because the pool's Python cannot be exec'd in the sandbox
    at all: then the in-place mode, which keeps more, is what counts)."""
    out: dict[str, tuple[bool, str]] = {}
    modes = report.get("modes", {})
    errors = "; ".join(report.get("errors", [])) or "no probe report"
    worker = report.get("worker", {})
    wns = worker.get("ns", {})

    required = {"inprocess"} | ({"exec"} - set(report.get("skipped", {})))

    def claim(name: str, why_not) -> None:
        """`why_not(measured)` returns "" where the claim holds, else the evidence."""
        if not required <= set(modes):
            out[name] = (False, errors)
            return
        bad = [f"{mode}: {why}" for mode, why in sorted((mode, why_not(m)) for mode, m in modes.items()) if why]
        out[name] = (not bad, "; ".join(bad))

    def none_of(names, results=("ok",)):
        def why_not(m):
            hits = {n: m["calls"].get(n) for n in names if m["calls"].get(n) in results}
            return f"succeeded: {hits}" if hits else ""
        return why_not

    def fresh(ns):
        return lambda m: f"{ns} namespace is the worker's" if m["ns"].get(ns) in (None, wns.get(ns)) else ""

    def filtered(m):
        want = {**{n: "EPERM" for n in FILTER_EPERM}, "clone3": "ENOSYS", "af_alg": "EAFNOSUPPORT"}
        if "x32" in m["calls"]:
            want["x32"] = "EPERM"
        bad = {n: m["calls"].get(n) for n, answer in want.items() if m["calls"].get(n) != answer}
        if m["status"].get("Seccomp") != 2:
            bad["Seccomp"] = m["status"].get("Seccomp")
        return f"not refused by the filter: {bad}" if bad else ""

    def no_network(m):
        reach = {a: r for a, r in m["connect"].items() if r not in UNREACHABLE}
        if reach or set(m["interfaces"]) - {"lo"}:
            return f"interfaces {m['interfaces']}, connect {reach}"
        return ""

    def host_uid(m) -> int | None:
        """The program's uid as the pool's user namespace sees it."""
        uid = m["uid"]
        if m["ns"].get("user") != wns.get("user"):
            uid = _map_out(m["uid_map"], uid)
        if uid is not None and plan.get("mode") == "userns":
            uid = _map_out(worker.get("uid_map", []), uid)
        return uid

    cpu = max(1, int(-(-limits["cpu_seconds"] // 1)))
    rlimits = {"CPU": [cpu, cpu + 1], "AS": [limits["address_space_bytes"]] * 2,
               "FSIZE": [limits["file_size_bytes"]] * 2, "NOFILE": [limits["open_files"]] * 2,
               "NPROC": [limits["processes"]] * 2, "CORE": [0, 0]}

    claim("capabilities_dropped", lambda m: ", ".join(
        f"{k}={m['status'].get(k, -1):#x}" for k in CAP_SETS if m["status"].get(k) != 0))
    claim("no_new_privileges", lambda m: "" if m["status"].get("NoNewPrivs") == 1 else
          f"NoNewPrivs={m['status'].get('NoNewPrivs')}")
    claim("seccomp_filter", filtered)
    claim("nested_user_namespaces_blocked", none_of(NESTED_USERNS))
    claim("mount_blocked", none_of(MOUNTS))
    claim("keyring_blocked", none_of(KEYRING, results=("ok", "ENOKEY")))  # ENOKEY: the search ran
    claim("kernel_surface_blocked", none_of(KERNEL_SURFACE))
    claim("no_network", no_network)
    claim("host_processes_hidden", lambda m: "" if set(m["procs"]) <= {1, m["pid"]} else
          f"{len(m['procs'])} processes visible in /proc")
    claim("user_namespace", lambda m: fresh("user")(m) or ("" if m["uid"] == 1000 else f"uid {m['uid']}"))
    for kind, ns in (("pid", "pid"), ("mount", "mnt"), ("network", "net"), ("ipc", "ipc"), ("uts", "uts"),
                     ("cgroup", "cgroup")):
        claim(f"{kind}_namespace", fresh(ns))
    claim("environment_cleared", lambda m: "" if set(m["env"]) <= ALLOWED_ENV else
          f"environment has {sorted(set(m['env']) - ALLOWED_ENV)}")
    claim("rlimits", lambda m: ", ".join(
        f"{k}={m['rlimits'].get(k)}" for k, v in rlimits.items() if m["rlimits"].get(k) != v))
    claim("unprivileged", lambda m: "" if host_uid(m) not in (0, None) else
          f"the program is host uid {host_uid(m)}")
    claim("distinct_uid_per_worker", lambda m: "" if expected_uid is not None and host_uid(m) == expected_uid
          else f"host uid {host_uid(m)}, not the slot's {expected_uid}")
    claim("readonly_host_filesystem", lambda m: "" if all(m["readonly"].values()) and m["write_root"] != "ok"
          else f"read-only {m['readonly']}, writing / {m['write_root']}")
    claim("private_tmp", lambda m: "" if m["mounts"].get("/tmp") == "tmpfs" else
          f"/tmp is {m['mounts'].get('/tmp')}")
    claim("private_dev", lambda m: "" if m["mounts"].get("/dev") == "tmpfs"
          and set(m["devices"]) <= HARMLESS_DEVICES else
          f"/dev is {m['mounts'].get('/dev')} with {sorted(set(m['devices']) - HARMLESS_DEVICES)}")
    claim("hidden_paths", lambda m: "" if all(v in ("absent", "unreadable", []) for v in m["hidden"].values())
          else f"visible beyond the exposed paths: {m['hidden']}")

    view = report.get("view") or {}

    def allow_list(m) -> str:
        v = m.get("view")
        if v is None or not view:
            return "not measured"
        listed, bad = v["listed"], []
        for path, names in view["within"].items():
            got = listed.get(path)
            extra = sorted(set(got) - set(names)) if isinstance(got, list) else []
            if extra:
                bad.append(f"{path} shows {_few(extra)}")
        for path, want in view["same"].items():
            if listed.get(path) != want:
                got = listed.get(path)
                bad.append(f"{path} is {_few(got) if isinstance(got, list) else got}, not as on the host")
        if v["exposed_missing"]:
            bad.append(f"exposed paths missing: {_few(v['exposed_missing'])}")
        if v["canary"]:
            bad.append(f"{view['canary']}, made on the host outside the view, is visible")
        readable = sorted(n for n, r in v["project_code"].items() if r == "readable")
        if readable:
            bad.append(f"the source of {readable} can be imported")
        return "; ".join(bad)

    wd = report.get("workdir") or {}

    def bounded(m) -> str:
        w = m.get("workdir")
        if w is None or not wd:
            return "not measured"
        bad = []
        for what, limit in (("bytes", wd["bytes"]), ("entries", wd["entries"])):
            stop = w[f"{what}_stop"]
            if stop not in ("ENOSPC", "EDQUOT") or w[what] > limit:
                then = "with no error" if stop == "none" else f"then {stop}"
                bad.append(f"{w[what]} {what} written {then} (limit {limit})")
        if w.get("back") != "ok":
            bad.append(f"what it wrote did not come back to the host ({w.get('back')})")
        return "; ".join(bad)

    claim("allow_list_view", allow_list)
    claim("workdir_bounded", bounded)

    heap = report.get("heap")
    if heap is None:
        out["no_heap_carryover"] = (False, errors)
    else:
        found = set(heap["found"])
        control = {"own_code", "own_heap"} - found
        carried_over = sorted(found & {"code", "heap"})
        why = (f"the memory scan missed its own {sorted(control)} markers" if control else
               f"the next in-place execution found the previous one's {carried_over} markers in its memory"
               if carried_over else "")
        out["no_heap_carryover"] = (not why, why)

    carried = report.get("carried")
    if carried is None:
        for name in ("sockets_cleared", "ipc_cleared", "private_tmp"):
            out[name] = (False, errors)
    else:
        sock = carried["unix_name"] or carried["unix_reach"] != "ECONNREFUSED" or carried["tcp_port"] != "ok"
        out["sockets_cleared"] = (not sock, f"the next execution found them: {carried}" if sock else "")
        ipc = carried["sysv"] + [p for p in carried["files"] if p.startswith("/dev/shm/")]
        out["ipc_cleared"] = (not ipc, f"the next execution found {ipc}" if ipc else "")
        tmp = [p for p in carried["files"] if p.startswith("/tmp/")]
        if tmp and out["private_tmp"][0]:
            out["private_tmp"] = (False, f"the next execution found {tmp}")
    killed = report.get("tree_killed")
    why = "" if killed else "a setsid'd daemon outlived its execution" if killed is False else errors
    out["kill_whole_process_tree"] = (bool(killed), why)
    return out
