"""Least privilege and nothing carried between executions: attacks on the sandbox's privileges.

Every test here is an attack that worked on an earlier version of the sandbox (or proves a
separation that a regression would break): capabilities kept inside the program's user namespace,
nested namespaces and mounts, kernel surface a Python program does not need (keyrings, bpf,
ptrace, perf, io_uring, ...), sockets kept alive across executions by an in-flight SCM_RIGHTS
message, keyring keys and SysV/POSIX IPC objects seen by the next execution or another pool, two
pools sharing uids, and a `guarantees()` that claimed what it never measured.

Each runs in both privilege modes the machine offers: "root" (the workers are real root, programs
run as a per-slot host uid) and "userns" (the workers are root of a user namespace of their own,
forced with `disable=("root",)`), and, where it matters, in both the exec and the in-place Python
mode. One worker per pool, so that "the next execution" runs on the same worker, in the same
network namespace as the previous one.
"""

from __future__ import annotations

import errno
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import textwrap
import uuid
import warnings

import pytest

from rlcode.sandbox import Limits, SandboxPool, SandboxWarning
from rlcode.sandbox import isolation
from rlcode.sandbox import pool as pool_lib
from rlcode.sandbox import probe as probe_lib
from rlcode.sandbox import seccomp

LIMITS = Limits(cpu_seconds=10, wall_seconds=30, address_space_bytes=2 * 2**30, processes=48,
                output_bytes=256 * 1024, tmp_bytes=64 * 2**20)
ARCH = platform.machine()
NR = {name: nrs[1 if ARCH in ("aarch64", "arm64") else 0] for name, nrs in seccomp.SYSCALLS.items()}
FILTER = "2" if seccomp.supported() else "0"  # /proc/self/status "Seccomp" where a filter is expected


def _token() -> str:
    return "tok" + uuid.uuid4().hex[:16]


@pytest.fixture(scope="module", params=["root", "userns"])
def pool(request):
    disable = ("root",) if request.param == "userns" else ()
    if request.param == "root" and os.geteuid() != 0:
        pytest.skip("root mode needs the tests to run as root")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", SandboxWarning)
        p = SandboxPool(1, LIMITS, disable=disable)
    with p:
        if p.guarantees()["mode"] != request.param:
            pytest.skip(f"{request.param} mode unavailable here ({p.guarantees()['notes']})")
        yield p


def need(pool: SandboxPool, *keys: str) -> None:
    g = pool.guarantees()
    missing = [k for k in keys if not g.get(k)]
    if missing:
        pytest.skip(f"this machine does not provide {missing} ({g.get('notes')})")


def run_json(pool: SandboxPool, code: str, inprocess: bool, **kwargs) -> dict:
    """Run `PRELUDE + code` (which prints one JSON object last) and return that object."""
    r = pool.run_python(PRELUDE + textwrap.dedent(code), inprocess=inprocess, **kwargs)
    assert r.ok, (r.status, r.info, r.stdout[-2000:], r.stderr[-3000:])
    return json.loads(r.stdout.splitlines()[-1])


# Runs inside the sandbox: `sc(name, *args)` makes a raw system call and answers "ok" or the errno
# name; `attempt(fn)` runs fn in a forked child (an attack that succeeds must not change the
# process that reports) and returns what fn returned, or the errno name of the OSError it raised.
PRELUDE = textwrap.dedent(f"""
    import ctypes, errno, json, os, socket, sys
    NR = {NR!r}
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long

    def sc(name, *args):
        nr = NR[name] if isinstance(name, str) else name
        ret = libc.syscall(ctypes.c_long(nr), *args)
        return "ok" if ret != -1 else errno.errorcode.get(ctypes.get_errno(), "?")

    def attempt(fn):
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:
            try:
                out = fn()
            except OSError as e:
                out = errno.errorcode.get(e.errno, str(e.errno))
            except BaseException as e:
                out = "raised " + type(e).__name__
            os.write(w, json.dumps(out).encode())
            os._exit(0)
        os.close(w)
        data = os.read(r, 65536)
        os.close(r)
        os.waitpid(pid, 0)
        return json.loads(data) if data else "no answer"
""")


# ----------------------------------------------------------------------------------------------
# capabilities, nested namespaces, mounts
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("inprocess", [False, True])
def test_program_holds_no_capability_and_runs_under_the_filter(pool, inprocess):
    """The in-place mode used to keep the full capability set in the program's user namespace
    (it was already uid 1000 there, so its setresuid was no transition), and exec mode kept a full
    bounding set: every set must be empty, no_new_privs on, the seccomp filter installed."""
    out = run_json(pool, """
        status = dict(line.split(":\\t", 1) for line in open("/proc/self/status").read().splitlines()
                      if ":\\t" in line)
        out = {k: status[k].strip() for k in ("CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb",
                                              "NoNewPrivs", "Seccomp")}
        out["securebits"] = libc.prctl(27, 0, 0, 0, 0)  # PR_GET_SECUREBITS
        print(json.dumps(out))
    """, inprocess)
    zero = "0000000000000000"
    assert out == {"CapInh": zero, "CapPrm": zero, "CapEff": zero, "CapBnd": zero, "CapAmb": zero,
                   "NoNewPrivs": "1", "Seccomp": FILTER, "securebits": 0xEB}, out


