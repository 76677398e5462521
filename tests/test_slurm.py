"""The whole workflow on a real one-node SLURM through the executor plugin (profiles/local-slurm).

Needs the SLURM of scripts/slurm_up.sh: .ci/run starts it; this module starts (and stops) one
itself when none answers and DRAFTSMITH_REQUIRE_ENGINES=1 or DRAFTSMITH_SLURM_UP=1 (root,
Debian: apt-get installs slurm-wlm and munge), else it skips. The interpreter that runs
snakemake is DRAFTSMITH_PYTHON_SLURM (envs/slurm.txt); the jobs run the cpu role with this
test's interpreter.

On the tiny random target the benchmark's sanity gate fails (tau exactly 1.0: a random target's
draft is never accepted), deterministically: that is the failing job whose retry is checked.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
from slurmtools import by_rule, dry_run, require, slurm_python
from wf import ROOT, tiny_config, write_config

pytestmark = [pytest.mark.slow, pytest.mark.slurm, pytest.mark.workflow]

PROFILE = ("--profile", str(ROOT / "profiles" / "local-slurm"))
SUBMITTED = {
    "target_model", "regenerate_ranges_regenerate", "tokenize", "capture_ranges_capture", "vocab",
    "train", "bench",
}  # fmt: skip
LOCAL = {"validate_env", "env_stamp", "data_report", "hidden_plan", "all"}


def slurm_answers() -> bool:
    if shutil.which("sinfo") is None:
        return False
    proc = subprocess.run(["sinfo", "-h", "-o", "%P"], capture_output=True, text=True)
    return proc.returncode == 0 and "cpu" in proc.stdout


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    if slurm_answers():
        yield None
        return
    if "1" not in (
        os.environ.get("DRAFTSMITH_REQUIRE_ENGINES"),
        os.environ.get("DRAFTSMITH_SLURM_UP"),
    ):
        pytest.skip("no SLURM answers (scripts/slurm_up.sh; or DRAFTSMITH_SLURM_UP=1 to start one)")
    state = tmp_path_factory.mktemp("slurm")
    up = subprocess.run(
        [str(ROOT / "scripts" / "slurm_up.sh"), str(state)], capture_output=True, text=True
    )
    try:
        if up.returncode != 0:
            require(f"scripts/slurm_up.sh failed:\n{up.stdout[-2000:]}\n{up.stderr[-2000:]}")
        yield state
    finally:
        subprocess.run([str(ROOT / "scripts" / "slurm_down.sh"), str(state)], check=False)


def squeue_since(first_id: int) -> list[dict]:
    """SLURM's record of this run's jobs: id, state, partition, node and rule (the plugin's
    job comment rule_<name>[_wildcards_<w>])."""
    out = subprocess.run(
        ["squeue", "--states=all", "-h", "-o", "%i|%T|%P|%N|%k"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    jobs = []
    for line in out.splitlines():
        jid, state, partition, node, comment = line.split("|", 4)
        if int(jid) < first_id or not comment.startswith("rule_"):
            continue
        rule, _, wildcards = comment[len("rule_") :].partition("_wildcards_")
        jobs.append(
            {"id": int(jid), "state": state, "partition": partition, "node": node,
             "rule": rule, "wildcards": wildcards}
        )  # fmt: skip
    return jobs


def next_job_id() -> int:
    out = subprocess.run(
        ["squeue", "--states=all", "-h", "-o", "%i"], capture_output=True, text=True, check=True
    ).stdout.split()
    return max((int(i) for i in out if i.isdigit()), default=0) + 1


def run(workdir: Path, python: str, *args: str) -> subprocess.CompletedProcess:
    cmd = [python, "-m", "snakemake", "-s", str(ROOT / "Snakefile"), "--directory", str(workdir)]
    cmd += ["--configfile", str(workdir / "config.yaml"), *PROFILE, *args]
    return subprocess.run(cmd, capture_output=True, text=True, cwd=workdir, timeout=900)


def test_workflow_on_slurm_records_reruns_and_retries(slurm, tmp_path: Path, tiny_target: Path):
    python = slurm_python()
    cfg = tiny_config(tiny_target, train={"nproc": 2})
    cfg["envs"] = {"cpu": {"python": sys.executable, "gpus": 0}}
    write_config(tmp_path, cfg)
    node = socket.gethostname().split(".")[0]

    # 1. the whole workflow: every stage as a SLURM job, bench failing (sanity gate) twice
    first = next_job_id()
    proc = run(tmp_path, python)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out[-3000:]  # bench's gate: see the module doc
    bench_log = tmp_path / "logs/bench/bench.log"
    assert bench_log.is_file(), out[-6000:]  # an earlier job failed: its error is in out
    assert "sanity gate failed" in bench_log.read_text()
    for pattern, n in (
        ("results/data/rows_*.jsonl", 2),
        ("results/tokens/rows_*.safetensors", 2),
        ("results/hidden/rows_*.safetensors", 2),
        ("results/vocab/vocab.safetensors", 1),
        ("results/draft/model.safetensors", 1),
        ("results/train/metrics.jsonl", 1),
    ):
        assert len(list(tmp_path.glob(pattern))) == n, pattern
    record = squeue_since(first)
    counts = Counter(j["rule"] for j in record)
    # the profile's groups: the 2 regenerate and the 2 capture jobs each one submission
    assert counts == {
        "target_model": 1, "regenerate_ranges_regenerate": 1, "tokenize": 2,
        "capture_ranges_capture": 1,
        "vocab": 1, "train": 1, "bench": 2,
    }, record  # fmt: skip
    assert not LOCAL & set(counts)  # local rules ran in the snakemake process, not in SLURM
    assert {(j["partition"], j["node"]) for j in record} == {("cpu", node)}
    states = {(j["rule"], j["state"]) for j in record}
    assert states == {(r, "COMPLETED") for r in SUBMITTED - {"bench"}} | {("bench", "FAILED")}
    # retries: 1 in the profile: the failed bench job was submitted a second time, then the run stopped
    bench_ids = [j["id"] for j in record if j["rule"] == "bench"]
    for jid in bench_ids:
        assert f"SLURM-job '{jid}' failed, SLURM status is: 'FAILED'" in out
    # training: 2 processes through one srun step and a c10d rendezvous inside the job
    train_log = (tmp_path / "logs/train.log").read_text()
    assert "--rdzv-backend=c10d" in train_log and "2 process(es)" in train_log

    # 2. one shard gone: asking for every shard and the draft plans only its capture job and
    # what depends on it (the benchmark would fail again as above, so the draft is the target)
    shards = sorted(
        p.relative_to(tmp_path) for p in tmp_path.glob("results/hidden/rows_*.safetensors")
    )
    shard = "rows_000016-000032"
    (tmp_path / f"results/hidden/{shard}.safetensors").unlink()
    targets = (*map(str, shards), "results/draft")
    planned = by_rule(dry_run(tmp_path, *PROFILE, *targets, python=python))
    assert {r: len(js) for r, js in planned.items()} == {"capture": 1, "train": 1}
    assert planned["capture"][0].wildcards == f"rows={shard}"
    # ... and only those are resubmitted
    first = next_job_id()
    proc = run(tmp_path, python, *targets)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    record = squeue_since(first)
    assert sorted((j["rule"], j["wildcards"], j["state"]) for j in record) == [
        ("capture_ranges_capture", "", "COMPLETED"),  # a group of the one range
        ("train", "", "COMPLETED"),
    ], record
    assert (tmp_path / f"results/hidden/{shard}.safetensors").is_file()
