"""Overhead of one SLURM job: the same forced job run locally and through the executor plugin.

Builds the tiny workflow (tests/wf.py tiny_config on a tiny random target) up to the tokens
locally, then alternately forces one cheap job (the vocabulary, a few hundred ms of work) with
`snakemake --cores 2 -f results/vocab/vocab.safetensors` and the same under
`--profile profiles/local-slurm`, and reports wall times and their ratio, measured in the same
run. Needs a running SLURM (scripts/slurm_up.sh) and an interpreter with the plugin:

    scripts/slurm_up.sh /tmp/slurm
    python benchmarks/bench_slurm.py --slurm-python .venvs/slurm/bin/python --repeats 3

Writes benchmarks/results/slurm.json and slurm.md.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

TARGET = "results/vocab/vocab.safetensors"


def snakemake(python: str, work: Path, *args: str) -> float:
    cmd = [python, "-m", "snakemake", "-s", str(ROOT / "Snakefile"), "--directory", str(work)]
    cmd += ["--configfile", str(work / "config.yaml"), *args]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=work)
    dt = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(args)} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return dt


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--slurm-python", required=True, help="interpreter with envs/slurm.txt")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "slurm"))
    args = ap.parse_args()

    from wf import tiny_config, write_config

    from draftsmith.runtime.files import atomic_write_json, atomic_write_text
    from draftsmith.targets.tinymodel import make_tiny_target

    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp) / "work"
        cfg = tiny_config(make_tiny_target(Path(tmp) / "model"))
        cfg["envs"] = {"cpu": {"python": sys.executable, "gpus": 0}}
        write_config(work, cfg)
        snakemake(sys.executable, work, "--cores", "2", TARGET)
        profile = ("--profile", str(ROOT / "profiles" / "local-slurm"))
        times: dict[str, list[float]] = {"local": [], "slurm": []}
        for _ in range(args.repeats):  # interleaved: both see the same machine load
            times["local"].append(snakemake(sys.executable, work, "--cores", "2", "-f", TARGET))
            times["slurm"].append(snakemake(args.slurm_python, work, *profile, "-f", TARGET))

    med = {k: statistics.median(v) for k, v in times.items()}
    result = {
        "job": f"vocab ({TARGET}, forced), tiny workflow",
        "repeats": args.repeats,
        "seconds": times,
        "median_s": med,
        "overhead_s": med["slurm"] - med["local"],
        "ratio": med["slurm"] / med["local"],
        "machine": f"{platform.node()} {platform.machine()}, {platform.python_version()}",
    }
    out = Path(args.out)
    atomic_write_json(out.with_suffix(".json"), result)
    atomic_write_text(
        out.with_suffix(".md"),
        "# One SLURM job vs the same job run locally\n\n"
        f"Forced job: {result['job']}; {args.repeats} interleaved repeats; wall time of the whole "
        "`snakemake` call (start-up, DAG, job, bookkeeping).\n\n"
        "| mode | runs (s) | median (s) |\n|---|---|---|\n"
        + "".join(
            f"| {k} | {', '.join(f'{t:.1f}' for t in v)} | {med[k]:.1f} |\n"
            for k, v in times.items()
        )
        + f"\nOverhead per SLURM job: **{result['overhead_s']:.1f} s**, "
        f"ratio **{result['ratio']:.1f}x** the local call.\n",
    )
    print(out.with_suffix(".md").read_text())


if __name__ == "__main__":
    main()
