"""Run the real Snakefile on tiny configs in a temporary working directory."""

from __future__ import annotations

import copy
import re
import subprocess
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
SNAKEMAKE = [sys.executable, "-m", "snakemake"]


def tiny_config(target_dir: Path, **sections) -> dict:
    """A config that runs every stage in seconds on a tiny random target (target.source: path)."""
    cfg = {
        "target": {"source": "path", "path": str(target_dir)},
        "data": {
            "sources": [{"format": "bundled", "max_rows": 40}],
            "heldout_rows": 8,
            "rows_per_shard": 16,
            "max_length": 128,
        },
        "regenerate": {"max_new_tokens": 8, "batch_size": 8},
        "capture": {"dtype": "float32", "batch_tokens": 1024},
        "draft": {"vocab_size": 64},
        "train": {"ttt_steps": 2, "epochs": 1, "batch_tokens": 256, "checkpoint_every": 0},
        "bench": {
            "num_steps": 2,
            "max_new_tokens": 8,
            "heldout_size": 2,
            "humaneval_size": 2,
            "tau_floor": 0.0,
        },
    }
    for key, value in sections.items():
        merged = copy.deepcopy(cfg.get(key, {}))
        merged.update(value) if isinstance(value, dict) else None
        cfg[key] = merged if isinstance(value, dict) else value
    return cfg


def write_config(workdir: Path, cfg: dict) -> Path:
    workdir.mkdir(parents=True, exist_ok=True)
    path = workdir / "config.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path


def snakemake(workdir: Path, *args: str, check: bool = True, timeout: int = 900):
    """`snakemake -s <repo>/Snakefile --directory <workdir> <args>`; returns CompletedProcess."""
    cmd = [*SNAKEMAKE, "-s", str(ROOT / "Snakefile"), "--directory", str(workdir)]
    if not any(a.startswith("--configfile") for a in args):
        cmd += ["--configfile", str(workdir / "config.yaml")]
    proc = subprocess.run(
        [*cmd, *args], capture_output=True, text=True, timeout=timeout, cwd=workdir
    )
    if check and proc.returncode != 0:
        raise AssertionError(
            f"snakemake {' '.join(args)} failed ({proc.returncode}):\n"
            f"{proc.stdout[-4000:]}\n{proc.stderr[-6000:]}"
        )
    return proc


def planned_jobs(workdir: Path, *targets: str, args: tuple[str, ...] = ()) -> dict[str, int]:
    """Job counts per rule that `snakemake -n` plans (parsed from its 'Job stats' table)."""
    proc = snakemake(workdir, "-n", *args, *(("--", *targets) if targets else ()))
    out = proc.stdout + proc.stderr
    counts: dict[str, int] = {}
    if "Job stats" not in out:
        return counts
    table = out.split("Job stats:", 1)[1]
    for line in table.splitlines()[3:]:
        m = re.match(r"^(\S+)\s+(\d+)$", line.strip())
        if not m:
            break
        if m.group(1) != "total":
            counts[m.group(1)] = int(m.group(2))
    return counts