def test_the_filter_is_in_force_where_the_architecture_is_known(pool):
    """The other tests of the filter skip where it is reported missing; on x86-64 and arm64 it
    must not be."""
    if not seccomp.supported():
        pytest.skip(f"no system-call table for {ARCH}")
    assert pool.guarantees()["seccomp_filter"] is True, pool.guarantees()["notes"]


def test_no_capability_without_a_user_namespace_of_its_own():
    """Root mode with the per-execution user namespace switched off: the program is the slot's
    host uid, whose uid change cleared its sets, but the bounding set and securebits must be
    dealt with before that change, while the worker's capabilities are still there."""
    if os.geteuid() != 0:
        pytest.skip("root mode needs the tests to run as root")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", SandboxWarning)
        p = SandboxPool(1, LIMITS, preload=(), disable=("program_userns",))
    with p:
        assert p.guarantees()["capabilities_dropped"] is True, p.guarantees()["notes"]
        for inprocess in (False, True):
            out = run_json(p, """
                status = dict(line.split(":\\t", 1) for line in open("/proc/self/status").read().splitlines()
                              if ":\\t" in line)
                print(json.dumps([int(status[k], 16) for k in ("CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb")]
                                 + [int(status["Seccomp"]), libc.prctl(27, 0, 0, 0, 0)]))
            """, inprocess)
            # 0xEB: NOROOT and NO_CAP_AMBIENT_RAISE set, every bit locked.
            assert out == [0, 0, 0, 0, 0, int(FILTER), 0xEB], out


@pytest.mark.parametrize("inprocess", [False, True])
def test_nested_namespaces_mounts_and_userns_limit_are_out_of_reach(pool, inprocess):
    """The attack of the in-place mode: raise max_user_namespaces again, create nested user,
    network and mount namespaces and mount a tmpfs there."""
    out = run_json(pool, """
        def raise_limit():
            with open("/proc/sys/user/max_user_namespaces", "w") as f:
                f.write("100")
            return "ok"

        def nested_mount():
            os.mkdir("/tmp/m")
            for flags in (0x10000000 | 0x00020000, 0x00020000):   # NEWUSER|NEWNS, then NEWNS alone
                if libc.unshare(flags) == 0:
                    break
            else:
                return "unshare " + errno.errorcode[ctypes.get_errno()]
            if libc.mount(b"none", b"/tmp/m", b"tmpfs", 0, None) != 0:
                return "mount " + errno.errorcode[ctypes.get_errno()]
            return "ok"

        def clone_userns():
            pid = libc.syscall(ctypes.c_long(NR["clone"]), ctypes.c_ulong(0x10000000 | 17), 0, 0, 0, 0)
            if pid == 0:
                os._exit(0)
            if pid < 0:
                return errno.errorcode[ctypes.get_errno()]
            os.waitpid(pid, 0)
            return "ok"

        print(json.dumps({
            "raise_limit": attempt(raise_limit),
            "unshare_user": attempt(lambda: sc("unshare", 0x10000000)),
            "unshare_net": attempt(lambda: sc("unshare", 0x40000000)),
            "unshare_mount": attempt(lambda: sc("unshare", 0x00020000)),
            "clone_userns": attempt(clone_userns),
            "nested_mount": attempt(nested_mount),
            "chroot": attempt(lambda: sc("chroot", b"/")),
        }))
    """, inprocess)
    assert not [k for k, v in out.items() if v == "ok"], out


