"""A shared server's host as a SLURM job step of the allocation (draftsmith.runtime.slurmstep):
when it applies, the `srun` line it builds, and a lease that starts its host through it (here a
stand-in `srun` that runs the command as is, and a stand-in `scontrol`). The real SLURM:
tests/test_slurm_sglang.py (extended).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from test_sharedserver import cleanup, double, gone, spec

from draftsmith.engines.sharedserver import SharedServer
from draftsmith.runtime import slurmstep

STEP = {"SLURM_JOB_ID": "42", "SLURM_STEP_ID": "0", "SLURM_CPUS_ON_NODE": "2"}


@pytest.fixture
def fake_slurm(tmp_path, monkeypatch):
    """`srun` that records its arguments and runs what follows --job-name=...; `scontrol` that
    reports ProctrackType from $FAKE_PROCTRACK."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "srun").write_text(
        '#!/bin/sh\necho "$@" > "$FAKE_SRUN_ARGS"\n'
        'while [ $# -gt 0 ]; do case "$1" in --job-name=*) shift; break;; esac; shift; done\n'
        'exec "$@"\n'
    )
    (bin_dir / "scontrol").write_text(
        '#!/bin/sh\necho "ProctrackType           = $FAKE_PROCTRACK"\n'
    )
    for f in ("srun", "scontrol"):
        (bin_dir / f).chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("FAKE_SRUN_ARGS", str(tmp_path / "srun.args"))
    monkeypatch.setenv("FAKE_PROCTRACK", "proctrack/linuxproc")
    return tmp_path / "srun.args"


def test_allocation_only_in_a_step_whose_processes_a_new_step_outlives(fake_slurm, monkeypatch):
    assert slurmstep.allocation(STEP) == "slurm42"
    assert slurmstep.allocation({**STEP, "SLURM_STEP_ID": ""}) == ""  # the batch script, salloc
    assert slurmstep.allocation({"SLURM_STEP_ID": "0"}) == ""
    monkeypatch.setenv("FAKE_PROCTRACK", "proctrack/cgroup")  # the srun client dies with the job
    assert slurmstep.allocation(STEP) == ""
    assert slurmstep.is_allocation("slurm42") and not slurmstep.is_allocation(1234)


def test_step_launch_overlaps_and_drops_the_run_lifeline():
    env = {**STEP, "DRAFTSMITH_JOB_PARENT": "99", "SLURMD_NODENAME": "n1", "X": "1"}
    argv, out = slurmstep.step_launch(["python", "-m", "x"], env, "slurm42", gpus=2, name="s")
    assert argv[:4] == ["srun", "--overlap", "--jobid", "42"] and argv[-3:] == ["python", "-m", "x"]
    for flag in ("--mem=0", "--gres=gpu:2", "--cpus-per-task=2", "--input=none", "n1"):
        assert flag in argv
    assert "DRAFTSMITH_JOB_PARENT" not in out and out["X"] == "1"
    argv, _ = slurmstep.step_launch(["p"], STEP, "slurm42", gpus=0, name="s")
    assert "--gres=none" in argv


def test_a_lease_in_an_allocation_starts_its_host_as_a_step(tmp_path, fake_slurm, monkeypatch):
    for k, v in {**STEP, "DRAFTSMITH_JOB_PARENT": "1"}.items():
        monkeypatch.setenv(k, v)
    owner = slurmstep.allocation()
    root = tmp_path / "servers"
    job_spec = spec(tmp_path)
    job_spec.env["DRAFTSMITH_JOB_PARENT"] = "1"  # the job's environment, as a job's spec has
    with SharedServer(job_spec, root, owner=owner, idle_timeout=1, retries=1) as a:
        host = a.info["host_pid"]
        try:
            assert a.started_host and a.dir.name.endswith("-slurm42") and double(a.url, 2) == 4
            assert fake_slurm.read_text().startswith("--overlap --jobid 42")
            # the server follows the allocation, not the starting job's Snakemake process
            assert (
                "DRAFTSMITH_JOB_PARENT"
                not in json.loads((a.dir / "spec.json").read_text())["full_env"]
            )
            with SharedServer(spec(tmp_path), root, owner=owner, idle_timeout=1, retries=1) as b:
                assert not b.started_host and b.info["host_pid"] == host
        except BaseException:
            cleanup(host)
            raise
    assert gone(host, 15)  # idle past sglang.idle_timeout: no allocation held for nothing
    assert Path(a.dir / "host.json").is_file()
