"""A shared server's host as a SLURM job step of its own (draftsmith.engines.sharedserver).

The SLURM executor's jobstep plugin runs every job of an allocation, each job of a group
submission too, as a job step of its own (`srun`, under a Snakemake process of its own), and
SLURM ends the processes a step started when that step ends. A host started by a range job
inside its step would end with that job. So inside an allocation the host runs as a step of
its own,

    srun --overlap --jobid <job> --nodes 1 --ntasks 1 --mem=0 ... python -m draftsmith \
        shared-server host <dir>

started by the first range job that needs it, in a session of its own, and keyed by the
allocation (`slurm<job id>`, with the node in its directory name) instead of the job's
Snakemake process: the next range jobs of the same group submission lease it. `--overlap`
shares the allocation's CPUs, memory (`--mem=0`: the job's memory, none taken from other steps)
and GPUs (`--gres=gpu:<n>` of the allocation's, `--gres=none` on a CPU role) with the range
jobs' steps, so the step never waits for resources and every GPU it holds is one the group's
allocation holds. It ends with the allocation (SLURM ends a job's steps when its batch script
ends; an open step does not hold the allocation), after `sglang.idle_timeout` seconds without a
job, or after segment mode's last capture.

The step lives only while its `srun` client does (SLURM cancels a step whose client is killed).
The client is a child of the range job that started it and outlives that job where SLURM tracks
a step's processes by process tree or process group (ProctrackType proctrack/linuxproc, as in
`scripts/slurm_up.sh`, or proctrack/pgid). With proctrack/cgroup the client sits in the
starting job's cgroup and is killed with it: there (and outside an allocation step, or when
`srun` or `scontrol` is missing) `allocation()` is empty and each job keeps a host of its own
under its Snakemake process, as before.
"""

from __future__ import annotations

import os
import shutil
import subprocess

from draftsmith.runtime.lifeline import ENV as RUN_ENV

PREFIX = "slurm"
PROCTRACK_OK = ("proctrack/linuxproc", "proctrack/pgid")


def proctrack() -> str:
    """SLURM's ProctrackType (`scontrol show config`), or "" when it cannot be read."""
    try:
        out = subprocess.run(
            ["scontrol", "show", "config"], capture_output=True, text=True, timeout=30
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return ""
    for line in out.splitlines():
        key, _, value = line.partition("=")
        if key.strip() == "ProctrackType":
            return value.strip()
    return ""


def allocation(env: dict | None = None) -> str:
    """`slurm<job id>` when this process runs in a job step of a SLURM allocation whose steps
    can start a host step that outlives them (module docstring), else ""."""
    env = os.environ if env is None else env
    job, step = env.get("SLURM_JOB_ID", ""), env.get("SLURM_STEP_ID", "")
    if not (job.isdigit() and step.isdigit()) or shutil.which("srun") is None:
        return ""
    return f"{PREFIX}{job}" if proctrack() in PROCTRACK_OK else ""


def is_allocation(owner) -> bool:
    """Whether a shared server's owner is an allocation (`allocation()`), not a run's pid."""
    return isinstance(owner, str) and owner.startswith(PREFIX)


def without_lifeline(env: dict) -> dict:
    """`env` without the lifeline's variable (draftsmith.runtime.lifeline): for the host and its
    server (whose SGLang imports draftsmith through the CPU overlay), which must follow the
    allocation, not the Snakemake process of the range job that starts them."""
    return {k: v for k, v in env.items() if k != RUN_ENV}


def step_launch(argv: list[str], env: dict, owner: str, *, gpus: int, name: str):
    """(argv, env) that run `argv` as an overlapping step of allocation `owner` on this node,
    in `env` without the lifeline's variable (`without_lifeline`)."""
    cpus = env.get("SLURM_CPUS_ON_NODE", "1")
    srun = [
        "srun",
        "--overlap",
        "--jobid",
        owner[len(PREFIX) :],
        "--nodes",
        "1",
        "--ntasks",
        "1",
        "--nodelist",
        env.get("SLURMD_NODENAME", "") or os.uname().nodename.split(".")[0],
        f"--cpus-per-task={cpus if cpus.isdigit() else 1}",
        "--mem=0",
        f"--gres=gpu:{gpus}" if gpus else "--gres=none",
        "--cpu-bind=none",
        "--input=none",
        f"--job-name={name}",
    ]
    return [*srun, *argv], without_lifeline(env)
