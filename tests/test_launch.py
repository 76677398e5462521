"""draftsmith.train.launch: how the training processes are started, in and out of SLURM."""

from __future__ import annotations

import pytest

from draftsmith.train.launch import LaunchError, command

TRAIN = ["--cfg", "{}", "--out", "results/draft"]


def test_one_process_runs_train_directly():
    assert command(1, 1, 4, TRAIN, {}, python="py") == [
        "py",
        "-m",
        "draftsmith",
        "train-rank",
        *TRAIN,
    ]
    # inside SLURM too: no srun step for a single process
    assert command(1, 1, 4, TRAIN, {"SLURM_JOB_ID": "7"}, python="py")[0] == "py"


def test_one_node_outside_slurm_is_standalone_torchrun():
    cmd = command(4, 1, 8, TRAIN, {}, python="py")
    assert cmd[:5] == ["py", "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=4"]
    assert cmd[5:] == ["-m", "draftsmith", "train-rank", *TRAIN]


def test_several_nodes_need_a_slurm_job():
    with pytest.raises(LaunchError, match="--nnodes 2 needs a SLURM job spanning 2 nodes"):
        command(8, 2, 16, TRAIN, {}, python="py")


def test_slurm_job_one_srun_task_per_node_and_a_rendezvous_on_the_first():
    env = {"SLURM_JOB_ID": "12345"}
    cmd = command(8, 2, 16, TRAIN, env, python="py", nodes=["gpu-a7", "gpu-b2"])
    srun, torchrun = cmd[: cmd.index("py")], cmd[cmd.index("py") :]
    assert srun[0] == "srun" and "--overlap" in srun and "--jobid=12345" in srun
    assert {"--nodes=2", "--ntasks=2", "--ntasks-per-node=1", "--cpus-per-task=16"} <= set(srun)
    assert torchrun[:3] == ["py", "-m", "torch.distributed.run"]
    assert "--nnodes=2" in torchrun and "--nproc-per-node=8" in torchrun
    assert "--rdzv-backend=c10d" in torchrun and "--rdzv-id=12345" in torchrun
    assert "--rdzv-endpoint=gpu-a7:31845" in torchrun  # 29500 + job id % 10000
    assert torchrun[-len(TRAIN) - 3 :] == ["-m", "draftsmith", "train-rank", *TRAIN]


def test_node_count_must_match_the_allocation():
    with pytest.raises(
        LaunchError, match=r"has 1 node\(s\) \(n1\) but the launch asks for --nnodes 2"
    ):
        command(8, 2, 16, TRAIN, {"SLURM_JOB_ID": "3"}, python="py", nodes=["n1"])
