"""`kill -9` of snakemake leaves no job computing. A stand-in Snakemake
process runs a job shell with the workflow's prefix; the job's Python process must end when the
stand-in is killed (on main it kept running as an orphan)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PREFIX = "export DRAFTSMITH_JOB_PARENT=$PPID"


def gone(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return True
    return state in ("Z", "X")


def test_the_job_prefix_names_the_snakemake_process():
    assert PREFIX in (ROOT / "rules" / "common.smk").read_text()


def test_a_job_dies_with_a_killed_snakemake(tmp_path):
    pidfile = tmp_path / "job.pid"
    job = (
        f"set -euo pipefail; {PREFIX}; export PYTHONPATH={ROOT}; "
        f"{sys.executable} -c 'import os, time, draftsmith; "
        f'open("{pidfile}", "w").write(str(os.getpid())); time.sleep(300)\''
    )
    driver = textwrap.dedent(
        f"""
        import subprocess, time
        subprocess.Popen(["bash", "-c", {job!r}])
        time.sleep(300)
        """
    )
    snakemake = subprocess.Popen([sys.executable, "-c", driver])
    try:
        for _ in range(300):
            if pidfile.exists() and pidfile.read_text():
                break
            time.sleep(0.1)
        pid = int(pidfile.read_text())
        time.sleep(0.5)
        assert not gone(pid)  # running while its snakemake is
        os.kill(snakemake.pid, signal.SIGKILL)
        snakemake.wait()
        for _ in range(100):
            if gone(pid):
                break
            time.sleep(0.1)
        assert gone(pid), "the job kept running after snakemake was killed"
    finally:
        if snakemake.poll() is None:
            snakemake.kill()
        if pidfile.exists() and pidfile.read_text() and not gone(int(pidfile.read_text())):
            os.kill(int(pidfile.read_text()), signal.SIGKILL)


def test_outside_a_job_nothing_is_followed():
    env = {k: v for k, v in os.environ.items() if k != "DRAFTSMITH_JOB_PARENT"}
    code = "import threading, draftsmith; print([t.name for t in threading.enumerate()])"
    out = subprocess.run(
        [sys.executable, "-c", code],
        env={**env, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert "draftsmith-lifeline" not in out
