"""Regeneration throughput of the hf backend: batched, left-padded generation vs one row at a time.

Runs HFGenerator on the first N bundled training prompts at several batch sizes (and weight
dtypes: `--variants 32:float32,32:bfloat16`, regenerate.dtype), on the same prompts in the same
process, and reports generated tokens/s and the speedup over the first variant (the baseline).
Also reports how many replies are identical to the baseline's (left padding must not change
greedy output beyond float rounding) and, per variant, the fraction of reply tokens that are
the float32 target's own greedy choice after the same prefix (one float32 prefill per reply:
how far a bf16 copy's text is from the target's greedy path).

    python benchmarks/bench_regen.py --target results/target --prompts 32 --max-new-tokens 64 \
        --batch-sizes 1,8,16,32 --threads 2
    nice -n 10 python benchmarks/bench_regen.py --variants 8:float32,32:float32,64:float32,\
        32:bfloat16,64:bfloat16 --threads 1 --clock cpu --out benchmarks/results/regen_cpu

`--clock cpu` times with this process's CPU seconds: with one thread, a cost that other users'
load on a shared machine hardly changes. Writes benchmarks/results/regen.json and regen.md.
"""

from __future__ import annotations

import argparse
import copy
import os
import platform
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def greedy_fraction(model, gen, prompts) -> float:
    """Fraction of the reply tokens `gen` generates for `prompts` (again, as ids) that are the
    float32 `model`'s argmax after the same prefix (one prefill per reply)."""
    import torch

    agree = total = 0
    encoded = [gen._encode(p) for p in prompts]
    with torch.inference_mode():
        for start in range(0, len(encoded), gen.batch_size):
            batch = encoded[start : start + gen.batch_size]
            for p, reply in zip(batch, gen.generate_ids(batch), strict=True):
                if not reply:
                    continue
                logits = model(input_ids=torch.tensor([p + reply])).logits[0]
                pred = logits[len(p) - 1 : len(p) + len(reply) - 1].argmax(-1)
                agree += int((pred == torch.tensor(reply)).sum())
                total += len(reply)
    return agree / total if total else float("nan")


def fraction(value) -> str:
    return "-" if value is None else f"{value:.2%}"


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default=str(ROOT / "results" / "target"))
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--batch-sizes", default="1,8,16,32")
    ap.add_argument("--variants", help="batch:dtype,... (overrides --batch-sizes, float32)")
    ap.add_argument("--clock", choices=["wall", "cpu"], default="wall")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "regen"))
    return ap.parse_args()


def bundled_prompts(n: int) -> list[list[dict]]:
    """The first n bundled training rows, as the turns before the first reply."""
    from draftsmith.data.prompts import load_sources

    rows = load_sources({"data": {"heldout_rows": 40}}).train[:n]
    prompts = [[t for t in r["conversations"] if t["role"] != "assistant"][:2] for r in rows]
    return [p if p[-1]["role"] == "user" else p[:1] for p in prompts]


def run_variants(args, model, tokenizer, prompts) -> list[dict]:
    """Regenerate the prompts at every (batch size, dtype) variant; the first is the baseline."""
    import torch

    from draftsmith.engines.hf.engine import HFGenerator

    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    variants = [(int(b), "float32") for b in args.batch_sizes.split(",")]
    if args.variants:
        variants = [(int(v.split(":")[0]), v.split(":")[1]) for v in args.variants.split(",")]
    copies = {"float32": model}
    results, baseline_replies = [], None
    for bs, dtype in variants:
        if dtype not in copies:
            copies[dtype] = copy.deepcopy(model).to(getattr(torch, dtype))
        gen = HFGenerator(
            copies[dtype],
            tokenizer,
            max_new_tokens=args.max_new_tokens,
            batch_size=bs,
            progress=False,
        )
        t0 = clock()
        replies = gen(prompts)
        seconds = clock() - t0
        if baseline_replies is None:
            baseline_replies = replies
        same = sum(a == b for a, b in zip(replies, baseline_replies, strict=True))
        results.append(
            {
                "batch_size": bs,
                "dtype": dtype,
                "new_tokens": gen.stats["new_tokens"],
                "seconds": round(seconds, 2),
                "tokens_per_second": round(gen.stats["new_tokens"] / seconds, 1),
                "hit_limit": gen.stats["hit_limit"],
                "same_as_baseline": same,
                # once per dtype (it generates the replies again, as ids)
                "target_greedy_fraction": None
                if any(r["dtype"] == dtype for r in results)
                else round(greedy_fraction(model, gen, prompts), 4),
            }
        )
        print(results[-1], flush=True)
    base = results[0]["tokens_per_second"]
    for r in results:
        r["speedup_vs_baseline"] = round(r["tokens_per_second"] / base, 2) if base else None
    return results


def render_md(report: dict) -> str:
    """regen.md from the report (regen.json)."""
    n = report["prompts"]
    lines = [
        "# Regeneration throughput (hf backend)",
        "",
        f"{n} bundled prompts, max_new_tokens {report['max_new_tokens']}, "
        f"{report['threads']} threads, {report['clock']} clock; baseline {report['baseline']}; "
        "1-min load average "
        f"{report['machine']['loadavg_1min_before_after']} on "
        f"{report['machine']['cpu_count']} CPUs.",
        "",
        "| batch | dtype | new tokens | seconds | tokens/s | speedup | hit limit "
        "| same as baseline | target's greedy token |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in report["results"]:
        lines.append(
            f"| {r['batch_size']} | {r['dtype']} | {r['new_tokens']} | {r['seconds']} | "
            f"{r['tokens_per_second']} | {r['speedup_vs_baseline']}x | {r['hit_limit']} | "
            f"{r['same_as_baseline']}/{n} | {fraction(r['target_greedy_fraction'])} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    args = parse_args()

    import torch

    from draftsmith.runtime.files import atomic_write_json, atomic_write_text, versions
    from draftsmith.targets.model import load_target

    torch.set_num_threads(args.threads)
    load_before = os.getloadavg()[0]
    prompts = bundled_prompts(args.prompts)
    t0 = time.perf_counter()
    model, tokenizer = load_target(args.target)
    load_s = time.perf_counter() - t0
    results = run_variants(args, model, tokenizer, prompts)
    report = {
        "benchmark": "regen",
        "target": args.target,
        "prompts": len(prompts),
        "max_new_tokens": args.max_new_tokens,
        "threads": args.threads,
        "clock": args.clock,
        "load_seconds": round(load_s, 1),
        "baseline": f"batch_size {results[0]['batch_size']} {results[0]['dtype']}",
        "results": results,
        "machine": {
            "cpu_count": os.cpu_count(),
            "platform": platform.platform(),
            "loadavg_1min_before_after": [round(load_before, 2), round(os.getloadavg()[0], 2)],
        },
        "versions": versions(),
    }
    atomic_write_json(f"{args.out}.json", report)
    atomic_write_text(f"{args.out}.md", render_md(report))


if __name__ == "__main__":
    main()
