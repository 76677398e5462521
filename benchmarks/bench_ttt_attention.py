"""Training-time-test attention: the whole pack's T x T step-0 scores against query chunks.

Builds `--batch` packs of `--pack` positions holding rows of `--row` tokens (the last row of a
pack cut to fit), with the embedded default's draft attention shapes (9 query heads, 3 key/value
heads of 64), and runs `TTTCache` (draftsmith.algorithms.eagle3.model) forward and backward over
`--steps` unrolled steps as training does (step 0 every position, each later step 80% of the
previous step's), once with one chunk of the whole pack (every query scores every key, as
before chunking) and once per `--chunk` size (a chunk scores only the keys from its earliest
row start). The variants alternate, best of `--reps`. Reports milliseconds per training step
of attention, the speed against the whole pack, and the largest difference of outputs and
gradients against it (the same softmax; rounding only).

    python benchmarks/bench_ttt_attention.py [--row 150] [--pack 480] [--batch 2]
        [--chunk 64 128 256] [--threads 2] [--reps 5]

Writes benchmarks/results/ttt_attention_<cpu kind>.{json,md}.
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

from bench_job_threads import write_result  # noqa: E402

from draftsmith.algorithms.eagle3.model import TTTCache, block_causal_mask  # noqa: E402
from draftsmith.runtime.files import set_threads  # noqa: E402
from draftsmith.runtime.hardware import cpu_facts  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM = 9, 3, 64  # the embedded default's draft (SmolLM2-135M's shapes)


def segments(batch: int, pack: int, row: int) -> torch.Tensor:
    """[batch, pack] row ids: rows of `row` tokens one after another, the last one cut."""
    ids = torch.arange(pack) // row
    return ids.expand(batch, pack).clone()


def inputs(batch: int, pack: int, steps: int) -> list:
    """Per step: (flat positions, q, k, v), positions kept 80% from one step to the next."""
    gen = torch.Generator().manual_seed(0)
    idx, out = torch.arange(batch * pack), []
    for j in range(steps):
        if j:
            idx = idx[torch.rand(idx.numel(), generator=gen) < 0.8]
        n = idx.numel()
        q = torch.randn(1, HEADS, n, HEAD_DIM, generator=gen)
        k = torch.randn(1, KV_HEADS, n, HEAD_DIM, generator=gen)
        v = torch.randn(1, KV_HEADS, n, HEAD_DIM, generator=gen)
        out.append((idx, q, k, v))
    return out


def run(visible: torch.Tensor, steps: list, chunk: int) -> tuple[float, list, list]:
    """(seconds of forward + backward, outputs, gradients of q) of one unrolled chain."""
    leaves = [(idx, *(x.clone().requires_grad_(True) for x in qkv)) for idx, *qkv in steps]
    t0 = time.perf_counter()
    cache = TTTCache(visible, chunk=chunk)
    outs = []
    for j, (idx, q, k, v) in enumerate(leaves):
        if j:
            cache.select(idx)
        outs.append(cache.attend(q, k, v))
    sum((o * o).sum() for o in outs).backward()
    seconds = time.perf_counter() - t0
    return seconds, [o.detach() for o in outs], [leaf[1].grad for leaf in leaves]


def measure(args) -> list[dict]:
    visible = block_causal_mask(segments(args.batch, args.pack, args.row))
    steps = inputs(args.batch, args.pack, args.steps)
    sizes = [args.pack, *args.chunk]
    best = {c: float("inf") for c in sizes}
    ref = run(visible, steps, args.pack)
    for rep in range(args.reps + 1):  # the first round warms up
        for c in sizes if rep % 2 == 0 else sizes[::-1]:
            seconds, outs, grads = run(visible, steps, c)
            if rep:
                best[c] = min(best[c], seconds)
            if c != args.pack and rep == 0:
                diff = max(
                    max(float((a - b).abs().max()) for a, b in zip(outs, ref[1], strict=True)),
                    max(float((a - b).abs().max()) for a, b in zip(grads, ref[2], strict=True)),
                )
                best[f"diff{c}"] = diff
    return [
        {
            "chunk": c,
            "ms": round(best[c] * 1e3, 1),
            "speed": round(best[args.pack] / best[c], 2),
            "max_abs_diff": best.get(f"diff{c}", 0.0),
        }
        for c in sizes
    ]


def render(r: dict) -> str:
    lines = [
        "# Training-time-test attention: whole pack against query chunks",
        "",
        f"CPU {r['cpu']}, {r['threads']} threads; {r['batch']} packs of {r['pack']} positions, "
        f"rows of {r['row']} tokens, {r['steps']} unrolled steps (each later step keeps 80% of "
        f"the positions), {HEADS} query / {KV_HEADS} key-value heads of {HEAD_DIM}; forward and "
        f"backward, best of {r['reps']}; 1-min load average {r['load_before']:.2f} -> "
        f"{r['load_after']:.2f}.",
        "",
        "| chunk | ms per training step | speed | largest difference (outputs, q gradients) |",
        "|---:|---:|---:|---:|",
    ]
    for t in r["table"]:
        name = f"{t['chunk']} (whole pack)" if t["chunk"] == r["pack"] else str(t["chunk"])
        lines.append(f"| {name} | {t['ms']:.1f} | {t['speed']:.2f}x | {t['max_abs_diff']:.1e} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--row", type=int, default=150)
    ap.add_argument("--pack", type=int, default=480)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--chunk", type=int, nargs="+", default=[64, 128, 256])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--name", default="")
    args = ap.parse_args()
    set_threads(args.threads)
    facts = cpu_facts()
    load_before = os.getloadavg()[0]
    table = measure(args)
    result = {"cpu": facts.describe(), "kind": facts.kind, "threads": args.threads,
              "batch": args.batch, "pack": args.pack, "row": args.row, "steps": args.steps,
              "reps": args.reps, "load_before": load_before,
              "load_after": os.getloadavg()[0], "table": table}  # fmt: skip
    write_result(args.name or f"ttt_attention_{facts.kind}", result, render)


if __name__ == "__main__":
    main()
