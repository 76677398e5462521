"""Regeneration throughput of the hf backend: batched, left-padded generation vs one row at a time.

Runs HFGenerator on the first N bundled training prompts at several batch sizes, on the same
prompts in the same process, and reports generated tokens/s and the speedup over batch size 1
(the baseline). Also reports how many replies are identical to the unbatched greedy replies
(left padding must not change greedy output beyond float rounding).

    python benchmarks/bench_regen.py --target results/target --prompts 32 --max-new-tokens 64 \
        --batch-sizes 1,8,16,32 --threads 2

Writes benchmarks/results/regen.json and regen.md.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default=str(ROOT / "results" / "target"))
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--batch-sizes", default="1,8,16,32")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "regen"))
    args = ap.parse_args()

    import torch

    from draftsmith.common import atomic_write_json, atomic_write_text, versions
    from draftsmith.engines.hf import HFGenerator
    from draftsmith.prompts import load_sources
    from draftsmith.target import load_target

    torch.set_num_threads(args.threads)
    load_before = os.getloadavg()[0]
    rows = load_sources({"data": {"heldout_rows": 40}}).train[: args.prompts]
    prompts = [[t for t in r["conversations"] if t["role"] != "assistant"][:2] for r in rows]
    prompts = [p if p[-1]["role"] == "user" else p[:1] for p in prompts]
    t0 = time.perf_counter()
    model, tokenizer = load_target(args.target)
    load_s = time.perf_counter() - t0

    results, baseline_replies = [], None
    for bs in [int(b) for b in args.batch_sizes.split(",")]:
        gen = HFGenerator(
            model, tokenizer, max_new_tokens=args.max_new_tokens, batch_size=bs, progress=False
        )
        replies = gen(prompts)
        if baseline_replies is None:
            baseline_replies = replies
        same = sum(a == b for a, b in zip(replies, baseline_replies, strict=True))
        results.append(
            {
                "batch_size": bs,
                "new_tokens": gen.stats["new_tokens"],
                "seconds": round(gen.stats["seconds"], 2),
                "tokens_per_second": round(gen.tokens_per_second(), 1),
                "hit_limit": gen.stats["hit_limit"],
                "same_as_baseline": same,
            }
        )
        print(results[-1], flush=True)
    base = results[0]["tokens_per_second"]
    for r in results:
        r["speedup_vs_baseline"] = round(r["tokens_per_second"] / base, 2) if base else None

    report = {
        "benchmark": "regen",
        "target": args.target,
        "prompts": len(prompts),
        "max_new_tokens": args.max_new_tokens,
        "threads": args.threads,
        "load_seconds": round(load_s, 1),
        "baseline": f"batch_size {results[0]['batch_size']} (unbatched)",
        "results": results,
        "machine": {
            "cpu_count": os.cpu_count(),
            "platform": platform.platform(),
            "loadavg_1min_before_after": [round(load_before, 2), round(os.getloadavg()[0], 2)],
        },
        "versions": versions(),
    }
    atomic_write_json(f"{args.out}.json", report)
    lines = [
        "# Regeneration throughput (hf backend)",
        "",
        f"{len(prompts)} bundled prompts, max_new_tokens {args.max_new_tokens}, "
        f"{args.threads} threads; baseline {report['baseline']}; 1-min load average "
        f"{report['machine']['loadavg_1min_before_after']} on {os.cpu_count()} CPUs.",
        "",
        "| batch | new tokens | seconds | tokens/s | speedup | hit limit | same as baseline |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        lines.append(
            f"| {r['batch_size']} | {r['new_tokens']} | {r['seconds']} | "
            f"{r['tokens_per_second']} | {r['speedup_vs_baseline']}x | {r['hit_limit']} | "
            f"{r['same_as_baseline']}/{len(prompts)} |"
        )
    atomic_write_text(f"{args.out}.md", "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
