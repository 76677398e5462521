"""A bfloat16 target on this CPU: how much faster it decodes, and what it costs losslessness.

One process loads the target twice, in float32 and as a bfloat16 copy (target.dtype), with the
draft cast to the same dtype, and decodes each held-out prompt four ways: plain greedy and
chain speculative decoding (K = `--num-steps`) in each dtype (the order rotated per prompt, so
load drift favours neither). Reported per dtype: greedy and speculative tokens/s, tau, the
speedup of speculation over greedy of the same dtype, and how many speculative outputs equal
greedy token for token; and the bf16 greedy rate against the fp32 greedy rate.

Where a speculative output differs from greedy of the same dtype, the script finds the first
differing token and measures the target's own top-2 logit margin there (one forward of the
common prefix in that dtype), against the median margin over all greedy positions: a
divergence at a near-tie is the matrix kernels rounding differently for a forward of K + 1
tokens than for one token, not a wrong acceptance rule (in float32 the outputs are identical).

    nice -n 10 python benchmarks/bench_target_dtype.py --target results/target \
        --draft results/draft [--config cfg.yaml] [--heldout 16] [--num-steps 2] [--max-new-tokens 64] [--threads 2]

Writes benchmarks/results/target_dtype.json and .md.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

DTYPES = ("float32", "bfloat16")


def margins(model, ids: list[int], out: list[int]) -> list[float]:
    """The target's top-2 logit margin at every position of `out` after prompt `ids`."""
    import torch

    seq = torch.tensor([ids + out[:-1]])
    with torch.no_grad():
        logits = model(seq).logits[0, len(ids) - 1 :].float()
    top = logits.topk(2, dim=-1).values
    return (top[:, 0] - top[:, 1]).tolist()


def first_difference(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def decode_all(models: dict, rows: list, args, specdec, prompt_turns) -> dict:
    """Per dtype: greedy and speculative outputs and seconds, order rotated per prompt."""
    runs = [(d, kind) for d in DTYPES for kind in ("greedy", "spec")]
    res = {d: {"greedy": [], "spec": [], "greedy_s": 0.0, "spec_s": 0.0} for d in DTYPES}
    for i, row in enumerate(rows):
        ids = specdec.prompt_ids(models["tokenizer"], prompt_turns(row))
        for d, kind in runs[i % len(runs) :] + runs[: i % len(runs)]:
            model, draft = models[d]
            t0 = time.perf_counter()
            if kind == "greedy":
                out = specdec.greedy_generate(model, ids, args.max_new_tokens, models["stops"])
            else:
                out = specdec.speculative_generate(
                    model,
                    draft,
                    ids,
                    args.max_new_tokens,
                    models["stops"],
                    args.num_steps,
                    models["aux"],
                )
            res[d][f"{kind}_s"] += time.perf_counter() - t0
            res[d][kind].append((ids, out))
    return res


def summarize(models: dict, res: dict, specdec) -> dict:
    out = {}
    for d in DTYPES:
        r = res[d]
        model = models[d][0]
        greedy_tokens = sum(len(o) for _, o in r["greedy"])
        traces = [t for _, t in r["spec"]]
        s = specdec.summarize(traces)
        greedy_tps = greedy_tokens / r["greedy_s"]
        spec_tps = s["generated_tokens"] / r["spec_s"]
        all_margins, at_diff = [], []
        for (ids, g), (_, t) in zip(r["greedy"], r["spec"], strict=True):
            m = margins(model, ids, g)
            all_margins.extend(m)
            i = first_difference(g, t.tokens)
            if i is not None and i < len(m):
                at_diff.append(m[i])
        out[d] = {
            "greedy_tokens_per_s": greedy_tps,
            "spec_tokens_per_s": spec_tps,
            "speedup": spec_tps / greedy_tps,
            "tau": s["tau"],
            "tau_sglang": s["tau_sglang"],
            "identical": sum(
                t.tokens == g for (_, g), (_, t) in zip(r["greedy"], r["spec"], strict=True)
            ),
            "median_margin": statistics.median(all_margins),
            "margins_at_first_difference": at_diff,
        }
    out["bf16_greedy_vs_fp32_greedy"] = (
        out["bfloat16"]["greedy_tokens_per_s"] / out["float32"]["greedy_tokens_per_s"]
    )
    return out


def render_md(r: dict) -> str:
    s = r["summary"]
    lines = [
        "# A bfloat16 target on this CPU (hf engine)",
        "",
        f"{r['prompts']} held-out prompts, {r['max_new_tokens']} new tokens, chain of "
        f"{r['num_steps']} draft tokens, {r['threads']} threads, wall clock, load average "
        f"{r['load_average'][0]:.1f} -> {r['load_average'][1]:.1f}; both dtypes in one process.",
        "",
        "| target dtype | greedy tok/s | speculative tok/s | speedup | tau | tau (SGLang count) "
        "| identical to greedy | median top-2 margin | margins at the first difference |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for d in DTYPES:
        x = s[d]
        diffs = ", ".join(f"{m:.3f}" for m in x["margins_at_first_difference"]) or "-"
        lines.append(
            f"| {d} | {x['greedy_tokens_per_s']:.1f} | {x['spec_tokens_per_s']:.1f} "
            f"| {x['speedup']:.2f}x | {x['tau']:.3f} | {x['tau_sglang']:.3f} "
            f"| {x['identical']}/{r['prompts']} | {x['median_margin']:.2f} | {diffs} |"
        )
    lines += [
        "",
        f"bf16 greedy against fp32 greedy: **{s['bf16_greedy_vs_fp32_greedy']:.2f}x** tokens/s.",
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default=str(ROOT / "results" / "target"))
    ap.add_argument("--draft", default=str(ROOT / "results" / "draft"))
    ap.add_argument("--config", help="workflow config (default: the schema defaults)")
    ap.add_argument("--heldout", type=int, default=16)
    ap.add_argument("--num-steps", type=int, default=2)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "target_dtype"))
    args = ap.parse_args(argv)

    import torch
    from bench_num_steps import full_config

    from draftsmith.bench import specdec
    from draftsmith.data.prompts import load_sources, prompt_turns
    from draftsmith.engines.hf.engine import load_models
    from draftsmith.runtime.files import atomic_write_json, atomic_write_text, set_threads, versions

    set_threads(args.threads)
    rows = load_sources(full_config(args.config)).heldout[: args.heldout]
    models = {}
    for d in DTYPES:
        model, tokenizer, draft = load_models(Path(args.target), Path(args.draft), d, "cpu")
        models[d] = (model, draft)
        models["tokenizer"], models["aux"] = tokenizer, list(draft.config.aux_layer_ids)
        models["stops"] = specdec.stop_ids(model, tokenizer)
    warm = specdec.prompt_ids(models["tokenizer"], prompt_turns(rows[0]))
    for d in DTYPES:
        specdec.greedy_generate(models[d][0], warm, 8, models["stops"])
    load_before = os.getloadavg()[0]
    with torch.no_grad():
        res = decode_all(models, rows, args, specdec, prompt_turns)
        summary = summarize(models, res, specdec)
    report = {
        "target": args.target,
        "draft": args.draft,
        "prompts": len(rows),
        "num_steps": args.num_steps,
        "max_new_tokens": args.max_new_tokens,
        "threads": torch.get_num_threads(),
        "load_average": [load_before, os.getloadavg()[0]],
        "versions": versions(),
        "summary": summary,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_json(out.with_suffix(".json"), report)
    atomic_write_text(out.with_suffix(".md"), render_md(report))
    print(render_md(report))


if __name__ == "__main__":
    main()
