"""Batched generation with transformers' sdpa attention against the hf engine's decode attention.

Loads a finished default run's target (`--from-run`, results/target), left-pads `--rows` prompts
of random ids (100 tokens, padding of 0 to 59 tokens per row) and generates `--new` tokens per
row greedily, as the regenerate stage does, with the model's own `sdpa` attention and with
draftsmith.engines.hf.attention (one query per row as two batched products over the grouped
heads), in bfloat16 and in float32, the two alternating, best of `--reps`. Reports the wall time
of each, the speed of the decode attention against sdpa, and how many generated rows are
identical (they differ in rounding only; in bfloat16 a near tie can flip a token and the rest
of its row with it).

    python benchmarks/bench_regen_attention.py [--from-run benchmarks/work/default_run]
        [--rows 32] [--new 96] [--reps 2]

Writes benchmarks/results/regen_attention_<cpu kind>.{json,md}.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from draftsmith.engines.hf.attention import use_decode_attention  # noqa: E402
from draftsmith.runtime.files import atomic_write_json, atomic_write_text, set_threads  # noqa: E402
from draftsmith.runtime.hardware import cpu_facts  # noqa: E402
from draftsmith.targets.model import load_target  # noqa: E402


def prompts(rows: int, length: int = 100) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(100, 1000, (rows, length), generator=gen)
    mask = torch.ones_like(ids)
    for i in range(rows):
        mask[i, : (i * 3) % 60] = 0
    return ids, mask


@torch.inference_mode()
def generate(model, ids, mask, new: int) -> tuple[float, torch.Tensor]:
    kw = {"do_sample": False, "max_new_tokens": new, "min_new_tokens": new}
    t0 = time.perf_counter()
    out = model.generate(input_ids=ids, attention_mask=mask, **kw)
    return time.perf_counter() - t0, out[:, ids.shape[1] :]


def measure(target: Path, dtype: str, rows: int, new: int, reps: int) -> dict:
    ids, mask = prompts(rows)
    models = {}
    for mode in ("sdpa", "decode"):
        models[mode], _ = load_target(target, dtype=getattr(torch, dtype))
        if mode == "decode":
            use_decode_attention(models[mode])
        generate(models[mode], ids[:, -20:], mask[:, -20:], 4)  # warm-up
    times, outs = {m: [] for m in models}, {}
    for _ in range(reps):
        for mode, model in models.items():
            secs, outs[mode] = generate(model, ids, mask, new)
            times[mode].append(secs)
    best = {m: min(t) for m, t in times.items()}
    same = (outs["sdpa"] == outs["decode"]).all(1)
    return {
        "dtype": dtype,
        "seconds": best,
        "speed": best["sdpa"] / best["decode"],
        "identical_rows": int(same.sum()),
        "rows": rows,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--from-run", type=Path, default=ROOT / "benchmarks/work/default_run")
    ap.add_argument("--rows", type=int, default=32)
    ap.add_argument("--new", type=int, default=96)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    target = args.from_run / "results" / "target"
    if not (target / "config.json").exists():
        raise SystemExit(f"{target}: no target; run benchmarks/bench_default.py first")
    set_threads(args.threads)
    facts = cpu_facts()
    load = os.getloadavg()[0]
    results = [measure(target, d, args.rows, args.new, args.reps) for d in ("bfloat16", "float32")]
    report = {"bench": "regen_attention", "cpu": facts.as_dict(), "kind": facts.kind,
              "threads": args.threads, "new_tokens": args.new,
              "load_average": [load, os.getloadavg()[0]], "results": results}  # fmt: skip
    out = ROOT / "benchmarks" / "results" / f"regen_attention_{facts.kind}"
    atomic_write_json(out.with_suffix(".json"), report)
    lines = [
        "# Batched generation: sdpa against the hf engine's decode attention",
        "",
        f"CPU {facts.describe()}, {args.threads} threads; the default's target, {args.rows} "
        f"left-padded prompts of 100 tokens, {args.new} new tokens each (greedy), best of "
        f"{args.reps} alternating runs; 1-min load average {load:.2f} -> "
        f"{report['load_average'][1]:.2f}.",
        "",
        "| dtype | sdpa s | decode attention s | speed | identical rows |",
        "|---|---:|---:|---:|---:|",
    ]
    for r in results:
        s = r["seconds"]
        lines.append(
            f"| {r['dtype']} | {s['sdpa']:.2f} | {s['decode']:.2f} | {r['speed']:.2f}x | "
            f"{r['identical_rows']}/{r['rows']} |"
        )
    atomic_write_text(out.with_suffix(".md"), "\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
