"""Helpers for the SLURM tests: the interpreter with the executor plugin, dry-run job lists."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from wf import ROOT


def require(reason: str) -> None:
    """Skip with a reason, or fail under DRAFTSMITH_REQUIRE_ENGINES=1 (.ci/run)."""
    if os.environ.get("DRAFTSMITH_REQUIRE_ENGINES") == "1":
        pytest.fail(f"DRAFTSMITH_REQUIRE_ENGINES=1 but {reason}")
    pytest.skip(reason)


def slurm_python() -> str:
    """An interpreter whose snakemake has the SLURM executor plugin (envs/slurm.txt)."""
    python = os.environ.get("DRAFTSMITH_PYTHON_SLURM", "")
    if python:
        if not Path(python).exists():
            require(f"DRAFTSMITH_PYTHON_SLURM={python} does not exist")
        return python
    if importlib.util.find_spec("snakemake_executor_plugin_slurm") is not None:
        return sys.executable
    require(
        "no interpreter with snakemake-executor-plugin-slurm: set DRAFTSMITH_PYTHON_SLURM "
        "(python -m draftsmith env venv --pins envs/slurm.txt --out <dir>)"
    )
    raise AssertionError("unreachable")


@dataclass
class Job:
    rule: str
    threads: int = 1
    resources: dict[str, str] = field(default_factory=dict)
    wildcards: str = ""
    group: str = ""
    shell: str = ""

    def gpus(self) -> int:
        """GPUs the job asks SLURM for (resource gpu, or the count in gres gpu[:type]:N)."""
        if "gpu" in self.resources:
            return int(self.resources["gpu"])
        gres = self.resources.get("gres", "")
        if gres.startswith("gpu"):
            return int(gres.split(":")[-1])
        return 0


RULE_RE = re.compile(r"^(\s*)(?:local)?rule (\w+):$")


def parse_jobs(out: str) -> list[Job]:
    """The jobs of a `snakemake -n -p` listing, with their resolved threads and resources."""
    jobs: list[Job] = []
    group = ""
    job: Job | None = None
    for line in out.splitlines():
        m = re.search(r"Group job (\S+) ", line)
        if m:
            group = m.group(1)
            continue
        m = RULE_RE.match(line)
        if m:
            job = Job(rule=m.group(2), group=group if m.group(1) else "")
            group = group if m.group(1) else ""
            jobs.append(job)
            continue
        if job is None:
            continue
        s = line.strip()
        if s.startswith("threads: "):
            job.threads = int(s.split(": ", 1)[1])
        elif s.startswith("wildcards: "):
            job.wildcards = s.split(": ", 1)[1]
        elif s.startswith("resources: "):
            for item in s.split(": ", 1)[1].split(", "):
                k, _, v = item.partition("=")
                job.resources[k] = v
        elif s.startswith("Shell command: ") and not job.shell:
            job.shell = s.split(": ", 1)[1]
    return jobs


def dry_run(
    workdir: Path,
    *args: str,
    python: str | None = None,
    configfiles: tuple[Path, ...] = (),
) -> list[Job]:
    """`snakemake -n -p --cores 64` of the real Snakefile in workdir; the planned jobs."""
    files = configfiles or (workdir / "config.yaml",)
    cmd = [
        python or sys.executable,
        "-m",
        "snakemake",
        "-s",
        str(ROOT / "Snakefile"),
        "--directory",
        str(workdir),
        "--configfile",
        *map(str, files),
        "-n",
        "-p",
        "--cores",
        "64",
        *args,
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-5000:]
    return parse_jobs(out)


def by_rule(jobs: list[Job]) -> dict[str, list[Job]]:
    out: dict[str, list[Job]] = {}
    for j in jobs:
        out.setdefault(j.rule, []).append(j)
    return out
