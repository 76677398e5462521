"""benchmarks/bench_shared_stages.py's pure parts: launches and start-ups from server records,
job seconds and spans from benchmark files, the order of job starts from a Snakemake log, the
Markdown from a synthetic record."""

from __future__ import annotations

import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import bench_shared_stages as bss  # noqa: E402

HEADER = "s\th:m:s\tmax_rss\tmax_vms\tmax_uss\tmax_pss\tio_in\tio_out\tmean_load\tcpu_time\n"


def write_tsv(path: Path, seconds: float, end: float) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(HEADER + f"{seconds}\t0:00:01\t400\t1300\t290\t330\t0.2\t0.0\t70\t{seconds}\n")
    os.utime(path, (end, end))


def test_start_ups_count_a_shared_host_once_and_every_own_server():
    shared = [
        {"server_host_pid": 7, "server_startup_seconds": [30.04], "server_started_by_this_job": 1},
        {"server_host_pid": 7, "server_startup_seconds": [30.04, 28.0]},  # relaunched
        {"server_host_pid": 7, "server_startup_seconds": [30.04]},
    ]
    assert bss.startups(shared) == [30.0, 28.0]
    own = [{"server_startup_seconds": [20.0]}, {"server_startup_seconds": [21.26]}]
    assert bss.startups(own) == [20.0, 21.3]


def test_stage_jobs_sum_seconds_and_span_from_first_start_to_last_end(tmp_path: Path):
    jobs = tmp_path / "benchmarks" / "jobs" / "capture"
    write_tsv(jobs / "rows_000000-000008.tsv", 10.0, 1000.0)  # 990 - 1000
    write_tsv(jobs / "rows_000008-000016.tsv", 12.0, 1004.0)  # 992 - 1004
    write_tsv(jobs / "rows_000016-000024.tsv", 5.0, 1020.0)  # 1015 - 1020
    assert bss.stage_jobs(tmp_path, "capture") == {"jobs": 3, "job_s": 27.0, "span_s": 30.0}
    assert bss.stage_jobs(tmp_path, "regenerate") == {"jobs": 0, "job_s": 0.0, "span_s": 0.0}


def stage(launches: int, startup: list[float], job_s: float, span_s: float) -> dict:
    return {"jobs": 8, "job_s": job_s, "span_s": span_s, "server_launches": launches,
            "startup_s": startup, "started_by_a_job": launches, "wait_s": [0.0] * 8}  # fmt: skip


def record() -> dict:
    job = {
        "mode": "job",
        "wall_s": 900.0,
        "server_processes_left": 0,
        "hosts_left": 0,
        "load_1min": [2.1, 2.5],
        "order": "RRCRCC",
        "stages": {
            "regenerate": stage(8, [40.0] * 8, 400.0, 210.0),
            "capture": stage(8, [35.0] * 8, 330.0, 180.0),
        },
    }
    run = {
        **job,
        "mode": "run",
        "wall_s": 300.0,
        "load_1min": [2.0, 2.2],
        "order": "RRRCCC",
        "stages": {
            "regenerate": stage(1, [41.0], 90.0, 60.0),
            "capture": stage(1, [36.0], 60.0, 45.0),
        },
    }
    return {
        "cpu": {"kind": "AVX2", "describe": "AMD EPYC (torch capability AVX2)"},
        "rows": 64,
        "ranges": 8,
        "runs": [job, run],
        "equal": {
            "row_files": 8,
            "rows_equal": True,
            "shards": 8,
            "token_ids_equal": True,
            "states_bit_identical": True,
            "states_max_abs_diff": 0.0,
        },
    }


LOG = """[Sun Dec  6 08:12:00 2026]
rule regenerate:
    jobid: 5
[Sun Dec  6 08:12:00 2026]
rule regenerate:
    jobid: 3
[Sun Dec  6 08:12:09 2026]
Finished jobid: 3 (Rule: regenerate)
[Sun Dec  6 08:12:09 2026]
rule tokenize:
    jobid: 8
[Sun Dec  6 08:12:10 2026]
Finished jobid: 5 (Rule: regenerate)
[Sun Dec  6 08:12:11 2026]
Finished jobid: 8 (Rule: tokenize)
[Sun Dec  6 08:12:11 2026]
rule capture:
    jobid: 2
[Sun Dec  6 08:12:20 2026]
Finished jobid: 2 (Rule: capture)
"""


def test_stage_order_follows_the_newest_log_in_start_order(tmp_path: Path):
    logs = tmp_path / ".snakemake" / "log"
    logs.mkdir(parents=True)
    (logs / "2026-12-06T080950.019236.snakemake.log").write_text(LOG.replace("capture", "x"))
    (logs / "2026-12-06T081158.768580.snakemake.log").write_text(LOG)
    assert bss.stage_order(tmp_path) == "RRC"


def test_render_tables_both_modes_per_stage_and_states_the_checks():
    md = bss.render(record())
    assert md.startswith("# One SGLang server per stage against one per range job (AVX2)")
    assert "shared with other work" in md and "64 bundled prompt rows in 8 row ranges" in md
    assert "| job | regenerate | 8 | 8 | 40, 40, 40, 40, 40, 40, 40, 40 | 400 | 210 | 900 |" in md
    assert "| run | capture | 8 | 1 | 36 | 60 | 45 | 300 | 2.0-2.2 |" in md
    assert "- capture: 8 launches (280 s of start-up) with one server per job, 1 (36 s)" in md
    assert "(saved 600 s)" in md and "aux and final states bit-identical" in md
    assert "left 30 s after each run: job 0 / 0, run 0 / 0." in md
    assert "(R regenerate, C capture): job RRCRCC; run RRRCCC." in md


def test_render_names_the_largest_difference_when_states_differ():
    rec = record()
    rec["equal"].update(states_bit_identical=False, states_max_abs_diff=3.1e-6)
    assert "not bit-identical, largest difference 3.10e-06" in bss.render(rec)
