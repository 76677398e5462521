"""The precision probe's cache (draftsmith/runtime/precision.py): processes that start together
on one machine measure once and agree, the others waiting for the first's answer."""

from __future__ import annotations

import json
import multiprocessing
import time
from pathlib import Path

from draftsmith.runtime.precision import cached_probe, trainer_shapes

SHAPES = trainer_shapes({"hidden_size": 64, "intermediate_size": 128}, 3, 32, 256)


def probe_at_once(root: Path, log: Path, answer: Path, barrier) -> None:
    """One of two processes probing the same shapes at the same moment (a 0.5 s timer)."""

    def timer(precision, shapes, limit_s=float("inf")):
        with open(log, "a") as f:
            f.write(f"{precision}\n")
        time.sleep(0.5)
        return 0.010 if precision == "fp32" else 0.004

    barrier.wait()
    result = cached_probe(SHAPES, "test cpu", root=root, timer=timer)
    answer.write_text(json.dumps(result))


def test_two_processes_probing_at_once_measure_once_and_agree(tmp_path):
    root, log = tmp_path / "precision", tmp_path / "timed.log"
    ctx = multiprocessing.get_context("fork")
    barrier = ctx.Barrier(2)
    answers = [tmp_path / "a.json", tmp_path / "b.json"]
    procs = [ctx.Process(target=probe_at_once, args=(root, log, a, barrier)) for a in answers]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
    assert [p.exitcode for p in procs] == [0, 0]
    assert log.read_text().split() == ["fp32", "bf16"]  # one measurement, not one each
    got = [json.loads(a.read_text()) for a in answers]
    assert {g["chosen"] for g in got} == {"bf16"}
    assert sorted(g["cached"] for g in got) == [False, True]
    assert got[0]["fp32_ms"] == got[1]["fp32_ms"] and got[0]["bf16_ms"] == got[1]["bf16_ms"]
