"""Checks of the experiment scripts' command-line behaviour."""


def assert_one_line_error(out, *texts):
    """The finished process `out` failed with exit status 2 and one ``config error:`` line on stderr,
    holding each of `texts`, and no traceback; returns that line."""
    assert out.returncode == 2, out.stderr[-3000:]
    lines = [line for line in out.stderr.splitlines() if line.startswith("config error:")]
    assert len(lines) == 1 and "Traceback" not in out.stderr, out.stderr[-3000:]
    for text in texts:
        assert text in lines[0], lines[0]
    return lines[0]


# Starts a command the way a terminal starts a foreground job: SIGINT at its default disposition
# and no signal blocked. A test process may have inherited (or been left with) an ignored or
# blocked SIGINT, and both survive exec, so a child started directly would never see Ctrl-C.
_FOREGROUND = ("import os, signal, sys\n"
               "signal.pthread_sigmask(signal.SIG_SETMASK, ())\n"
               "signal.signal(signal.SIGINT, signal.SIG_DFL)\n"
               "os.execvp(sys.argv[1], sys.argv[1:])\n")


def foreground(cmd):
    """`cmd` (a list) prefixed so that it runs with SIGINT deliverable (see `_FOREGROUND`)."""
    import sys

    return [sys.executable, "-c", _FOREGROUND, *cmd]


def sigint_state(pid):
    """'ignored', 'blocked' or 'deliverable': how process `pid` stands towards SIGINT (Linux /proc)."""
    masks = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("SigIgn", "SigBlk"):
                masks[key] = int(value.strip(), 16)
    bit = 1 << (2 - 1)  # SIGINT is signal 2
    if masks.get("SigIgn", 0) & bit:
        return "ignored"
    return "blocked" if masks.get("SigBlk", 0) & bit else "deliverable"
