"""Segment mode (capture.keep false) on the tiny target: shards of at most two segments on disk,
jobs killed mid-capture and mid-training, the next plain runs capturing again only what was in
flight and resuming training, and the final draft bit-identical to offline training with the
same train.segment_rows (the `hf` capture is deterministic on a CPU)."""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from wf import ROOT, SNAKEMAKE, planned_jobs, snakemake, tiny_config, write_config

sys.path.insert(0, str(ROOT / "benchmarks"))
from bench_segments import DiskPeak, draft_tensors, losses, same_tensors  # noqa: E402

# about 12 snakemake jobs of a fresh process each, three reruns and an offline run: 2.5-3
# minutes on 2 idle cores (CI's slow workflows step)
pytestmark = [pytest.mark.slow, pytest.mark.workflow]
# seconds to wait for a job to kill, and for one snakemake run: loaded shared cores run these
# jobs 10x slower than idle ones
PATIENCE = 3600


def config(target: Path, keep: bool) -> dict:
    """48 training rows in 3 ranges of 16 = 3 segments, 2 epochs: 6 captures in segment mode.
    A checkpoint after every step (an execution key: no result changes) gives the kill a
    mid-segment checkpoint to resume from."""
    return tiny_config(
        target,
        data={"sources": [{"format": "bundled", "max_rows": 56}], "heldout_rows": 8},
        capture={"dtype": "float32", "batch_tokens": 1024, "keep": keep},
        train={"epochs": 2, "segment_rows": 16, "precision": "fp32", "checkpoint_every": 1},
    )


def start(work: Path) -> subprocess.Popen:
    cmd = [*SNAKEMAKE, "-s", str(ROOT / "Snakefile"), "--directory", str(work)]
    cmd += ["--configfile", str(work / "config.yaml"), "--cores", "2", "results/draft"]
    with open(work / "snakemake.out", "w") as out:  # a file: a full pipe would block snakemake
        return subprocess.Popen(cmd, cwd=work, stdout=out, stderr=subprocess.STDOUT)


def command(cmd: list[str]) -> str | None:
    """The draftsmith command a process runs (`python -m draftsmith <command> ...`), or None."""
    for i, word in enumerate(cmd[:-2]):
        if word == "-m" and cmd[i + 1] == "draftsmith":
            return cmd[i + 2]
    return None


def job(work: Path, module: str, *words: str) -> psutil.Process | None:
    """The running `python -m draftsmith <command>` job of this project with all `words`."""
    for p in psutil.process_iter(["cmdline", "cwd"]):
        cmd = p.info["cmdline"] or []
        if command(cmd) == module and p.info["cwd"] == str(work):
            if all(any(w in c for c in cmd) for w in words):
                return p
    return None


def arg(p: psutil.Process, name: str) -> str:
    cmd = p.cmdline()
    return cmd[cmd.index(name) + 1]


def kill_a_capture(work: Path, proc: subprocess.Popen) -> str:
    """SIGKILL the first capture job of epoch 1 seen running, held (SIGSTOP) and checked to have
    written no manifest yet, so the kill lands mid-job however fast the machine; its range."""
    deadline = time.monotonic() + PATIENCE
    while time.monotonic() < deadline and proc.poll() is None:
        p = job(work, "segment-capture", "epoch001/")
        if p is None:
            time.sleep(0.02)
            continue
        try:
            p.suspend()
            out = work / arg(p, "--out")
            if out.with_suffix(".json").exists():
                p.resume()  # its work is done: too late for this one, try the next
                continue
            p.kill()
        except psutil.NoSuchProcess:
            continue
        return out.stem
    pytest.fail(f"no capture of epoch 1 seen running:\n{ended(proc)[-3000:]}")


def segment_checkpoints(work: Path, segment: str) -> list[int]:
    found = []
    for meta in (work / "state" / "train").glob("*/step-*/meta.json"):
        m = json.loads(meta.read_text())
        if m.get("segment") == segment:
            found.append(m["step"])
    return found


