"""Ctrl-C and SIGTERM of a running `snakemake --cores 2`: every job ends within STOP_BOUND
seconds, nothing half-written is kept, and the next plain run resumes training from its last
checkpoint and ends with exactly the curve of an uninterrupted run (tiny target, fp32).

The signal is aimed at a state that is mid-run on any machine, however fast or loaded: the
training job runs in short slices (SIGSTOP/SIGCONT) until its first checkpoint exists, and is
sent the signal while it is held there, with most of its steps still to come (checked before the
signal); it is let go right after. A race with the job's speed cannot make the test pass or fail."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import time
from pathlib import Path

import psutil
import pytest
from wf import ROOT, SNAKEMAKE, snakemake, tiny_config, write_config

pytestmark = [pytest.mark.slow, pytest.mark.workflow]

STOP_BOUND = 10.0  # seconds from the signal to the last process of the run gone
TRAINED = ("results/draft", "results/train/metrics.jsonl")
# 40 epochs of 8 steps; a checkpoint every 4 steps (an execution key: no result changes), so the
# first one leaves 316 of 320 steps to come
TRAIN = {"epochs": 40, "checkpoint_every": 4, "checkpoint_seconds": 0, "precision": "fp32"}
SLICE = 0.02  # seconds the held training job runs between looks


def start(workdir: Path) -> subprocess.Popen:
    """snakemake in a process group of its own, as a terminal's foreground job would be."""
    cmd = [*SNAKEMAKE, "-s", str(ROOT / "Snakefile"), "--directory", str(workdir)]
    cmd += ["--configfile", str(workdir / "config.yaml"), "--cores", "2", *TRAINED]
    return subprocess.Popen(
        cmd,
        cwd=workdir,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )


def group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


def training_job(workdir: Path) -> psutil.Process | None:
    """The running `python -m draftsmith train` job of this project (it execs the trainer)."""
    for p in psutil.process_iter(["cmdline", "cwd"]):
        cmd = p.info["cmdline"] or []
        if p.info["cwd"] == str(workdir) and any(
            cmd[i : i + 3] == ["-m", "draftsmith", "train"] for i in range(len(cmd) - 2)
        ):
            return p
    return None


def checkpoints(workdir: Path) -> list[int]:
    found = (workdir / "state" / "train").glob("*/step-*/meta.json")
    return sorted(json.loads(m.read_text())["step"] for m in found)


def total_steps(workdir: Path) -> int | None:
    """The step count the training job logged at its start (None before it did)."""
    log = workdir / "logs" / "train.log"
    text = log.read_text() if log.exists() else ""
    found = re.findall(r" rows, (\d+) steps, pack length", text)
    return int(found[0]) if found else None


def hold_at_first_checkpoint(workdir: Path, proc: subprocess.Popen) -> psutil.Process:
    """Run the training job in SLICE-second slices until its first checkpoint exists, and
    return it suspended there (a provably mid-run state); the caller resumes it."""
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"snakemake ended before a checkpoint:\n{proc.stdout.read()[-3000:]}")
        p = training_job(workdir)
        if p is None:
            time.sleep(0.02)
            continue
        try:
            p.suspend()
            while not checkpoints(workdir):
                p.resume()
                time.sleep(SLICE)
                p.suspend()
        except psutil.NoSuchProcess:
            pytest.fail(f"training ended before a checkpoint:\n{proc.stdout.read()[-3000:]}")
        done, total = checkpoints(workdir)[-1], total_steps(workdir)
        assert total and done <= total // 4, f"not mid-run: checkpoint {done} of {total} steps"
        assert not (workdir / "results" / "draft").exists()
        return p
    pytest.fail("no training checkpoint within the timeout")


def stop(proc: subprocess.Popen, held: psutil.Process, send) -> float:
    """Send the signal while the training job is held, let the job go, and return seconds
    until snakemake and every process of its group are gone (the jobs are in snakemake's
    group: Snakemake starts them without a new session)."""
    t0 = time.monotonic()
    send()
    time.sleep(0.2)  # snakemake's handler forwards SIGTERM to the (held) job meanwhile
    with contextlib.suppress(psutil.NoSuchProcess):
        held.resume()
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        pytest.fail("snakemake still running 60 s after the signal")
    while group_alive(proc.pid) and time.monotonic() - t0 < 60:
        time.sleep(0.05)
    return time.monotonic() - t0


