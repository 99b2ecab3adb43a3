"""rlcode.train.progress: under a hand-driven clock, the exact lines, throttling and ETA of the
log mode (a stream that is not a TTY: plain lines, no carriage return), and tqdm's bar redrawn in
place on a terminal (TTY), with messages through tqdm.write in both."""

import io
import os
import re
import sys

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
    # tqdm's bar on a terminal shows the same ETA.
    clock, term = Clock(), Terminal()
    progress = Progress(1000, desc="train", stream=term, start=900, clock=clock)
    clock.t += 10.0
    progress.update(910)
    assert term.getvalue().split("\r")[-1].endswith("| 910/1000 [00:10<01:30,  1.00step/s]")


def test_log_messages_go_through_tqdm_write_and_nothing_is_redrawn():
    clock, out = Clock(), io.StringIO()
    progress = Progress(3, desc="sft", stream=out, min_interval=10.0, clock=clock)
    progress.write("before the first step")
    clock.t += 1.0
    progress.update(1, nll=2.5)  # the first step: printed at once
    clock.t += 1.0
    progress.update(2, nll=1.25)  # within min_interval: not printed ...
    progress.write("eval @ 2: pass@1=0.5")  # ... until a message, which it follows
    progress.write("another message")  # nothing new to print after this one
    clock.t += 1.0
    progress.update(3, nll=1.0)  # the last step
    progress.close()
    assert out.getvalue().splitlines() == [
        "before the first step",
        "sft 1/3 [######--------------] nll=2.5 elapsed 0m01s ETA 0m02s",
        "eval @ 2: pass@1=0.5",
        "sft 2/3 [#############-------] nll=1.25 elapsed 0m02s ETA 0m01s",
        "another message",
        "sft 3/3 [####################] nll=1 elapsed 0m03s ETA 0m00s",
    ]
    assert "\r" not in out.getvalue()


def test_terminal_gets_tqdms_bar_redrawn_in_place():
    clock, term = Clock(), Terminal()
    progress = Progress(4, desc="eval", stream=term, clock=clock)
    clock.t += 1.0
    progress.update(1, note="a-long-field-value", loss=np.float32(0.123456))
    clock.t += 0.01  # redrawn even within min_interval
    progress.update(2, note="b")
    out = term.getvalue()
    assert "\n" not in out  # one line, drawn again after each carriage return
    created, first, second = out.split("\r")[1:]
    # tqdm's bar: percentage, bar, count, elapsed<remaining, rate, then the fields in their order
    # (1 s for the first step, 3 left: 3 s).
    bar = r"\|[ #0-9]+\|"
    assert re.fullmatch(r"eval:   0%" + bar + r" 0/4 \[00:00<\?, \?step/s\]", created)
    stats = r" 1/4 \[00:01<00:03,  1\.00step/s, note=a-long-field-value, loss=0\.123\]"
    assert re.fullmatch(r"eval:  25%" + bar + stats, first)
    # The fields are merged; spaces blank out what the longer first line left behind.
    assert re.fullmatch(r"eval:  50%" + bar + r" 2/4 \[00:01<00:01, +[0-9.]+step/s, note=b, loss=0\.123\] +", second)
    assert len(second) == len(first)
    second = second.rstrip()
    mark = len(out)
    progress.write("a message")
    # tqdm.write: the bar is blanked, the message printed on its own line, the bar drawn again.
    cleared, drawn = term.getvalue()[mark:].split("a message\n")
    assert cleared.strip(" \r") == "" and drawn == "\r" + second
    progress.close()
    progress.close()
    assert term.getvalue().endswith(second + "\n") and term.getvalue().count("\n") == 2


def test_a_terminal_of_size_zero_gets_the_log_lines(monkeypatch):
    # A new pseudo-terminal has no size, like those some job runners allocate; tqdm would draw
    # nothing on it. As stderr (the default stream), tqdm also reads its width (-1) for the lines.
    leader, follower = os.openpty()

    class SizelessTerminal(Terminal):
        def fileno(self):
            return follower

    try:
        assert os.get_terminal_size(follower) == (0, 0)
        term = SizelessTerminal()
        monkeypatch.setattr(sys, "stderr", term)
        clock = Clock()
        with Progress(2, desc="eval", clock=clock) as progress:
            clock.t += 1.0
            progress.update(1)
            progress.write("a message")
    finally:
        os.close(leader)
        os.close(follower)
    assert term.getvalue() == "eval 1/2 [##########----------] elapsed 0m01s ETA 0m01s\na message\n"


def test_rejects_bad_arguments_and_updates_after_close():
    with pytest.raises(ValueError, match="start <= total"):
        Progress(10, start=11, stream=io.StringIO())
    progress = Progress(10, stream=io.StringIO())
    progress.close()
    with pytest.raises(RuntimeError, match="after close"):
        progress.update(1)
