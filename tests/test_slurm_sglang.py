"""Past one node, on the real one-node SLURM of scripts/slurm_up.sh: the range jobs of an SGLang
stage go to SLURM in groups (profiles/local-slurm: 2 range jobs per submission), and within a
group each range job still starts a server of its own.

Why: the SLURM executor's jobstep plugin runs every job of an allocation, each job of a group
job too, as a job step of its own (`srun`, under a Snakemake process of its own), and SLURM ends
every process a step started when the step ends: the server a range job's host launched gets
SIGTERM as that job finishes, so no server outlives its job (a host that followed the
allocation's Snakemake instead of the job's was tried: SLURM stopped its server at each step's
end, benchmarks/results/slurm_group_servers.md). One server per stage holds within a
Snakemake process (a local run: tests/test_workflow_kimi_sglang.py), not across SLURM job steps
(docs/scale.md). This test keeps that statement true: should a later executor run a group's jobs
in one step, it fails and the docs must change.

4 row ranges of the tiny random target, regenerated through SGLang's CPU server (role
sglang-cpu): two group submissions, four server launches, one per range job.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from roles import role_python
from slurmtools import slurm_python
from test_sglang_capture import CPU_SERVER_ARGS
from test_slurm import next_job_id, run, slurm, squeue_since  # noqa: F401 (the fixture)
from wf import tiny_config, write_config

pytestmark = [
    pytest.mark.slow,
    pytest.mark.slurm,
    pytest.mark.sglang,
    pytest.mark.workflow,
    pytest.mark.extended(
        reason="proves: on SLURM each range job of a group submission starts its own server "
        "(why docs/scale.md says one server per job there); no CI-sized version: four SGLang "
        "server starts under SLURM, 6-10 minutes on 2 cores; CI covers the rest: "
        "test_slurm.py (the grouped submissions), test_workflow_kimi_sglang.py (one server per "
        "stage in a local run)"
    ),
]


def test_each_range_job_of_a_group_submission_starts_its_own_server(
    slurm,  # noqa: F811
    tmp_path: Path,
    tiny_target: Path,
):
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
    # every range job started the server it used: none outlived the step of the job before
    assert all(r["server_started_by_this_job"] for r in reports), reports
    assert len({r["server_host_pid"] for r in reports}) == 4, reports