def _seccomp_attempts() -> str:
    """Sandbox code: each call with arguments under which the kernel itself would let it succeed
    (or fail with another error than the filter's), so that only the filter answers EPERM."""
    return """
        import array, struct
        buf = ctypes.create_string_buffer(64)
        iov = struct.pack("PL", ctypes.addressof(buf), 8)
        iov_buf = ctypes.create_string_buffer(iov)
        perf_attr = ctypes.create_string_buffer(struct.pack("IIQQQQ", 1, 128, 1, 0, 0, 0x60) + bytes(80))
        uring_params = ctypes.create_string_buffer(120)
        handle = ctypes.create_string_buffer(struct.pack("Ii", 128, 0) + bytes(128))
        mount_id = ctypes.c_int()
        clone3_args = ctypes.create_string_buffer(struct.pack("QQQQQQQQ", 0x10000000, 0, 0, 0, 17, 0, 0, 0))

        def traceme():
            return sc("ptrace", 0, 0, 0, 0)

        def clone3():
            ret = libc.syscall(ctypes.c_long(NR["clone3"]), clone3_args, ctypes.c_size_t(64))
            if ret == 0:
                os._exit(0)
            return "ok" if ret > 0 else errno.errorcode[ctypes.get_errno()]

        pidfd = os.pidfd_open(os.getpid())
        res = {
            "unshare_user": attempt(lambda: sc("unshare", 0x10000000)),
            "unshare_uts": attempt(lambda: sc("unshare", 0x04000000)),
            "setns": sc("setns", os.open("/proc/self/ns/uts", os.O_RDONLY), 0),
            "clone_newuser": attempt(lambda: sc("clone", ctypes.c_ulong(0x10000000 | 17), 0, 0, 0, 0)),
            "clone_newnet": attempt(lambda: sc("clone", ctypes.c_ulong(0x40000000 | 17), 0, 0, 0, 0)),
            "open_tree": sc("open_tree", -100, b"/", 0),
            "fsopen": sc("fsopen", b"tmpfs", 0),
            "mount": attempt(lambda: sc("mount", b"none", b"/tmp", b"tmpfs", 0, None)),
            "umount2": attempt(lambda: sc("umount2", b"/tmp", 2)),
            "chroot": attempt(lambda: sc("chroot", b"/")),
            "pivot_root": attempt(lambda: sc("pivot_root", b"/", b"/")),
            "keyctl": sc("keyctl", 0, -3, 0),
            "add_key": sc("add_key", b"user", b"rlcode-probe", b"x", 1, -2),
            "request_key": sc("request_key", b"user", b"rlcode-no-such-key", None, 0),
            "ptrace": attempt(traceme),
            "process_vm_readv": sc("process_vm_readv", os.getpid(), iov_buf, 1, iov_buf, 1, 0),
            "kcmp": sc("kcmp", os.getpid(), os.getpid(), 0, 0, 0),
            "pidfd_getfd": sc("pidfd_getfd", pidfd, 0, 0),
            "bpf": sc("bpf", 0, bytes(72), 72),
            "perf_event_open": sc("perf_event_open", perf_attr, 0, -1, -1, 0),
            "io_uring_setup": sc("io_uring_setup", 1, uring_params),
            "userfaultfd": sc("userfaultfd", 0o2000000 | 1),
            "name_to_handle_at": sc("name_to_handle_at", -100, b"/", handle, ctypes.byref(mount_id), 0),
            "fanotify_init": sc("fanotify_init", 0x200, 0),
            "init_module": sc("init_module", None, 0, b""),
            "kexec_load": sc("kexec_load", 0, 0, None, 0),
            "reboot": sc("reboot", 0, 0, 0, None),
            "swapon": sc("swapon", b"/tmp/none", 0),
            "acct": sc("acct", None),
            "syslog": sc("syslog", 10, None, 0),
            "clone3": attempt(clone3),
        }
        try:
            socket.socket(38, socket.SOCK_SEQPACKET)  # AF_ALG
            res["af_alg"] = "ok"
        except OSError as e:
            res["af_alg"] = errno.errorcode[e.errno]
        if "x86_64" == os.uname().machine:
            res["x32_getpid"] = sc(0x40000000 | 39)
            res["modify_ldt"] = sc("modify_ldt", 0, buf, 16)
        print(json.dumps(res))
    """


@pytest.mark.parametrize("inprocess", [False, True])
def test_seccomp_refuses_kernel_surface(pool, inprocess):
    """Kernel surface a Python program never needs is refused by the filter itself: EPERM for the
    deny list (calls the kernel would otherwise allow here, such as perf_event_open on its own
    task, io_uring_setup, userfaultfd, keyctl, ptrace(TRACEME), open_tree, process_vm_readv),
    ENOSYS for clone3 (the C library then falls back to clone), EAFNOSUPPORT for socket families
    outside unix/inet/inet6/netlink, and x32 system calls are refused on x86-64."""
    need(pool, "seccomp_filter")
    out = run_json(pool, _seccomp_attempts(), inprocess)
    expected = {k: "EPERM" for k in out}
    expected.update(clone3="ENOSYS", af_alg="EAFNOSUPPORT")
    assert out == expected, {k: v for k, v in out.items() if v != expected[k]}


@pytest.mark.parametrize("inprocess", [False, True])
def test_python_subprocess_threads_and_multiprocessing_work_under_the_filter(pool, inprocess):
    """What the filter must not break: fork, vfork (subprocess), posix_spawn, threads (clone3
    falls back to clone), thread and process pools in every multiprocessing start method,
    asyncio with a subprocess, unix socket pairs."""
    out = run_json(pool, """
        import asyncio, concurrent.futures, multiprocessing, subprocess, threading
        res = {}
        res["subprocess"] = subprocess.run(["sh", "-c", "echo hi"], capture_output=True).stdout.decode()
        pid = os.posix_spawnp("true", ["true"], dict(os.environ))
        res["posix_spawn"] = os.waitpid(pid, 0)[1]
        pid = os.fork()
        if pid == 0:
            os._exit(7)
        res["fork"] = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
        box = []
        t = threading.Thread(target=box.append, args=(1,))
        t.start()
        t.join()
        res["thread"] = box
        with concurrent.futures.ThreadPoolExecutor(4) as ex:
            res["thread_pool"] = sum(ex.map(abs, range(-10, 0)))
        for method in ("fork", "spawn", "forkserver"):
            with multiprocessing.get_context(method).Pool(2) as p:
                res["mp_" + method] = p.map(abs, [-1, -2, -3])

        async def main():
            proc = await asyncio.create_subprocess_exec("echo", "aio", stdout=asyncio.subprocess.PIPE)
            out, _ = await proc.communicate()
            return out.decode()
        res["asyncio"] = asyncio.run(main())
        a, b = socket.socketpair()
        a.sendall(b"pair")
        res["socketpair"] = b.recv(4).decode()
        print(json.dumps(res))
    """, inprocess, timeout=60)
    assert out == {"subprocess": "hi\n", "posix_spawn": 0, "fork": 7, "thread": [1], "thread_pool": 55,
                   "mp_fork": [1, 2, 3], "mp_spawn": [1, 2, 3], "mp_forkserver": [1, 2, 3],
                   "asyncio": "aio\n", "socketpair": "pair"}, out


