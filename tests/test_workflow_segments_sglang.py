"""Segment mode through the real SGLang capture server (role sglang-cpu) with one server per run
(`sglang.shared_server: run`, draftsmith.engines.sharedserver): 2 segments x 2 epochs = 4 capture jobs
on the tiny target. A run killed with `kill -9` of Snakemake while the server is up leaves no
server process; the next plain run captures what is left from one server launch, every
re-capture bit-identical to the range's first capture, and the server is gone when the run
ends. benchmarks/bench_shared_capture.py measures the start-up time this saves."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import roles
from wf import ROOT, SNAKEMAKE, snakemake, write_config

sys.path.insert(0, str(ROOT / "benchmarks"))
from bench_shared_capture import bench_config, launches, server_pids  # noqa: E402

pytestmark = [
    pytest.mark.slow,
    pytest.mark.workflow,
    pytest.mark.sglang,
    pytest.mark.extended(
        reason="proves: segment mode's one shared SGLang capture server per run survives a "
        "killed run and is reused on resume, the draft built to the end; no CI-sized version: "
        "the kill and resume need a workflow run to the draft around two server start-ups, "
        "about 7 minutes on 2 cores, and no shorter run reaches a resumed segment; "
        "CI covers the rest: test_workflow_segments.py (segment mode with hf), "
        "test_sglang_capture.py (SGLang capture)"
    ),
]
PATIENCE = 3600


def hosts(work: Path) -> list[int]:
    """Live shared-server hosts started in `work`."""
    found = []
    for p in psutil.process_iter(["pid", "cmdline", "cwd", "status"]):
        cmd = p.info["cmdline"] or []
        if "shared-server" in cmd and "draftsmith" in cmd and p.info["cwd"] == str(work):
            if p.info["status"] != psutil.STATUS_ZOMBIE:
                found.append(p.info["pid"])
    return found


def all_gone(work: Path, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not hosts(work) and not server_pids(work):
            return True
        time.sleep(1)
    return False


def host_info(work: Path) -> dict:
    found = list((work / "state" / "servers").glob("*/host.json"))
    return json.loads(found[0].read_text()) if len(found) == 1 else {}


def test_one_server_for_the_run_and_none_left_after_a_kill(tmp_path, tiny_target):
    python = roles.role_python("sglang-cpu")
    work = tmp_path / "run"
    write_config(work, bench_config(tiny_target, python, "run", epochs=2, rows=32))
    prep = ("results/vocab/vocab.safetensors", "results/hidden/plan.json")
    snakemake(work, "--cores", "2", *prep, "results/sglang/patched.json", timeout=PATIENCE)

    cmd = [*SNAKEMAKE, "-s", str(ROOT / "Snakefile"), "--directory", str(work), "--configfile"]
    with open(work / "snakemake.out", "w") as out:
        proc = subprocess.Popen(
            [*cmd, str(work / "config.yaml"), "--cores", "2", "results/draft"],
            cwd=work, stdout=out, stderr=subprocess.STDOUT,
        )  # fmt: skip
    try:
        deadline = time.monotonic() + PATIENCE
        while proc.poll() is None and time.monotonic() < deadline:
            first = list((work / "results" / "segments" / "epoch000").glob("*.json"))
            if first and host_info(work).get("state") == "ready" and hosts(work):
                break
            time.sleep(0.5)
        assert proc.poll() is None, (work / "snakemake.out").read_text()[-3000:]
        proc.send_signal(signal.SIGKILL)  # the run's Snakemake process, while the server is up
        proc.wait(timeout=60)
        assert all_gone(work, 120), f"left: hosts {hosts(work)}, server {server_pids(work)}"
    finally:
        if proc.poll() is None:
            proc.kill()

    snakemake(work, "--unlock", timeout=600)
    second = time.time()
    snakemake(work, "--cores", "2", "results/draft", timeout=PATIENCE)
    assert all_gone(work, 60), f"left: hosts {hosts(work)}, server {server_pids(work)}"
    info = host_info(work)
    assert info["state"] == "stopped" and "last capture" in info["error"], info

    caps = launches(work)
    assert len(caps) == 4, caps
    # the second run's captures (a capture killed after writing its manifest reruns too)
    manifests = work / "results" / "segments"
    rerun = [c for c in caps if (manifests / f"{c['capture']}.json").stat().st_mtime >= second]
    assert any(c["capture"].startswith("epoch001") for c in rerun), caps
    assert len({c["server_host_pid"] for c in rerun}) == 1, rerun  # one host for the run
    assert sum(c["server_started_by_this_job"] for c in rerun) == 1, rerun
    assert all(c["server_launches"] == 1 and c["server_mode"] == "run" for c in rerun), rerun
    assert all(c["bit_identical"] for c in caps if c["capture"].startswith("epoch001")), caps
    assert (work / "results" / "draft" / "model.safetensors").is_file()
