"""The run's shared engine servers as the files their hosts keep (draftsmith.engines.sharedserver).

A host lives in `<root>/<key>-<node>-<run>/` (root: `state/servers` of the project, where every
job runs) and publishes `host.json` (its pid and node, the run that owns it, its state, the GPUs
its server holds).
Jobs lease it with a shared flock on `users.lock`; `start.lock` is held while a job attaches and
while a host decides to stop. This module reads those files and does the one thing a job of any
stage may need before it touches GPUs: stop the run's idle hosts whose servers hold GPUs
(`release_gpu_hosts`). A host is idle only between the jobs that lease it, and each of those
jobs declares the server's GPUs to Snakemake, so a host that holds GPUs while no job counts them
is always an idle one: stopping it before another job's work starts keeps Snakemake's `gpu`
resource true.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import signal
import socket
import time
from pathlib import Path

from draftsmith.runtime.files import flocked

log = logging.getLogger("draftsmith.runtime.serverhosts")

ROOT = Path("state/servers")  # relative to the project directory, where Snakemake runs jobs
LIVE = ("starting", "ready")


def read_json(path: Path) -> dict:
    """The JSON object in `path`, or {} when it is missing or not (yet) whole."""
    try:
        out = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return out if isinstance(out, dict) else {}


def proc_stat(pid: int | str) -> list[bytes]:
    """Fields of /proc/<pid>/stat after the command name: [state, ppid, pgrp, ...]."""
    with open(f"/proc/{pid}/stat", "rb") as f:
        return f.read().rsplit(b")", 1)[1].split()


def pid_alive(pid: int, mark: str = "") -> bool:
    """Whether `pid` is a live process (not a zombie) whose command line holds `mark` (against
    pid reuse)."""
    try:
        with open(f"/proc/{int(pid)}/cmdline", "rb") as f:
            cmd = f.read().decode("utf-8", "replace")
        state = proc_stat(int(pid))[0]
    except (OSError, ValueError, IndexError):
        return False
    return state != b"Z" and mark in cmd


def idle(d: Path) -> bool:
    """Whether no job holds a lease on the host in `d` (call it under its start.lock)."""
    try:
        with flocked(d / "users.lock", fcntl.LOCK_EX | fcntl.LOCK_NB):
            return True
    except BlockingIOError:
        return False


def live_hosts(root: Path, owner: int) -> list[tuple[Path, dict]]:
    """(directory, host.json) of every live host of run `owner` under `root`."""
    if not root.is_dir():
        return []
    found = []
    for d in sorted(p for p in root.iterdir() if p.is_dir()):
        info = read_json(d / "host.json")
        if (
            info.get("owner") == owner
            and info.get("node") == socket.gethostname()  # a pid means nothing elsewhere
            and info.get("state") in LIVE
            and pid_alive(info.get("host_pid", 0), str(d))
        ):
            found.append((d, info))
    return found


def stop_host(d: Path, pid: int, wait_s: float) -> bool:
    """SIGTERM the host `pid` of `d` and wait up to `wait_s` seconds for it to end (it stops its
    server's process group first); whether it ended."""
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + wait_s
    while pid_alive(pid, str(d)):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


def release_gpu_hosts(
    root: Path = ROOT,
    owner: int | None = None,
    *,
    keep: str = "",
    wait_s: float = 120.0,
    gpus_only: bool = True,
) -> list[str]:
    """Stop every idle host of run `owner` (default: this job's run, DRAFTSMITH_JOB_PARENT)
    whose server holds GPUs (every idle host: `gpus_only` False), but the one in
    `<root>/<keep>`, and wait until each is gone; the keys stopped. A host some job leases is
    left: that job's GPUs are Snakemake's to count."""
    if owner is None:
        value = os.environ.get("DRAFTSMITH_JOB_PARENT", "")
        if not value.isdigit():
            return []
        owner = int(value)
    stopped = []
    for d, info in live_hosts(Path(root), owner):
        gpus = int(info.get("gpus") or 0)
        if d.name == keep or (gpus_only and not gpus):
            continue
        with flocked(d / "start.lock", fcntl.LOCK_EX):  # no job attaches meanwhile
            if not idle(d):
                continue
            if not stop_host(d, int(info["host_pid"]), wait_s):
                raise RuntimeError(
                    f"the idle shared server in {d} (host pid {info['host_pid']}, {gpus} GPU(s)) "
                    f"did not stop within {wait_s:.0f} s; see {d / 'host.log'}"
                )
        log.info("stopped the run's idle shared server %s (it held %d GPU(s))", d, gpus)
        stopped.append(d.name)
    return stopped
