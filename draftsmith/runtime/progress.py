"""Progress lines for a long job's log: work done of the total, the rate and the time left, at
a bounded rate (every `every_s` seconds or `every_frac` of the total, whichever comes first, and
at the end), so a 5-minute and a 5-hour job both show where they are without flooding the log.

    progress = ProgressLog(log, "train", total=370, unit="steps", done=0)
    progress.update(step, loss=f"{loss:.3f}", tokens_per_s=f"{tps:.0f}")
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable


def seconds_text(s: float) -> str:
    """12 s, 4.5 min, 2.1 h."""
    if s < 90:
        return f"{s:.0f} s"
    if s < 5400:
        return f"{s / 60:.1f} min"
    return f"{s / 3600:.1f} h"


class ProgressLog:
    """Logs `what: <done>/<total> <unit> (<pct>%), <figures>, <rate>/s, <elapsed> elapsed,
    ~<left> left` at most every `every_s` seconds or `every_frac` of the total."""

    def __init__(
        self,
        log: logging.Logger,
        what: str,
        total: int,
        unit: str,
        done: int = 0,
        every_s: float = 10.0,
        every_frac: float = 0.05,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.log, self.what, self.total, self.unit = log, what, int(total), unit
        self.clock, self.every_s = clock, every_s
        self.step = max(1, int(self.total * every_frac))
        self.start_done, self.t0 = int(done), clock()
        self.last_t, self.last_done = self.t0, int(done)
        self.lines = 0
        self.done = int(done)

    def due(self, done: int) -> bool:
        if done >= self.total:
            return True
        return self.clock() - self.last_t >= self.every_s or done - self.last_done >= self.step

    def update(self, done: int, **figures) -> None:
        """Record `done` units; logs a line when one is due (figures: name -> shown value)."""
        self.done = int(done)
        if not self.due(done):
            return
        now = self.clock()
        elapsed = now - self.t0
        rate = (done - self.start_done) / elapsed if elapsed > 0 else 0.0
        left = (self.total - done) / rate if rate > 0 else float("nan")
        shown = "".join(f", {k.replace('_', ' ')} {v}" for k, v in figures.items())
        pct = 100.0 * done / self.total if self.total else 100.0
        eta = seconds_text(left) if left == left else "unknown"
        self.log.info(
            "%s: %d/%d %s (%.0f%%)%s, %.2f %s/s, %s elapsed, ~%s left",
            self.what, done, self.total, self.unit, pct, shown, rate, self.unit,
            seconds_text(elapsed), eta,
        )  # fmt: skip
        self.last_t, self.last_done = now, done
        self.lines += 1


class LoggedBar:
    """A tqdm bar whose `update(n)` also counts `n` more units done in a ProgressLog, for the
    jobs that count their work through a bar (the server engines' regeneration and capture);
    `figures()` gives the line's figures at each update."""

    def __init__(self, bar, progress: ProgressLog, figures: Callable[[], dict] = dict):
        self.bar, self.progress, self.figures = bar, progress, figures

    def update(self, n: int = 1) -> None:
        self.bar.update(n)
        self.progress.done += n  # counted before figures() reads it
        self.progress.update(self.progress.done, **self.figures())
