"""A progress bar for long jobs (training, sampling, evaluation), on tqdm, that also reads well
in logs.

    start = int(state.step)
    with Progress(total=cfg.steps, desc="train", start=start) as progress:
        for step in range(start + 1, cfg.steps + 1):
            ...
            progress.update(step, loss=loss, reward=mean_reward)
            progress.write(f"eval @ {step}: ...")  # a line of its own; the bar stays below

On a terminal this is tqdm's bar, redrawn in place, with the fields after its rate:

    train:  12%|█▏        | 120/1000 [02:00<14:40,  1.00s/step, loss=0.412, reward=0.31]

In a log file (a stream that is not a TTY) nothing is redrawn and no carriage return is written:
a plain line is printed at most every `min_interval` seconds and on the last step, and the latest
step once more after a message or on close if it was not printed yet:

    train 120/1000 [##------------------] loss=0.412 reward=0.31 elapsed 2m00s ETA 14m40s

Both modes are one tqdm instance, which counts and times the steps, throttles the display,
formats the line (`tqdm.format_meter`; the log line through a `bar_format` with fields of our
own, tqdm's documented `format_dict` extension) and keeps messages clear of the bar
(`tqdm.write`). The log mode is a tqdm frontend, as tqdm's own notebook and rich frontends are:
its `display` prints a line where the terminal's status printer would redraw one.
"""

from __future__ import annotations

import math
import os
import sys
import time
from collections.abc import Callable
from typing import Any, TextIO

import numpy as np
from tqdm import tqdm

__all__ = ["Progress", "format_duration"]

BAR_WIDTH = 20
# The log line: tqdm's count and bar (ASCII, '#' done and '-' to do), then our fields and times.
LOG_FORMAT = "{label}{n_fmt}/{total_fmt} [{bar:%d}]{fields} elapsed {elapsed_h} ETA {eta_h}" % BAR_WIDTH
LOG_BAR_CHARS = "-#"


def format_duration(seconds: float) -> str:
    """'0m07s', '1m23s' under an hour, '1h02m' from an hour on; '?' when unknown (not finite)."""
    if not math.isfinite(seconds):
        return "?"
    seconds = max(0, int(round(seconds)))
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"


def _format_field(value: Any) -> str:
    """Floats with 3 significant digits; integers, bools and strings as they are."""
    if isinstance(value, str):
        return value
    try:
        a = np.asarray(value)
    except Exception:  # an object numpy cannot hold: shown as its str
        return str(value)
    if a.ndim == 0 and a.dtype.kind == "f":
        return f"{float(a):.3g}"
    if a.ndim == 0 and a.dtype.kind in "iu":
        return str(int(a))
    if a.ndim == 0 and a.dtype.kind == "b":
        return str(bool(a))
    return str(value)


def _is_terminal(stream: Any) -> bool:
    """Whether tqdm can draw its bar on `stream`: a TTY whose size is unknown or not zero (tqdm
    draws nothing on a pseudo-terminal of size 0 x 0, as some job runners allocate; such a
    stream gets the log lines instead)."""
    if not getattr(stream, "isatty", lambda: False)():
        return False
    try:
        size = os.get_terminal_size(stream.fileno())
    except (AttributeError, OSError, ValueError):  # no file descriptor, or not one with a size
        return True
    return size.columns > 0 and size.lines > 0


class _Bar(tqdm):
    """tqdm on an injectable clock, with the fields and times of the log line in its
    `format_dict` and the mean time per step of this process as the ETA (smoothing 0)."""

    # tqdm's monitor thread only lowers a dynamic `miniters`; ours is fixed.
    monitor_interval = 0

    def __init__(self, *, clock: Callable[[], float], **kwargs):
        self.fields: dict[str, str] = {}
        super().__init__(smoothing=0, miniters=0, disable=False, **kwargs)
        self._time = clock
        self.start_t = self.last_print_t = clock()

    def eta(self, elapsed: float) -> float:
        done = self.n - self.initial
        if done <= 0:
            return math.inf if self.n < self.total else 0.0
        return elapsed / done * max(self.total - self.n, 0)

    def fields_text(self, separator: str) -> str:
        return separator.join(f"{name}={value}" for name, value in self.fields.items())

    @property
    def format_dict(self) -> dict:
        """tqdm's, plus the log line's own fields: label, fields, elapsed_h, eta_h."""
        d = super().format_dict
        d.update(label=f"{self.desc} " if self.desc else "",
                 fields=" " + self.fields_text(" ") if self.fields else "",
                 elapsed_h=format_duration(d["elapsed"]), eta_h=format_duration(self.eta(d["elapsed"])))
        return d


