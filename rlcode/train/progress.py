"""A progress bar for long jobs (training, sampling, evaluation) that also reads well in logs.

    start = int(state.step)
    with Progress(total=cfg.steps, desc="train", start=start) as progress:
        for step in range(start + 1, cfg.steps + 1):
            ...
            progress.update(step, loss=loss, reward=mean_reward)

renders as

    train 120/1000 [##------------------] loss=0.412 reward=0.31 elapsed 2m00s ETA 14m40s

On a terminal the line is redrawn in place; in a log file (stream not a TTY) a full line is
printed at most every `min_interval` seconds and on the last step.
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Callable
from typing import Any, TextIO

import numpy as np

__all__ = ["Progress", "format_duration"]

BAR_WIDTH = 20


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


class Progress:
    """`desc step/total [bar] name=value ... elapsed ETA` for a job of `total` steps.

    Args:
      total: the step at which the job is done.
      desc: a short label in front of the bar.
      stream: where to draw; None means sys.stderr (looked up when the bar is created).
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
        self._t0 = clock()
        self._tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self._step = self.start
        self._fields: dict[str, Any] = {}
        self._last_print = -math.inf
        self._drawn = 0  # characters of the bar now on the terminal line (TTY only)
        self._pending = False  # the latest state has not been printed (non-TTY only)
        self._closed = False

    def eta(self, now: float | None = None) -> float:
        """Seconds left at the mean time per step of this process; inf before its first step."""
        now = self._clock() if now is None else now
        done = self._step - self.start
        if done <= 0:
            return math.inf if self._step < self.total else 0.0
        return (now - self._t0) / done * max(self.total - self._step, 0)

    def line(self, now: float | None = None) -> str:
        """The status line for the latest update, without a line ending."""
        now = self._clock() if now is None else now
        fraction = min(max(self._step / self.total, 0.0), 1.0) if self.total else 1.0
        filled = int(fraction * BAR_WIDTH)
        parts = [self.desc] if self.desc else []
        parts.append(f"{self._step}/{self.total} [{'#' * filled}{'-' * (BAR_WIDTH - filled)}]")
        parts += [f"{name}={_format_field(value)}" for name, value in self._fields.items()]
        parts.append(f"elapsed {format_duration(now - self._t0)} ETA {format_duration(self.eta(now))}")
        return " ".join(parts)

    def update(self, step: int, **fields: Any) -> None:
        """Record that `step` steps are done; `fields` are merged into the ones shown."""
        if self._closed:
            raise RuntimeError("Progress.update after close()")
        self._step = int(step)
        self._fields.update(fields)
        now = self._clock()
        if self._tty:
            self._redraw(now)
        elif now - self._last_print >= self.min_interval or self._step >= self.total:
            self._print_line(now)
        else:
            self._pending = True

    def write(self, msg: str) -> None:
        """Print `msg` on its own line; on a TTY the bar is cleared first and redrawn below it."""
        if self._tty and self._drawn:
            self.stream.write("\r" + " " * self._drawn + "\r")
            self.stream.write(f"{msg}\n")
            self._drawn = 0
            self._redraw(self._clock())
        else:
            self.stream.write(f"{msg}\n")
            self.stream.flush()

    def close(self) -> None:
        """End the bar's line; in a log, print the latest state if it was not printed yet."""
        if self._closed:
            return
        self._closed = True
        if self._tty and self._drawn:
            self.stream.write("\n")
            self.stream.flush()
        elif self._pending:
            self._print_line(self._clock())

    def _redraw(self, now: float) -> None:
        text = self.line(now)
        # Spaces overwrite what a longer previous line left behind.
        self.stream.write("\r" + text + " " * max(self._drawn - len(text), 0))
        self.stream.flush()
        self._drawn = len(text)

    def _print_line(self, now: float) -> None:
        self.stream.write(self.line(now) + "\n")
        self.stream.flush()
        self._last_print = now
        self._pending = False

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()
