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