class _LogBar(_Bar):
    """The log frontend: `display` prints the log line, once per state (step and fields), so a
    refresh after a message repeats nothing already printed; nothing is cleared or redrawn. A
    line is printed when tqdm's update finds `mininterval` passed since the last one (the
    first step at once), and on close if the latest state was not printed."""

    def __init__(self, **kwargs):
        self._shown: tuple | None = None
        # gui=True: no status printer (it redraws with '\r'); `display` below prints instead.
        super().__init__(gui=True, ascii=LOG_BAR_CHARS, bar_format=LOG_FORMAT, **kwargs)
        self._shown = (self.n, self.fields_text(" "))  # the starting state is not news
        self.last_print_t = -math.inf  # the first step is printed at once, however soon
        # Out of tqdm's list of bars on screen: a log line takes no terminal row, so it neither
        # shifts a terminal bar down nor is cleared around `tqdm.write`.
        with self._lock:
            self._instances.discard(self)

    @property
    def format_dict(self) -> dict:
        d = super().format_dict
        d.update(ncols=None)  # a log line is never cut to a screen width (tqdm asks stderr's, even of a 0 x 0 pty)
        return d

    def pending(self) -> bool:
        return self._shown != (self.n, self.fields_text(" "))

    def display(self, msg: str | None = None, pos: int | None = None) -> bool:
        if self._shown is None or not self.pending():
            return False
        self.fp.write(str(self) + "\n")
        self.fp.flush()
        self._shown = (self.n, self.fields_text(" "))
        self.last_print_n, self.last_print_t = self.n, self._time()
        return True

    def clear(self, nolock: bool = False) -> None:
        pass

    def close(self) -> None:
        if not self.disable:
            self.display()
        super().close()


class Progress:
    """`desc step/total [bar] name=value ... elapsed ETA` for a job of `total` steps, drawn by
    tqdm on a terminal and printed as plain lines in a log (see the module docstring).

    Args:
      total: the step at which the job is done.
      desc: a short label in front of the bar.
      stream: where to draw; None means sys.stderr (looked up when the bar is created). A
        terminal (`isatty()`, and a size that is not 0 x 0) gets tqdm's bar, any other stream
        the log lines.
      min_interval: on a stream that is not a TTY, the least time between two printed lines.
      start: the step the job starts from (a resumed run). The ETA counts only the steps done
        by this process: (time since creation) / (step - start) per remaining step.
      clock: monotonic time in seconds; injectable for tests.
    """

    def __init__(
        self,
        total: int,
        desc: str = "",
        stream: TextIO | None = None,
        min_interval: float = 0.5,
        start: int = 0,
        *,
        clock: Callable[[], float] = time.monotonic,
    ):
        if not 0 <= start <= total:
            raise ValueError(f"Progress: need 0 <= start <= total, got start={start}, total={total}")
        self.total, self.desc, self.start = int(total), desc, int(start)
        self.stream = sys.stderr if stream is None else stream
        self.min_interval = min_interval
        self._clock = clock
        self._tty = _is_terminal(self.stream)
        common = dict(total=self.total, initial=self.start, desc=desc, file=self.stream, clock=clock)
        if self._tty:
            # Redrawn on every update (a step takes far longer than a redraw); width follows the
            # terminal's.
            self._bar: _Bar = _Bar(mininterval=0, unit="step", dynamic_ncols=True, leave=True, **common)
        else:
            self._bar = _LogBar(mininterval=min_interval, **common)
        self._closed = False

    def eta(self, now: float | None = None) -> float:
        """Seconds left at the mean time per step of this process; inf before its first step."""
        now = self._clock() if now is None else now
        return self._bar.eta(now - self._bar.start_t)

    def line(self, now: float | None = None) -> str:
        """The log line for the latest update, without a line ending."""
        d = self._bar.format_dict
        if now is not None:
            elapsed = now - self._bar.start_t
            d.update(elapsed=elapsed, elapsed_h=format_duration(elapsed),
                     eta_h=format_duration(self._bar.eta(elapsed)))
        d.update(bar_format=LOG_FORMAT, ascii=LOG_BAR_CHARS, ncols=None)
        return tqdm.format_meter(**d)

    def update(self, step: int, **fields: Any) -> None:
        """Record that `step` steps are done; `fields` are merged into the ones shown."""
        if self._closed:
            raise RuntimeError("Progress.update after close()")
        bar = self._bar
        bar.fields.update({name: _format_field(value) for name, value in fields.items()})
        if self._tty:
            bar.set_postfix_str(bar.fields_text(", "), refresh=False)
        bar.update(int(step) - bar.n)  # drawn (terminal) or printed once tqdm's interval has passed
        if not self._tty and bar.n >= self.total:  # the last step is always printed
            bar.refresh()

    def write(self, msg: str) -> None:
        """Print `msg` on its own line (`tqdm.write`: on a terminal the bar is cleared first and
        drawn again below it; in a log the latest step follows if it was not printed yet)."""
        tqdm.write(str(msg), file=self.stream)
        self.stream.flush()
        if not self._tty:
            self._bar.refresh()  # nothing once closed

    def close(self) -> None:
        """End the bar: on a terminal its line is ended; in a log the latest step is printed if it
        was not yet."""
        if self._closed:
            return
        self._closed = True
        self._bar.close()

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()
