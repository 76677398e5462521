"""The regenerate stage's generation: KV cache kind, batch size and linear-layer routes, on one
real range.

Loads a finished default run's target (`--from-run`, results/target) and regenerates the
conversations of its first range (results/data/rows_000000-000064.jsonl: the user turns are
what the stage answers; every turn, follow-ups included) with the hf engine's `HFGenerator`, as
the regenerate stage does, once per variant: transformers' concatenating KV cache or the cache
written in place (draftsmith.runtime.kvcache), at each `--batch` size, with the linear layers
as `F.linear` computes them or routed per batch size by measurement (`--routes on`,
draftsmith.runtime.gemm, as the stage does on a CPU; the measuring is in the wall time). The
variants run in
turn in one process, in `--dtype` (the dtype `regenerate.dtype: auto` picks on this CPU),
`--reps` rounds with the order reversed every other round, best round kept. Reports the wall
time of each variant, its speed against the first one (the baseline), new tokens, and how many
conversations came out identical to the baseline's (batching and cache differ in rounding
only; a near tie may flip a token and the rest of its reply).

    python benchmarks/bench_regen_batch.py [--from-run benchmarks/work/default_run]
        [--dtype float32] [--batch 32 64] [--routes off on] [--reps 1]

Writes benchmarks/results/regen_batch_<cpu kind>.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench_job_threads import write_result  # noqa: E402

from draftsmith.data.regenerate import regenerate  # noqa: E402
from draftsmith.engines.hf.attention import use_decode_attention  # noqa: E402
from draftsmith.engines.hf.engine import HFGenerator  # noqa: E402
from draftsmith.runtime import gemm  # noqa: E402
from draftsmith.runtime.files import set_threads  # noqa: E402
from draftsmith.runtime.hardware import cpu_facts  # noqa: E402
from draftsmith.targets.model import load_target  # noqa: E402

RANGE = "rows_000000-000064"


def run_variant(model, tokenizer, rows: list[dict], slab: bool, batch: int, routed: bool) -> dict:
    gen = HFGenerator(model, tokenizer, max_new_tokens=96, batch_size=batch, max_total=512,
                      progress=False, route=routed)  # fmt: skip
    gen.slab = slab
    t0 = time.perf_counter()
    out = regenerate(rows, gen)
    seconds = time.perf_counter() - t0
    gemm.unroute(model)  # the next variant starts from F.linear
    return {"seconds": seconds, "new_tokens": gen.stats["new_tokens"],
            "batches": gen.stats["batches"], "rows": out,
            "routes": gemm.summary(gen.routes) if gen.routes else "F.linear"}  # fmt: skip


def measure(target: Path, rows: list[dict], dtype: str, batches: list[int], reps: int,
            caches: tuple[bool, ...] = (False, True), routes=(False,)) -> list:  # fmt: skip
    model, tokenizer = load_target(target, dtype=getattr(torch, dtype))
    use_decode_attention(model)
    variants = [(slab, b, r) for b in batches for slab in caches for r in routes]
    best: dict = {}
    for rep in range(reps):
        for v in variants if rep % 2 == 0 else variants[::-1]:
            run = run_variant(model, tokenizer, rows, *v)
            print(f"rep {rep} cache {'in place' if v[0] else 'cat'} batch {v[1]} routes "
                  f"{'on' if v[2] else 'off'}: {run['seconds']:.1f} s", flush=True)  # fmt: skip
            if v not in best or run["seconds"] < best[v]["seconds"]:
                best[v] = run
    base = best[variants[0]]
    table = []
    for slab, b, routed in variants:
        run = best[(slab, b, routed)]
        same = sum(x == y for x, y in zip(run["rows"], base["rows"], strict=True))
        table.append({"cache": "in place" if slab else "cat", "batch": b,
                      "linear_layers": run["routes"],
                      "seconds": round(run["seconds"], 2), "new_tokens": run["new_tokens"],
                      "batches": run["batches"],
                      "speed": round(base["seconds"] / run["seconds"], 3),
                      "identical": f"{same}/{len(rows)}"})  # fmt: skip
    return table


def render(result: dict) -> str:
    lines = [
        "# Regeneration: KV cache kind, batch size and linear-layer routes",
        "",
        f"CPU {result['cpu']}, {result['threads']} threads; the default's target in "
        f"{result['dtype']}; the {result['rows']} conversations of {RANGE} (every user turn, "
        "follow-ups included), 96 new tokens at most per reply (greedy), decode attention of "
        f"draftsmith.engines.hf.attention; best of {result['reps']} round(s); 1-min load "
        f"average {result['load_before']:.2f} -> {result['load_after']:.2f}.",
        "",
        "| cache | batch | linear layers | s | speed | new tokens | batches | identical "
        "conversations |",
        "|---|---:|---|---:|---:|---:|---:|---:|",
    ]
    for r in result["table"]:
        lines.append(f"| {r['cache']} | {r['batch']} | {r.get('linear_layers', 'F.linear')} | "
                     f"{r['seconds']:.1f} | {r['speed']:.2f}x | {r['new_tokens']} | "
                     f"{r['batches']} | {r['identical']} |")  # fmt: skip
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--from-run", type=Path, default=ROOT / "benchmarks/work/default_run")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--batch", type=int, nargs="+", default=[32, 64])
    ap.add_argument("--reps", type=int, default=1)
    ap.add_argument("--caches", nargs="+", default=["cat", "in-place"], choices=["cat", "in-place"])
    ap.add_argument("--routes", nargs="+", default=["off"], choices=["off", "on"])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--name", default="")
    args = ap.parse_args()
    set_threads(args.threads)
    path = args.from_run / "results/data" / f"{RANGE}.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    facts = cpu_facts()
    load_before = os.getloadavg()[0]
    caches = tuple(c == "in-place" for c in args.caches)
    routes = tuple(r == "on" for r in args.routes)
    table = measure(args.from_run / "results/target", rows, args.dtype, args.batch, args.reps,
                    caches, routes)  # fmt: skip
    result = {"cpu": facts.describe(), "kind": facts.kind, "threads": args.threads,
              "dtype": args.dtype, "rows": len(rows), "reps": args.reps,
              "load_before": load_before, "load_after": os.getloadavg()[0],
              "table": table}  # fmt: skip
    write_result(args.name or f"regen_batch_{facts.kind}", result, render)


if __name__ == "__main__":
    main()
