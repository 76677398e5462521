"""Long jobs log their progress at a bounded rate: done / total, rate and time left."""

from __future__ import annotations

import logging

from draftsmith.runtime.progress import ProgressLog, seconds_text


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def test_lines_come_every_interval_or_fraction_and_at_the_end(caplog):
    clock, log = Clock(), logging.getLogger("draftsmith.test.progress")
    p = ProgressLog(log, "train", total=1000, unit="steps", every_s=10, clock=clock)
    with caplog.at_level(logging.INFO, logger=log.name):
        for step in range(1, 1001):
            clock.t += 0.1  # 10 steps/s: a line every 10 s = 100 steps, or 5% = 50 steps
            p.update(step, loss="1.234")
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 20 == p.lines  # every 50 steps (5%), the last at step 1000
    first = lines[0]
    assert first.startswith("train: 50/1000 steps (5%), loss 1.234, 10.00 steps/s")
    assert first.endswith("5 s elapsed, ~1.6 min left")  # 950 steps at 10/s
    assert lines[-1].startswith("train: 1000/1000 steps (100%)") and "~0 s left" in lines[-1]


def test_a_slow_job_logs_by_time_and_a_resumed_one_rates_only_its_own_work(caplog):
    clock, log = Clock(), logging.getLogger("draftsmith.test.progress")
    p = ProgressLog(log, "capture", total=10_000, unit="rows", done=5000, every_s=10, clock=clock)
    with caplog.at_level(logging.INFO, logger=log.name):
        clock.t = 4
        p.update(5010)  # neither 10 s nor 5% yet
        clock.t = 12
        p.update(5020)
    (line,) = [r.getMessage() for r in caplog.records]
    assert "5020/10000 rows (50%)" in line and "1.67 rows/s" in line  # 20 rows in 12 s
    assert "~49.8 min left" in line  # 4980 rows at 1.67/s


def test_seconds_text():
    assert [seconds_text(s) for s in (12, 270, 7560)] == ["12 s", "4.5 min", "2.1 h"]