def kill_training_mid_segment(work: Path, proc: subprocess.Popen) -> tuple[str, int]:
    """Let a segment's training run in 50 ms slices (SIGSTOP/SIGCONT) until it has written a
    checkpoint of its own but not its segment's output, then SIGKILL it; (segment, step)."""
    deadline = time.monotonic() + PATIENCE
    while time.monotonic() < deadline and proc.poll() is None:
        p = job(work, "segment-train", "--segment")
        if p is None:
            time.sleep(0.02)
            continue
        segment, out = arg(p, "--segment"), work / arg(p, "--out")
        try:
            p.suspend()
            while True:
                steps = segment_checkpoints(work, segment)
                if steps and not out.exists():
                    p.kill()
                    return segment, max(steps)
                p.resume()
                time.sleep(0.05)
                p.suspend()
        except psutil.NoSuchProcess:
            continue  # it finished its segment: try the next
    pytest.fail(f"no segment training caught mid-segment:\n{ended(proc)[-3000:]}")


def ended(proc: subprocess.Popen) -> str:
    """Stop snakemake (SIGINT: it stops its jobs) and return its output."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
    proc.wait(timeout=120)
    return Path(proc.args[proc.args.index("--directory") + 1], "snakemake.out").read_text()


def failed(proc: subprocess.Popen) -> str:
    proc.wait(timeout=PATIENCE)
    out = Path(proc.args[proc.args.index("--directory") + 1], "snakemake.out").read_text()
    assert proc.returncode != 0, out[-3000:]
    return out


def test_segments_bounded_disk_exact_restart_and_the_offline_draft(tmp_path, tiny_target):
    seg, off = tmp_path / "segments", tmp_path / "offline"
    write_config(seg, config(tiny_target, keep=False))
    targets = ("results/vocab/vocab.safetensors", "results/hidden/plan.json")
    snakemake(seg, "--cores", "2", *targets, timeout=PATIENCE)
    shutil.copytree(seg, off, symlinks=True)
    write_config(off, config(tiny_target, keep=True))
    plan = json.loads((seg / "results" / "hidden" / "plan.json").read_text())["segments"]
    assert plan["segments"] == 3 and plan["peak_bytes"] < plan["offline_bytes"]

    with DiskPeak(seg / "results" / "segments", "epoch*/*.safetensors*") as disk:
        proc = start(seg)
        killed_range = kill_a_capture(seg, proc)
        failed(proc)
        kept = {
            p: p.stat().st_mtime_ns for p in (seg / "results" / "segments").glob("epoch*/*.json")
        }
        proc = start(seg)  # the next plain run: captures the killed range again
        segment, saved = kill_training_mid_segment(seg, proc)
        failed(proc)
        snakemake(seg, "--cores", "2", "results/draft", timeout=PATIENCE)  # the next one ends
    # only what was in flight was captured again: every manifest finished before is untouched
    assert all(p.stat().st_mtime_ns == t for p, t in kept.items())
    manifest = json.loads((seg / f"results/segments/epoch001/{killed_range}.json").read_text())
    assert manifest["recapture"]["bit_identical"] is True, manifest["recapture"]
    for path in (seg / "results" / "segments").glob("epoch*/*.json"):
        m = json.loads(path.read_text())
        assert set(m["tensor_sha256"]) >= {"input_ids", "loss_mask"}
        first = path.parent.name == "epoch000"
        assert (m["recapture"] is None) if first else m["recapture"]["bit_identical"], path
    log = (seg / "logs" / "segments" / "train" / f"{segment}.log").read_text()
    resumed = [ln for ln in log.splitlines() if "resuming" in ln]
    assert resumed and int(resumed[0].split(" at step ")[1].split()[0]) == saved, log[-2000:]
    # disk: at most two segments' shards at once (one range each here), none left at the end
    assert disk.peak_files <= 2 and 0 < disk.peak_bytes <= plan["peak_bytes"], vars(disk)
    assert not list((seg / "results" / "segments").glob("epoch*/*.safetensors*"))
    assert len(list((seg / "results" / "segments" / "ckpt").iterdir())) == 6
    assert planned_jobs(seg, "results/draft") == {}, "deleted shards must rerun nothing"

    snakemake(off, "--cores", "2", "results/draft", timeout=PATIENCE)
    assert same_tensors(draft_tensors(seg), draft_tensors(off))
    assert losses(seg) == losses(off)
