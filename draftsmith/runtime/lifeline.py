"""Jobs die with snakemake: a job process follows the Snakemake process that started it.

The shell prefix of every job (rules/common.smk) exports DRAFTSMITH_JOB_PARENT=$PPID, the pid of
the Snakemake process running the job's shell. Every process that imports `draftsmith` with
that variable set (the job's own `python -m draftsmith <command>`, the training ranks launched by
`draftsmith.train.launch`, anything else of the job in Python) starts `follow(pid)`: a daemon thread
that waits on a pidfd of that process (Linux >= 5.3; else a check every second) and, when it is
gone, even by `kill -9`, sends this process SIGTERM (SIGKILL 30 s later if it is still there).
SIGTERM runs the usual shutdown: a server supervisor stops its server's process group, training
keeps its checkpoints. Nothing is left computing for a run that no longer exists, and the next
run redoes only the unfinished outputs.
"""

from __future__ import annotations

import os
import select
import signal
import threading
import time

ENV = "DRAFTSMITH_JOB_PARENT"
GRACE = 30.0
_started: set[tuple[int, int]] = set()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _wait_gone(pid: int) -> None:
    try:
        fd = os.pidfd_open(pid)
    except (AttributeError, OSError):
        while _alive(pid):
            time.sleep(1.0)
        return
    try:
        select.select([fd], [], [])
    finally:
        os.close(fd)


def _watch(pid: int) -> None:
    _wait_gone(pid)
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(GRACE)
    os.kill(os.getpid(), signal.SIGKILL)


def follow(pid: int) -> None:
    """End this process when process `pid` ends (once per process and pid)."""
    if pid <= 1 or pid == os.getpid() or (os.getpid(), pid) in _started:
        return
    _started.add((os.getpid(), pid))
    threading.Thread(target=_watch, args=(pid,), name="draftsmith-lifeline", daemon=True).start()


def follow_from_environment() -> None:
    value = os.environ.get(ENV, "")
    if value.isdigit():
        follow(int(value))