# ----------------------------------------------------------------------------------------------
# nothing carried from one execution to the next
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("inprocess", [False, True])
def test_socket_kept_alive_in_flight_does_not_reach_the_next_execution(pool, inprocess):
    """A unix socket that holds its own fd in its receive queue (SCM_RIGHTS) outlives every process
    of its execution, and so does a TCP listener sent along with it; in a network namespace reused
    by the worker, the next execution would find the name (and the port taken)."""
    need(pool, "network_namespace")
    tok = _token()
    port = 20000 + int(tok[3:7], 16) % 20000
    plant = f"""
        import array
        name = b"\\0rlcode-inflight-{tok}"
        u = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        u.bind(name)
        t = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        t.bind(("0.0.0.0", {port}))
        t.listen()
        fds = array.array("i", [u.fileno(), t.fileno()])
        u.sendmsg([b"x"], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, fds)], 0, name)
        print(json.dumps("planted"))
    """
    look = f"""
        unix = open("/proc/net/unix").read()
        tcp = [line.split()[1] for line in open("/proc/net/tcp").read().splitlines()[1:]]
        u = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        try:
            u.sendto(b"y", b"\\0rlcode-inflight-{tok}")
            reach = "ok"
        except OSError as e:
            reach = errno.errorcode[e.errno]
        t = socket.socket()
        try:
            t.bind(("0.0.0.0", {port}))
            bound = "ok"
        except OSError as e:
            bound = errno.errorcode[e.errno]
        print(json.dumps({{"named": "{tok}" in unix, "tcp": tcp, "reach": reach, "bind": bound}}))
    """
    assert run_json(pool, plant, inprocess) == "planted"
    out = run_json(pool, look, not inprocess)
    assert out == {"named": False, "tcp": [], "reach": "ECONNREFUSED", "bind": "ok"}, out
    assert pool.run(["true"]).ok


def _keyring_look(desc: str) -> str:
    return f"""
        found = {{}}
        buf = ctypes.create_string_buffer(256)
        for ring, spec in (("session", -3), ("user", -4), ("user_session", -5)):
            kid = libc.syscall(ctypes.c_long(NR["keyctl"]), 10, spec, b"user", b"{desc}", 0)
            n = libc.syscall(ctypes.c_long(NR["keyctl"]), 11, kid, buf, 256) if kid > 0 else -1
            found[ring] = buf.raw[:n].decode(errors="replace") if n > 0 else kid > 0
        found["request_key"] = libc.syscall(ctypes.c_long(NR["request_key"]), b"user", b"{desc}", None, 0) > 0
        try:
            found["proc_keys"] = "{desc}" in open("/proc/keys").read()
        except OSError:
            found["proc_keys"] = False
        print(json.dumps(found))
    """


def test_keyring_key_reaches_neither_the_next_execution_nor_another_pool(pool):
    """A key added to the session or user keyring used to be readable by the next execution of
    the worker (they share its session keyring) and by other pools (which shared the uids)."""
    tok = _token()
    desc, payload = f"rlcode-{tok}", f"secret-{tok}"
    add = f"""
        res = {{ring: sc("add_key", b"user", b"{desc}", b"{payload}", {len(payload)}, spec)
               for ring, spec in (("session", -3), ("user", -4), ("user_session", -5))}}
        print(json.dumps(res))
    """
    run_json(pool, add, False)
    run_json(pool, add, True)
    nothing = {"session": False, "user": False, "user_session": False, "request_key": False,
               "proc_keys": False}
    for inprocess in (False, True):
        assert run_json(pool, _keyring_look(desc), inprocess) == nothing
    disable = ("root",) if pool.guarantees()["mode"] == "userns" else ()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", SandboxWarning)
        other = SandboxPool(1, LIMITS, preload=(), disable=disable)
    with other:
        assert run_json(other, _keyring_look(desc), False) == nothing


