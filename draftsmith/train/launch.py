"""Start the training job's processes: one, one node (torchrun), or every node of a SLURM job.

    python -m draftsmith train --nproc-per-node P --nnodes N [--cpus-per-node T] -- <train args>

- P x N == 1: draftsmith.train.loop in this process's interpreter, nothing else.
- outside SLURM: `torchrun --standalone` with P processes (N must be 1).
- inside a SLURM job (SLURM_JOB_ID set): one `srun` step with one task per node of the
  allocation; each task runs torchrun with P processes and joins a c10d rendezvous on the
  job's first node (port derived from the job id, rendezvous id = the job id). The node count
  is the job's own (resource `nodes`), so the launch always matches what SLURM granted.

The process replaces itself (exec) with the command, so signals and the exit status are the
command's own.
"""

from __future__ import annotations

import argparse
import os
import shlex
import subprocess
import sys

from draftsmith.runtime.files import command_parser
from draftsmith.runtime.serverhosts import release_gpu_hosts

RDZV_PORT_BASE = 29500


class LaunchError(RuntimeError):
    pass


def slurm_nodes(env: dict[str, str]) -> list[str]:
    """Hostnames of the SLURM job's nodes, in SLURM's order (the first hosts the rendezvous)."""
    nodelist = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
    if not nodelist:
        # the jobstep executor drops most SLURM_* variables: ask the controller
        out = subprocess.run(
            ["scontrol", "show", "job", "-o", env["SLURM_JOB_ID"]],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        fields = dict(f.split("=", 1) for f in out.split() if "=" in f)
        nodelist = fields.get("NodeList", "")
    if not nodelist:
        raise LaunchError(f"SLURM job {env['SLURM_JOB_ID']}: no node list")
    hosts = subprocess.run(
        ["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True, check=True
    ).stdout.split()
    return hosts


def command(
    nproc: int,
    nnodes: int,
    cpus_per_node: int,
    train_args: list[str],
    env: dict[str, str],
    python: str = sys.executable,
    nodes: list[str] | None = None,
) -> list[str]:
    """The argv that starts nproc x nnodes training processes (see the module doc)."""
    if nproc < 1 or nnodes < 1:
        raise LaunchError(f"nproc-per-node {nproc} and nnodes {nnodes} must be >= 1")
    train = ["-m", "draftsmith", "train-rank", *train_args]
    job = env.get("SLURM_JOB_ID")
    if nproc * nnodes == 1:
        return [python, *train]
    if not job:
        if nnodes > 1:
            raise LaunchError(
                f"--nnodes {nnodes} needs a SLURM job spanning {nnodes} nodes "
                "(run with --profile profiles/slurm and resource nodes for rule train)"
            )
        return [
            python,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc-per-node={nproc}",
            *train,
        ]
    hosts = nodes if nodes is not None else slurm_nodes(env)
    if len(hosts) != nnodes:
        raise LaunchError(
            f"SLURM job {job} has {len(hosts)} node(s) ({', '.join(hosts)}) but the launch "
            f"asks for --nnodes {nnodes}"
        )
    port = RDZV_PORT_BASE + int(job) % 10000
    return [
        "srun",
        "--overlap",
        f"--jobid={job}",
        f"--nodes={nnodes}",
        f"--ntasks={nnodes}",
        "--ntasks-per-node=1",
        f"--cpus-per-task={cpus_per_node}",
        "--cpu-bind=none",
        "--kill-on-bad-exit=1",
        python,
        "-m",
        "torch.distributed.run",
        f"--nnodes={nnodes}",
        f"--nproc-per-node={nproc}",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint={hosts[0]}:{port}",
        f"--rdzv-id={job}",
        *train,
    ]


def main(argv: list[str] | None = None) -> None:
    p = command_parser("train", __doc__)
    p.add_argument("--nproc-per-node", type=int, required=True)
    p.add_argument("--nnodes", type=int, default=1)
    p.add_argument("--cpus-per-node", type=int, default=1)
    p.add_argument("train_args", nargs=argparse.REMAINDER, help="-- then draftsmith.train.loop's")
    args = p.parse_args(argv)
    rest = args.train_args[1:] if args.train_args[:1] == ["--"] else args.train_args
    try:
        cmd = command(args.nproc_per_node, args.nnodes, args.cpus_per_node, rest, dict(os.environ))
    except LaunchError as e:
        raise SystemExit(f"draftsmith train: {e}") from None
    # every stage that feeds training is done: the run's idle engine servers (regenerate,
    # capture) give back their memory, cores and GPUs before the first step
    for key in release_gpu_hosts(gpus_only=False):
        print(f"draftsmith train: stopped the run's idle server {key}", file=sys.stderr)
    print(f"draftsmith train: {shlex.join(cmd)}", file=sys.stderr, flush=True)
    os.execvp(cmd[0], cmd)
