"""Past one node: on the real one-node SLURM of scripts/slurm_up.sh, the range jobs of an SGLang
stage go to SLURM in groups (profiles/local-slurm: 2 range jobs per submission), and each group
starts one server for its ranges (sglang.shared_server run: the group's jobs run under one
Snakemake process in the allocation, draftsmith.engines.sharedserver).

4 row ranges of the tiny random target, regenerated through SGLang's CPU server (role
sglang-cpu): two group submissions, two server launches, each serving two ranges. .ci/run's
SLURM step runs it once the engine venvs are built (2-5 minutes: two server start-ups).
"""

from __future__ import annotations

import json
import sys
from collections import defaultdict
from pathlib import Path

import pytest
from roles import role_python
from slurmtools import slurm_python
from test_sglang_capture import CPU_SERVER_ARGS
from test_slurm import next_job_id, run, slurm, squeue_since  # noqa: F401 (the fixture)
from wf import tiny_config, write_config

pytestmark = [pytest.mark.slow, pytest.mark.slurm, pytest.mark.sglang, pytest.mark.workflow]


def test_each_group_of_range_jobs_starts_one_server(slurm, tmp_path: Path, tiny_target: Path):  # noqa: F811
    sglang = role_python("sglang-cpu")
    python = slurm_python()
    cfg = tiny_config(
        tiny_target,
        data={
            "sources": [{"format": "bundled", "max_rows": 40}],
            "heldout_rows": 8,
            "rows_per_shard": 8,  # 32 training rows: 4 ranges
            "max_length": 128,
        },
        regenerate={"backend": "sglang", "role": "sglang-cpu", "max_new_tokens": 8,
                    "batch_size": 8, "dtype": "float32"},
        sglang={"extra_args": CPU_SERVER_ARGS},
    )  # fmt: skip
    cfg["envs"] = {"cpu": {"python": sys.executable, "gpus": 0}, "sglang-cpu": {"python": sglang}}
    write_config(tmp_path, cfg)
    first = next_job_id()
    proc = run(tmp_path, python, "data")
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]

    groups = [j for j in squeue_since(first) if j["rule"] == "regenerate_ranges_regenerate"]
    assert len(groups) == 2 and {j["state"] for j in groups} == {"COMPLETED"}, groups
    reports = [
        json.loads(f.read_text()) for f in sorted(tmp_path.glob("results/data/rows_*.report.json"))
    ]
    assert len(reports) == 4
    by_host = defaultdict(list)
    for r in reports:
        assert r["backend"] == "sglang" and r.get("server_host_pid"), r
        by_host[r["server_host_pid"]].append(r)
    # two servers (one per group job), each launched once and serving two ranges
    assert sorted(len(rs) for rs in by_host.values()) == [2, 2], by_host
    for rs in by_host.values():
        assert all(r["server_launches"] == 1 for r in rs), rs
        assert sum(r["server_started_by_this_job"] for r in rs) == 1, rs