def test_the_pool_process_keyring_is_out_of_reach():
    """The trainer's session keyring (inherited by the workers it spawns) holds a secret: no
    execution may find it, let alone read it."""
    tok = _token()
    desc, secret = f"rlcode-host-{tok}", f"hostsecret-{tok}"
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    script = textwrap.dedent(f"""
        import ctypes, json, sys, warnings
        NR = {NR!r}
        libc = ctypes.CDLL(None, use_errno=True)
        libc.syscall.restype = ctypes.c_long
        if libc.syscall(ctypes.c_long(NR["keyctl"]), 1, None) < 0:     # a session keyring of our own
            print("SKIP no keyctl here"); sys.exit(0)
        if libc.syscall(ctypes.c_long(NR["add_key"]), b"user", b"{desc}", b"{secret}", {len(secret)}, -3) < 0:
            print("SKIP add_key refused here"); sys.exit(0)
        from rlcode.sandbox import Limits, SandboxPool
        warnings.simplefilter("ignore")
        with SandboxPool(1, Limits(wall_seconds=30), preload=()) as p:
            for inprocess in (False, True):
                r = p.run_python({(PRELUDE + textwrap.dedent(_keyring_look(desc)))!r}, inprocess=inprocess)
                print(r.status, r.stdout.decode(errors="replace"), r.stderr.decode(errors="replace")[-500:])
    """)
    out = subprocess.run([sys.executable, "-c", script], cwd=repo, capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stderr[-3000:]
    if out.stdout.startswith("SKIP"):
        pytest.skip(out.stdout.strip())
    assert out.stdout.count("ok {") == 2, out.stdout
    assert secret not in out.stdout and "true" not in out.stdout, out.stdout


@pytest.mark.parametrize("inprocess", [False, True])
def test_ipc_objects_and_tmp_files_do_not_reach_the_next_execution(pool, inprocess):
    """SysV shared memory, semaphores and message queues, POSIX message queues, /dev/shm and /tmp
    files of one execution are gone for the next one on the same worker (fresh IPC namespace and
    tmpfs mounts per execution)."""
    need(pool, "ipc_namespace", "private_tmp")
    plant = """
        key = 0x5EED
        res = {"shm": libc.shmget(key, 4096, 0o1666) >= 0, "sem": libc.semget(key, 1, 0o1666) >= 0,
               "msg": libc.msgget(key, 0o1666) >= 0}
        libc.mq_open(b"/rlcode-left", os.O_CREAT | os.O_RDWR, ctypes.c_int(0o600), None)
        for path in ("/tmp/left", "/dev/shm/left"):
            with open(path, "w") as f:
                f.write("x")
        print(json.dumps(res))
    """
    look = """
        key = 0x5EED
        res = {k: open(f"/proc/sysvipc/{k}").read().splitlines()[1:] for k in ("shm", "sem", "msg")}
        res.update(shmget=libc.shmget(key, 0, 0) >= 0, semget=libc.semget(key, 0, 0) >= 0,
                   msgget=libc.msgget(key, 0) >= 0, mq=libc.mq_open(b"/rlcode-left", os.O_RDONLY) >= 0,
                   files=[p for p in ("/tmp/left", "/dev/shm/left") if os.path.exists(p)])
        print(json.dumps(res))
    """
    assert run_json(pool, plant, inprocess) == {"shm": True, "sem": True, "msg": True}
    out = run_json(pool, look, inprocess)
    assert out == {"shm": [], "sem": [], "msg": [], "shmget": False, "semget": False, "msgget": False,
                   "mq": False, "files": []}, out


# ----------------------------------------------------------------------------------------------
# uids: one range per pool
# ----------------------------------------------------------------------------------------------


def test_pools_get_disjoint_uid_ranges_by_default():
    """Two pools (in one process or in two) used to run their programs under the same uids (one
    default base), sharing whatever the kernel keys by uid."""
    if os.geteuid() != 0:
        pytest.skip("programs run under per-slot uids only when the pool runs as root")
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    with SandboxPool(2, LIMITS, preload=()) as a, SandboxPool(2, LIMITS, preload=()) as b:
        ra, rb = set(range(a.uid_base, a.uid_base + 2)), set(range(b.uid_base, b.uid_base + 2))
        assert not ra & rb and min(ra | rb) >= pool_lib.AUTO_UID_BASE
        code = ("import warnings; warnings.simplefilter('ignore'); from rlcode.sandbox import SandboxPool; "
                "p = SandboxPool(1, preload=()); print(p.uid_base, p.guarantees()['distinct_uid_per_pool']); "
                "p.close()")
        out = subprocess.run([sys.executable, "-c", code], cwd=repo, capture_output=True, text=True,
                             timeout=120)
        assert out.returncode == 0, out.stderr[-2000:]
        other, distinct = out.stdout.split()
        assert int(other) not in ra | rb and distinct == "True"
        for p, r in ((a, ra), (b, rb)):
            assert p.guarantees()["distinct_uid_per_pool"] is True
            uid_map = p.run(["cat", "/proc/self/uid_map"]).stdout.split()
            assert uid_map[0] == b"1000" and int(uid_map[1]) in r, uid_map
        # An explicit base still works; overlapping a live pool's range is reported and warned.
        pool_lib._warned.discard("missing:distinct_uid_per_pool")
        with pytest.warns(SandboxWarning, match="uid"):
            c = SandboxPool(1, LIMITS, uid_base=a.uid_base + 1, preload=())
        with c:
            assert c.uid_base == a.uid_base + 1 and c.guarantees()["distinct_uid_per_pool"] is False
            assert c.run(["true"]).ok


# ----------------------------------------------------------------------------------------------
# guarantees(): measured, not assumed
# ----------------------------------------------------------------------------------------------

MEASURED = ("capabilities_dropped", "seccomp_filter", "no_new_privileges", "nested_user_namespaces_blocked",
            "mount_blocked", "keyring_blocked", "kernel_surface_blocked", "sockets_cleared",
            "ipc_cleared", "no_network", "host_processes_hidden", "user_namespace", "pid_namespace",
            "network_namespace", "ipc_namespace", "mount_namespace", "environment_cleared", "rlimits",
            "unprivileged", "kill_whole_process_tree", "allow_list_view", "workdir_bounded",
            "no_heap_carryover")


def test_guarantees_are_measured_inside_executions(pool):
    """Every claim that the plan makes is confirmed by the start-up probe (none contradicted);
    the probe measured both modes, and cheaply."""
    g, contradicted = pool._evaluate()
    # Workers that are root of their own user namespace while the pool is real root map the
    # program to host uid 0: the probe says so (the unprivileged set-up is meant for non-root).
    root_in_userns = g["mode"] == "userns" and os.geteuid() == 0
    assert [k for k, _ in contradicted] == (["unprivileged"] if root_in_userns else []), contradicted
    report = pool.probe_report()
    assert not report["errors"] and set(report["modes"]) == {"exec", "inprocess"}, report["errors"]
    for mode, m in report["modes"].items():
        assert {m["status"][k] for k in ("CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb")} == {0}, mode
        assert (m["status"]["NoNewPrivs"], m["status"]["Seccomp"]) == (1, int(FILTER)), mode
    assert 0 < report["seconds"] < 3.0, report["seconds"]
    assert all(isinstance(g[k], bool) for k in MEASURED)
    # Every one of them should hold here; where one does not, the plan's notes say which
    # mechanism the machine lacks.
    need(pool, *(k for k in MEASURED if not (k == "unprivileged" and root_in_userns)))


def test_a_claim_the_probe_contradicts_is_reported_false_and_warned(pool, monkeypatch):
    """guarantees() believes the measurement, not the plan: a probe that saw capabilities and a
    nested user namespace turns those claims False, with a note, and the pool warns once."""
    info = json.loads(json.dumps(pool._info))
    measured = info["probe"]["modes"]["inprocess"]
    measured["status"]["CapEff"] = 0x1FFFFFFFFFF
    measured["calls"]["unshare_user"] = "ok"
    monkeypatch.setattr(pool, "_info", info)
    g = pool.guarantees()
    assert g["capabilities_dropped"] is False and g["nested_user_namespaces_blocked"] is False
    assert g["seccomp_filter"] is False  # unshare was not refused with EPERM
    assert g["no_new_privileges"] is True and g["keyring_blocked"] is True
    assert "CapEff" in g["notes"] and "unshare_user" in g["notes"]
    for key in ("capabilities_dropped", "nested_user_namespaces_blocked", "seccomp_filter"):
        pool_lib._warned.discard(f"contradicted:{key}")
    with pytest.warns(SandboxWarning, match="probe"):
        pool._announce()
    with warnings.catch_warnings():
        warnings.simplefilter("error", SandboxWarning)
        pool._announce()


def _mode_switches(pool: SandboxPool) -> tuple[str, ...]:
    return ("root",) if pool.guarantees()["mode"] == "userns" else ()


def _need_view(pool: SandboxPool) -> None:
    if not pool._info["plan"]["fs"]:
        pytest.skip(f"no filesystem view on this machine ({pool.guarantees()['notes']})")


def test_the_allow_list_view_is_measured(pool):
    """The probe made a directory on the host outside the view (not in /tmp) and removed it
    afterwards; in both modes it found neither that directory nor anything of the repository
    checkout or the project's packages (importable or listed), only allowed entries in / and a
    minimal /etc, and the system directories as on the host. A directory made the same way is
    invisible to an ordinary execution too."""
    _need_view(pool)
    report = pool.probe_report()
    view = report["view"]
    canary = view["canary"]
    assert canary and not canary.startswith("/tmp/") and not os.path.exists(canary), canary
    package = os.path.dirname(os.path.abspath(pool_lib.rlcode.__file__))
    repos = list(pool._hide)  # the checkout, where rlcode runs from one
    # A checkout under /tmp (or another private mount) is gone with the host's /tmp: nothing to list.
    listed = [p for p in (package, *repos) if not any(isolation.under(p, d) for d in ("/tmp", "/dev", "/proc"))]
    assert set(listed) <= set(view["within"]) and "/usr" in view["same"], sorted(view["within"])
    assert set(report["modes"]) == {"inprocess", "exec"}
    for mode, m in report["modes"].items():
        v = m["view"]
        assert v["canary"] is False and not v["exposed_missing"], (mode, v)
        if package in listed:
            assert v["listed"][package] in ("absent", []), (mode, v["listed"][package])
        for repo in repos:
            if repo in listed:
                assert set(v["listed"][repo]) <= set(view["within"][repo]), (mode, v["listed"][repo])
        assert {"usr", "etc", "tmp", "dev", "proc"} <= set(v["listed"]["/"]) <= set(view["within"]["/"]), mode
        assert not {"var", "home", "opt", "srv"} & set(v["listed"]["/"]), (mode, v["listed"]["/"])
        assert {"passwd", "group", "hosts"} <= set(v["listed"]["/etc"]) <= set(view["within"]["/etc"]), mode
        assert v["listed"]["/usr"] == sorted(os.listdir("/usr")), mode
        assert "readable" not in v["project_code"].values(), (mode, v["project_code"])
    assert pool.guarantees()["allow_list_view"] is True, pool.guarantees()["notes"]
    outside = tempfile.mkdtemp(prefix="rlcode-test-outside-", dir=os.path.dirname(canary))
    try:
        for inprocess in (False, True):
            code = f"print(json.dumps([os.path.exists(p) for p in {[outside, package + '/__init__.py']!r}]))"
            assert run_json(pool, code, inprocess) == [False, False], inprocess
    finally:
        os.rmdir(outside)


def test_the_workdir_bound_is_measured(pool):
    """In both modes the probe's working copy took no more than its small limits (ENOSPC for
    bytes, then for entries), the file written within them reached the host workdir, and that
    workdir is gone afterwards."""
    _need_view(pool)
    report = pool.probe_report()
    limit = report["workdir"]
    assert not os.path.exists(limit["path"]) and limit["bytes"] <= 2**20 and limit["entries"] <= 1000
    for mode, m in report["modes"].items():
        w = m["workdir"]
        assert w["bytes_stop"] == "ENOSPC" and 0 < w["bytes"] <= limit["bytes"], (mode, w)
        assert w["entries_stop"] == "ENOSPC" and 0 < w["entries"] <= limit["entries"], (mode, w)
        assert w["back"] == "ok", (mode, w)
    assert pool.guarantees()["workdir_bounded"] is True, pool.guarantees()["notes"]


def test_no_heap_carryover_is_measured(pool):
    """The probe's memory scan found its own code and heap markers (the control) and neither
    marker of the in-place execution before it, which held them (the heap one printed, so the
    worker held it in that result)."""
    report = pool.probe_report()
    assert report["heap"] == {"found": ["own_code", "own_heap"]}, report["heap"]
    assert report["modes"]["inprocess"]["held"].startswith("rlprobe-")
    assert pool.guarantees()["no_heap_carryover"] is True, pool.guarantees()["notes"]


def test_without_the_filesystem_view_its_claims_are_measured_false_and_a_contradiction_warned(pool, monkeypatch):
    """With the filesystem view switched off ("fs"), the probe sees the canary, the project's
    source and the host's /, and writes past the working copy's limits: both claims are False,
    the notes say why. The same measurement against a plan that promises the view (this pool's)
    is reported as a contradiction, with its evidence, and warned."""
    _need_view(pool)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", SandboxWarning)
        off = SandboxPool(1, LIMITS, preload=(), disable=(*_mode_switches(pool), "fs"))
    with off:
        g, report, plan = off.guarantees(), off.probe_report(), off._info["plan"]
    assert g["allow_list_view"] is False and g["workdir_bounded"] is False
    assert "no filesystem view of its own (disabled)" in g["notes"], g["notes"]
    measured = probe_lib.derive(plan, report, LIMITS.to_dict(), None)
    holds, why = measured["allow_list_view"]
    assert not holds and f"{report['view']['canary']}, made on the host outside the view, is visible" in why, why
    assert "rlcode" in why and "can be imported" in why, why
    holds, why = measured["workdir_bounded"]
    assert not holds and "written with no error" in why, why
    assert not os.path.exists(report["view"]["canary"]) and not os.path.exists(report["workdir"]["path"])

    info = json.loads(json.dumps(pool._info))
    info["probe"] = report
    monkeypatch.setattr(pool, "_info", info)
    g = pool.guarantees()
    assert g["allow_list_view"] is False and g["workdir_bounded"] is False
    assert "contradicts allow_list_view" in g["notes"] and "contradicts workdir_bounded" in g["notes"]
    for key in ("allow_list_view", "workdir_bounded"):
        pool_lib._warned.discard(f"contradicted:{key}")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", SandboxWarning)  # the others, passed on by pytest.warns
        with pytest.warns(SandboxWarning, match="contradicts allow_list_view"):
            pool._announce()


def test_a_zygote_that_holds_earlier_executions_contradicts_no_heap_carryover(pool):
    """With the zygote forked anew from the worker's heap before every execution ("zygote", a
    fault for this test), the probe's scan finds the previous in-place execution's markers: the
    claim is reported False with a note, and warned. The fault is real: an in-place execution
    then finds the previous one's output in its own memory."""
    pool_lib._warned.discard("contradicted:no_heap_carryover")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", SandboxWarning)  # the others, passed on by pytest.warns
        with pytest.warns(SandboxWarning, match="contradicts no_heap_carryover"):
            faulty = SandboxPool(1, LIMITS, preload=(), disable=(*_mode_switches(pool), "zygote"))
    with faulty:
        g = faulty.guarantees()
        assert g["no_heap_carryover"] is False, g["notes"]
        assert "the start-up probe contradicts no_heap_carryover" in g["notes"], g["notes"]
        assert {"own_code", "own_heap", "heap"} <= set(faulty.probe_report()["heap"]["found"])
        prefix = "rlprobe-" + uuid.uuid4().hex[:8]
        secret = prefix + uuid.uuid4().hex
        assert faulty.run_python(f"print({secret[::-1]!r}[::-1])", inprocess=True).ok
        scan = {"prefix": prefix, "own": prefix + uuid.uuid4().hex, "held": (prefix + uuid.uuid4().hex)[::-1],
                "seek": {"output": [secret[:16], secret[16:]]}}
        r = faulty.run_python(probe_lib.SCAN_SOURCE, args=(json.dumps(scan),), inprocess=True)
        assert r.ok and json.loads(r.stdout)["found"] == ["output", "own_code", "own_heap"], r


# ----------------------------------------------------------------------------------------------
# the filter itself
# ----------------------------------------------------------------------------------------------


def _header_numbers(path: str) -> dict[str, int]:
    out = {}
    with open(path) as f:
        for m in re.finditer(r"#define\s+__NR(?:3264)?_(\w+)\s+(\d+)\b", f.read()):
            out[m.group(1)] = int(m.group(2))
    return out


def test_syscall_numbers_match_the_kernel_headers():
    """The filter's numbers against the C headers (the generic table is arm64's)."""
    headers = {0: ["/usr/include/x86_64-linux-gnu/asm/unistd_64.h", "/usr/include/asm/unistd_64.h"],
               1: ["/usr/include/asm-generic/unistd.h"]}
    checked = 0
    for idx, paths in headers.items():
        path = next((p for p in paths if os.path.exists(p)), None)
        if path is None:
            continue
        table = _header_numbers(path)
        for name, nrs in seccomp.SYSCALLS.items():
            if name in table:
                assert nrs[idx] == table[name], (path, name, nrs[idx], table[name])
                checked += 1
    if checked < 50:
        pytest.skip("kernel headers not installed")


def _emulate(insns, nr: int, arch: int, arg0: int = 0) -> int:
    """A classic-BPF interpreter for the opcodes a seccomp filter uses (an oracle independent of
    the kernel, so that the arm64 half is tested on any machine)."""
    data = {0: nr & 0xFFFFFFFF, 4: arch, 16: arg0 & 0xFFFFFFFF, 20: arg0 >> 32}
    acc, pc = 0, 0
    while True:
        code, jt, jf, k = insns[pc]
        pc += 1
        if code == 0x20:
            acc = data[k]
        elif code == 0x06:
            return k
        elif code in (0x15, 0x35, 0x45):
            hit = {0x15: acc == k, 0x35: acc >= k, 0x45: bool(acc & k)}[code]
            pc += jt if hit else jf
        else:
            raise AssertionError(f"unexpected opcode {code:#x}")


def test_filter_decisions_on_both_architectures():
    ins = seccomp.INSTRUCTIONS
    allow, eperm = seccomp.SECCOMP_RET_ALLOW, seccomp.SECCOMP_RET_ERRNO | errno.EPERM
    enosys, eafnosupport = seccomp.SECCOMP_RET_ERRNO | errno.ENOSYS, seccomp.SECCOMP_RET_ERRNO | errno.EAFNOSUPPORT
    denied = {n for names in seccomp.DENIED.values() for n in names}
    for _, audit, idx in seccomp.ARCHES:
        nr = {k: v[idx] for k, v in seccomp.SYSCALLS.items() if v[idx] is not None}
        for name in denied & set(nr):
            assert _emulate(ins, nr[name], audit) == eperm, name
        assert _emulate(ins, nr["clone3"], audit) == enosys
        assert _emulate(ins, nr["clone"], audit, 0x01200011) == allow  # fork: CHILD_SETTID|CLEARTID|SIGCHLD
        assert _emulate(ins, nr["clone"], audit, 0x003D0F00) == allow  # pthread_create
        for flag in (0x00020000, 0x02000000, 0x04000000, 0x08000000, 0x10000000, 0x20000000, 0x40000000):
            assert _emulate(ins, nr["clone"], audit, flag | 17) == eperm, hex(flag)
        for fam, want in ((1, allow), (2, allow), (10, allow), (16, allow), (17, eafnosupport),
                          (38, eafnosupport), (40, eafnosupport)):
            assert _emulate(ins, nr["socket"], audit, fam) == want, fam
        special = {nr[k] for k in denied & set(nr)} | {nr["clone3"], nr["socket"], nr["socketpair"]}
        for n in range(0, 300):  # everything not named is allowed
            if n not in special:
                assert _emulate(ins, n, audit) == allow, (audit, n)
    assert _emulate(ins, 0x40000000 | 39, seccomp.AUDIT_ARCH_X86_64) == eperm  # x32
    assert _emulate(ins, 20, 0x40000003) == seccomp.SECCOMP_RET_KILL_PROCESS  # i386
    assert _emulate(ins, 39, 0) == seccomp.SECCOMP_RET_KILL_PROCESS