def metrics(path: Path) -> list[tuple]:
    rows = [json.loads(ln) for ln in path.read_text().splitlines() if ln.strip()]
    return [(r["step"], r["loss"], r["acc_per_pos"]) for r in rows]


@pytest.fixture(scope="module")
def captured_once(tmp_path_factory, tiny_target: Path) -> Path:
    """A tiny project with everything up to the shards built (about 100 s: built once)."""
    work = tmp_path_factory.mktemp("stop") / "run"
    write_config(work, tiny_config(tiny_target, train=TRAIN))
    snakemake(work, "--cores", "2", "results/vocab/vocab.safetensors", "--", "hidden")
    return work


@pytest.fixture()
def captured(captured_once: Path, tmp_path: Path) -> Path:
    """A copy of that project for one test (copytree keeps the files' times: nothing stale)."""
    work = tmp_path / "run"
    shutil.copytree(captured_once, work, symlinks=True)
    return work


def test_ctrl_c_stops_within_the_bound_and_resumes_exactly(captured: Path, tmp_path: Path):
    reference = tmp_path / "reference"
    shutil.copytree(captured, reference, symlinks=True)
    proc = start(captured)
    held = hold_at_first_checkpoint(captured, proc)
    saved = checkpoints(captured)[-1]
    elapsed = stop(proc, held, lambda: os.killpg(proc.pid, signal.SIGINT))  # what Ctrl-C sends
    out = proc.stdout.read()
    assert elapsed <= STOP_BOUND, f"stopped after {elapsed:.1f} s\n{out[-3000:]}"
    assert proc.returncode != 0
    assert not (captured / "results" / "draft").exists(), "a stopped run left a draft"
    log = (captured / "logs" / "train.log").read_text()
    # Ctrl-C reaches the job twice: the terminal's SIGINT to the whole group, and the SIGTERM
    # that snakemake's handler forwards at the same moment. Which one the job's watcher reads
    # first is up to the scheduler (a busy machine showed both), and either stops it the same way.
    stopped = [ln for ln in log.splitlines() if "stopping at once (" in ln]
    assert len(stopped) == 1, log
    assert "(SIGINT)" in stopped[0] or "(SIGTERM)" in stopped[0], log
    assert "a rerun resumes from checkpoint" in log, log
    assert "draftsmith: SIGINT: sent SIGTERM to" in out, out[-3000:]  # snakemake saw the Ctrl-C

    snakemake(captured, "--cores", "2", *TRAINED)  # the next plain run
    log = (captured / "logs" / "train.log").read_text()
    resumed = [ln for ln in log.splitlines() if "resuming" in ln]
    assert resumed and int(resumed[0].split(" at step ")[1].split()[0]) >= saved, log[-2000:]

    snakemake(reference, "--cores", "2", *TRAINED)  # the same project, never stopped
    got = metrics(captured / "results" / "train" / "metrics.jsonl")
    want = metrics(reference / "results" / "train" / "metrics.jsonl")
    assert got == want
    a = (captured / "results" / "draft" / "model.safetensors").read_bytes()
    assert a == (reference / "results" / "draft" / "model.safetensors").read_bytes()


def test_sigterm_to_snakemake_alone_stops_its_jobs(captured: Path):
    """Snakemake's own SIGTERM handling waits for running jobs; the workflow's handler
    (draftsmith.runtime.stopping.forward_stop_signals) ends them first."""
    proc = start(captured)
    held = hold_at_first_checkpoint(captured, proc)
    elapsed = stop(proc, held, lambda: proc.send_signal(signal.SIGTERM))
    out = proc.stdout.read()
    assert elapsed <= STOP_BOUND, f"stopped after {elapsed:.1f} s\n{out[-3000:]}"
    assert "sent SIGTERM to" in out, out[-3000:]
    assert "stopping at once (SIGTERM)" in (captured / "logs" / "train.log").read_text()
    assert not (captured / "results" / "draft").exists()
    # no stale lock, nothing half-written taken: the next plain run finishes
    snakemake(captured, "--cores", "2", *TRAINED)
    assert (captured / "results" / "draft" / "model.safetensors").is_file()
