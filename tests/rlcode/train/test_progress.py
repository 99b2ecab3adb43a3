"""rlcode.train.progress: exact lines, throttling and ETA under a hand-driven clock, for a log
file (not a TTY) and a terminal (TTY)."""

import io

import numpy as np
import pytest

from rlcode.train.progress import Progress, format_duration


class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


class Terminal(io.StringIO):
    def isatty(self):
        return True


def test_format_duration():
    assert format_duration(0) == "0m00s"
    assert format_duration(7.4) == "0m07s"
    assert format_duration(83) == "1m23s"
    assert format_duration(3599.4) == "59m59s"
    assert format_duration(3720) == "1h02m"
    assert format_duration(27 * 3600 + 5 * 60 + 1) == "27h05m"
    assert format_duration(float("inf")) == "?"


def test_log_lines_are_throttled_and_exact():
    clock, out = Clock(), io.StringIO()
    progress = Progress(10, desc="train", stream=out, min_interval=1.0, clock=clock)
    clock.t += 2.0
    progress.update(1, loss=0.123456, reward=np.float32(12345.6), tokens=np.int64(512), ok=True)
    clock.t += 0.5
    progress.update(2, loss=0.5)  # 0.5 s after the last line: not printed
    clock.t += 1.1
    progress.update(3, loss=2.0)
    clock.t += 0.1
    progress.update(10, loss=1e-4)  # the last step is always printed
    progress.close()
    assert out.getvalue().splitlines() == [
        "train 1/10 [##------------------] loss=0.123 reward=1.23e+04 tokens=512 ok=True elapsed 0m02s ETA 0m18s",
        # 3.6 s for 3 steps: 1.2 s per step, 7 steps left.
        "train 3/10 [######--------------] loss=2 reward=1.23e+04 tokens=512 ok=True elapsed 0m04s ETA 0m08s",
        "train 10/10 [####################] loss=0.0001 reward=1.23e+04 tokens=512 ok=True elapsed 0m04s ETA 0m00s",
    ]
    assert "\r" not in out.getvalue()


def test_close_prints_the_unprinted_last_state():
    clock, out = Clock(), io.StringIO()
    with Progress(100, stream=out, min_interval=60.0, clock=clock) as progress:
        clock.t += 1.0
        progress.update(1)
        clock.t += 1.0
        progress.update(2)
        progress.write("eval: pass@1=0.31")
    assert out.getvalue().splitlines() == [
        "1/100 [--------------------] elapsed 0m01s ETA 1m39s",
        "eval: pass@1=0.31",
        "2/100 [--------------------] elapsed 0m02s ETA 1m38s",
    ]


def test_eta_of_a_resumed_run_counts_only_this_process():
    clock, out = Clock(), io.StringIO()
    progress = Progress(1000, desc="train", stream=out, start=900, clock=clock)
    assert progress.line().endswith("900/1000 [##################--] elapsed 0m00s ETA ?")
    clock.t += 10.0
    progress.update(910)
    # 10 steps in 10 s, 90 left: 90 s (counting from step 0 would say 1 s).
    assert progress.eta() == pytest.approx(90.0)
    assert out.getvalue() == "train 910/1000 [##################--] elapsed 0m10s ETA 1m30s\n"
    clock.t += 3590.0
    progress.update(911)  # 3600 s for 11 steps, 89 left: 29127 s
    assert out.getvalue().splitlines()[-1].endswith("elapsed 1h00m ETA 8h05m")


def test_terminal_redraws_one_line():
    clock, term = Clock(), Terminal()
    progress = Progress(4, desc="eval", stream=term, clock=clock)
    clock.t += 1.0
    progress.update(1, note="a-long-field-value")
    first = "eval 1/4 [#####---------------] note=a-long-field-value elapsed 0m01s ETA 0m03s"
    assert term.getvalue() == "\r" + first
    clock.t += 0.01  # redrawn even within min_interval
    progress.update(2, note="b")
    second = "eval 2/4 [##########----------] note=b elapsed 0m01s ETA 0m01s"
    # Spaces blank out what the longer first line left behind.
    assert term.getvalue() == "\r" + first + "\r" + second + " " * (len(first) - len(second))
    mark = len(term.getvalue())
    progress.write("a message")
    # The bar's characters are blanked (the rest of the line already is), then drawn again below.
    assert term.getvalue()[mark:] == "\r" + " " * len(second) + "\r" + "a message\n" + "\r" + second
    progress.close()
    progress.close()
    assert term.getvalue().endswith(second + "\n") and "\n" not in term.getvalue()[:mark]


def test_rejects_bad_arguments_and_updates_after_close():
    with pytest.raises(ValueError, match="start <= total"):
        Progress(10, start=11, stream=io.StringIO())
    progress = Progress(10, stream=io.StringIO())
    progress.close()
    with pytest.raises(RuntimeError, match="after close"):
        progress.update(1)
