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


def with_defaults(cfg: dict) -> dict:
    """A copy of `cfg` as the workflow hands it to a job: validated by the schema, every default
    filled in (rules/common.smk validates the same way). For tests that call a stage's CLI."""
    from snakemake.utils import validate

    out = copy.deepcopy(cfg)
    validate(out, str(ROOT / "draftsmith" / "config" / "config.schema.yaml"))
    return out


def flip_byte(path: Path) -> None:
    """Corrupt one byte in the middle of a file in place (its mtime moves)."""
    with open(path, "r+b") as f:
        f.seek(path.stat().st_size // 2)
        byte = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([byte[0] ^ 0xFF]))


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


class PlanError(AssertionError):
    """Snakemake's dry-run output holds neither a plan nor "Nothing to be done"."""


def parse_plan(output: str) -> dict[str, int]:
    """Job counts per rule from `snakemake -n` output (its "Job stats" table, "total" checked
    and left out), {} when Snakemake said "Nothing to be done"; anything else raises PlanError,
    so an unparsed plan never reads as "up to date"."""
    if "Job stats:" in output:
        counts: dict[str, int] = {}
        for line in output.split("Job stats:", 1)[1].splitlines()[3:]:
            m = re.match(r"^(\S+)\s+(\d+)$", line.strip())
            if not m:
                break
            counts[m.group(1)] = int(m.group(2))
        total = counts.pop("total", None)
        if not counts or total != sum(counts.values()):
            raise PlanError(
                f"unreadable 'Job stats' table (total {total}, rows {counts}):\n{output[-3000:]}"
            )
        return counts
    if "Nothing to be done" in output:
        return {}
    raise PlanError(
        f"snakemake -n printed neither a plan nor 'Nothing to be done':\n{output[-3000:]}"
    )


def planned_jobs(workdir: Path, *targets: str, args: tuple[str, ...] = ()) -> dict[str, int]:
    """Job counts per rule that `snakemake -n` plans (`parse_plan`: {} only when nothing is)."""
    proc = snakemake(workdir, "-n", *args, *(("--", *targets) if targets else ()))
    return parse_plan(proc.stdout + proc.stderr)
