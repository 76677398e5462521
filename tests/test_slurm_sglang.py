"""Past one node, on the real one-node SLURM of scripts/slurm_up.sh: the range jobs of an SGLang
stage go to SLURM in groups (profiles/local-slurm: 2 range jobs per submission), and the range
jobs of one group submission share one server.

Why it needs care: the SLURM executor's jobstep plugin runs every job of an allocation, each job
of a group job too, as a job step of its own (`srun`, under a Snakemake process of its own), and
SLURM ends every process a step started when the step ends. So inside an allocation the first
range job starts the server's host as an overlapping job step of its own, keyed by the
allocation (draftsmith.runtime.slurmstep); the next range job of the group leases it, and SLURM
ends it with the allocation (benchmarks/results/slurm_group_servers.md, docs/scale.md).

4 row ranges of the tiny random target, regenerated through SGLang's CPU server (role
sglang-cpu): two group submissions, two server launches, one per group, each in a step of its
group's allocation, none left once the run is done.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest
from roles import role_python
from slurmtools import slurm_python
from test_sglang_capture import CPU_SERVER_ARGS
from test_slurm import next_job_id, run, slurm, squeue_since  # noqa: F401 (the fixture)
from wf import tiny_config, write_config

from draftsmith.runtime.serverhosts import pid_alive

pytestmark = [
    pytest.mark.slow,
    pytest.mark.slurm,
    pytest.mark.sglang,
    pytest.mark.workflow,
    pytest.mark.extended(
        reason="proves: on SLURM the range jobs of a group submission share one server, a job "
        "step of the group's allocation; no CI-sized version: two SGLang server starts under "
        "SLURM, 4-10 minutes on 2 cores (249 s measured); CI covers the rest: "
        "test_slurm.py (the grouped submissions), test_workflow_kimi_sglang.py (one server per "
        "stage in a local run)"
    ),
]


def test_the_range_jobs_of_a_group_submission_share_one_server(
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
    # per group job: one server, started by its first range job, leased by the second
    started = [r for r in reports if r["server_started_by_this_job"]]
    assert len(started) == 2, reports
    hosts = [r["server_host_pid"] for r in reports]
    assert sorted(hosts.count(h) for h in set(hosts)) == [2, 2], reports
    assert all(r["server_launches"] == 1 for r in reports), reports
    # each host was a job step of its group's allocation, its directory keyed by that job
    dirs = sorted(tmp_path.glob("state/servers/*/host.json"))
    assert {d.parent.name.rsplit("-", 1)[1] for d in dirs} == {f"slurm{j['id']}" for j in groups}
    for d in dirs:  # gone with the allocation: SLURM ended the step when the batch script did
        deadline = time.monotonic() + 60
        while json.loads(d.read_text())["state"] != "stopped" and time.monotonic() < deadline:
            time.sleep(1)
        info = json.loads(d.read_text())
        assert info["generation"] == 1 and info["state"] == "stopped", info
        assert not pid_alive(info["host_pid"], str(d.parent)), info
    logs = "\n".join(f.read_text() for f in tmp_path.glob("logs/regenerate/*.log"))
    assert logs.count("started by this job") == 2 and logs.count("already up") == 2, logs[-4000:]
