"""Training speed per `train.precision`, on this CPU and on this CPU limited to AVX2 kernels.

    python benchmarks/bench_precision.py --run DIR [--steps 6] [--modes auto bf16 fp32]

DIR is a finished run of the embedded default (its shards, vocabulary and target). For each
kernel set and precision mode, `draftsmith.train.loop` runs `--steps` optimizer steps on a fresh
state directory (the first two are warm-up) and the tokens/s of the rest are recorded with the
precision `auto` resolved to (from the training log). Kernel sets:

- `native`: whatever this CPU offers;
- `avx2`: ATEN_CPU_CAPABILITY=avx2, ONEDNN_MAX_CPU_ISA=AVX2 and MKL_ENABLE_INSTRUCTIONS=AVX2, the
  kernels torch, oneDNN and MKL use on an AVX2-only CPU such as the AMD EPYC the issue was
  reported on. This emulates that CPU's code paths, not its clock, cores or memory: ratios
  within a kernel set carry over, absolute figures do not.

Writes benchmarks/results/precision_<CPU kind>.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

from bench_contention import timed_rate, train_job  # noqa: E402

from draftsmith.runtime.files import atomic_write_json, atomic_write_text  # noqa: E402
from draftsmith.runtime.hardware import cpu_facts  # noqa: E402

AVX2 = {
    "ATEN_CPU_CAPABILITY": "avx2",
    "ONEDNN_MAX_CPU_ISA": "AVX2",
    "MKL_ENABLE_INSTRUCTIONS": "AVX2",
}


def train_rate(run: Path, env: dict, mode: str, steps: int, work: Path) -> dict:
    records, log = train_job(run, env, 2, work, max_steps=steps, precision=mode)
    tps, step_s = timed_rate(records)
    line = next(ln for ln in log.splitlines() if "INFO precision " in ln)
    why = line.split("INFO precision ", 1)[1]
    return {
        "mode": mode,
        "resolved": why.split()[0],
        "tokens_per_s": tps,
        "step_s": step_s,
        "why": why,
    }


def render(rows: list[dict], facts: dict) -> str:
    lines = [
        f"# Training speed per train.precision ({facts['kind']})",
        "",
        f"CPU: {facts['model']} ({facts['describe']}). `avx2` = this CPU limited to AVX2 kernels "
        "(ATEN_CPU_CAPABILITY=avx2, ONEDNN_MAX_CPU_ISA=AVX2, MKL_ENABLE_INSTRUCTIONS=AVX2): an "
        "AVX2-only CPU's code paths, not its clock. Ratios are against fp32 in the same kernel set.",
        "",
        "| kernels | train.precision | resolved to | tokens/s | s per step | vs fp32 |",
        "|---|---|---|---:|---:|---:|",
    ]
    for r in rows:
        base = next(x for x in rows if x["kernels"] == r["kernels"] and x["mode"] == "fp32")
        lines.append(
            f"| {r['kernels']} | {r['mode']} | {r['resolved']} | {r['tokens_per_s']:.0f} | "
            f"{r['step_s']:.2f} | {r['tokens_per_s'] / base['tokens_per_s']:.2f}x |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--run", type=Path, required=True)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--modes", nargs="+", default=["auto", "bf16", "fp32"])
    ap.add_argument("--kernels", nargs="+", default=["native", "avx2"])
    ap.add_argument("--work", type=Path, default=ROOT / "benchmarks" / "work" / "precision")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    args = ap.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    base = {**os.environ, "PYTHONPATH": str(ROOT)}
    rows = []
    for kernels in args.kernels:
        env = {**base, **(AVX2 if kernels == "avx2" else {})}
        for mode in args.modes:
            row = {"kernels": kernels, **train_rate(args.run, env, mode, args.steps, args.work)}
            print(json.dumps(row), flush=True)
            rows.append(row)
    f = cpu_facts()
    facts = {**f.as_dict(), "describe": f.describe()}
    record = {"cpu": facts, "steps": args.steps, "rows": rows}
    name = f"precision_{facts['kind']}"
    atomic_write_json(args.out / f"{name}.json", record)
    atomic_write_text(args.out / f"{name}.md", render(rows, facts))
    print(f"wrote {args.out / name}.{{json,md}}")


if __name__ == "__main__":
    main()
