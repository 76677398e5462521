"""tau against the sampling temperature: what bench.temperature > 0 measures with a trained draft.

One process, one target, one trained draft (the hf engine's `speculative_generate`): every
held-out prompt is decoded with speculative sampling at each temperature (seed = prompt index),
and greedily (temperature 0). Per temperature it reports tau, acceptance by position and the
accepted-length histogram, and a check of the rule on the real model: at every verification
pass the chance that the first proposal is accepted is sum(min(p, q)) over the target's and the
draft's distributions there, so the observed first-position acceptance rate must agree with the
mean of that overlap over the passes (within sampling noise; the standard error is printed).
No timing: the speedup at temperature > 0 is the bench stage's.

    nice -n 19 python benchmarks/bench_sampling.py --target results/target --draft results/draft \
        [--temperatures 0,0.3,0.7,1.0] [--top-p 1.0] [--heldout 8] [--max-new-tokens 48]

Writes benchmarks/results/sampling.json and .md.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def target_origin(target: Path) -> str:
    """Where the target came from (its draftsmith_target.json), else its path."""
    meta = target / "draftsmith_target.json"
    return (
        json.loads(meta.read_text()).get("origin", str(target)) if meta.is_file() else str(target)
    )


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default=str(ROOT / "results" / "target"))
    ap.add_argument("--draft", default=str(ROOT / "results" / "draft"))
    ap.add_argument("--temperatures", default="0,0.3,0.7,1.0")
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--heldout", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--num-steps", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "sampling"))
    return ap.parse_args()


def record_overlaps() -> list[float]:
    """Patch Sampler.verify to record sum(min(p, q)) at the first proposal of every pass."""
    import torch

    from draftsmith.algorithms import sampling

    overlaps: list[float] = []
    real_verify = sampling.Sampler.verify

    def verify(self, logits, q, props):
        p = self.probs(logits)
        overlaps.append(float(torch.minimum(p[0], q[0].to(p.dtype)).sum()))
        return real_verify(self, logits, q, props)

    sampling.Sampler.verify = verify
    return overlaps


def first_position(observed: float, overlaps: list[float]) -> dict:
    """The first position's observed acceptance against its expected value."""
    n = len(overlaps)
    mean = sum(overlaps) / n
    # the first position's acceptance is a Bernoulli per pass with chance overlap_i
    se = math.sqrt(sum(o * (1 - o) for o in overlaps)) / n
    return {
        "observed": observed,
        "expected_mean_overlap": mean,
        "standard_error": se,
        "z": (observed - mean) / se if se else None,
    }


def temperature_entry(args, models, rows, t: float, overlaps: list[float]) -> dict:
    """Speculative decoding of every held-out prompt at temperature t, summarized."""
    from tqdm import tqdm

    from draftsmith.algorithms import sampling
    from draftsmith.bench import specdec
    from draftsmith.data.prompts import prompt_turns

    model, tokenizer, draft, aux_ids, stops = models
    overlaps.clear()
    traces = []
    for i, row in enumerate(tqdm(rows, desc=f"temperature {t:g}", unit="prompt")):
        ids = specdec.prompt_ids(tokenizer, prompt_turns(row))
        s = None if t == 0 else sampling.Sampler.make(t, args.top_p, i, "cpu")
        traces.append(
            specdec.speculative_generate(
                model, draft, ids, args.max_new_tokens, stops, args.num_steps, aux_ids, s
            )
        )
    fig = specdec.summarize(traces)
    entry = {
        "temperature": t,
        "top_p": args.top_p if t else None,
        **{
            key: fig[key]
            for key in (
                "prompts",
                "generated_tokens",
                "verify_passes",
                "tau",
                "tau_sglang",
                "accept_rate_by_pos",
                "accept_len_hist",
            )
        },
    }
    if t:
        entry["first_position"] = first_position(fig["accept_rate_by_pos"][0], overlaps)
    return entry


def render_md(out: dict, top_p: float) -> str:
    """sampling.md from the report (sampling.json) and --top-p."""
    lines = [
        "# tau against the sampling temperature (hf engine, in-process)",
        "",
        f"Draft of run key {out['draft_key']} (draft vocabulary {out['draft_vocab_size']}), "
        f"target `{out['target_origin']}`: "
        f"{out['heldout_prompts']} held-out prompts, {out['max_new_tokens']} new tokens, "
        f"K = {out['num_steps']}, top-p "
        f"{top_p:g} at temperature > 0, seed = prompt index, float32 on CPU "
        f"(`benchmarks/bench_sampling.py`). First-position check: observed acceptance of the "
        "first proposal vs the mean over passes of sum(min(p, q)), its expected value.",
        "",
        "| temperature | passes | tau | tau (SGLang count) | accept rate by position "
        "| accepted-length histogram | first position: observed / expected (z) |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in out["results"]:
        rate = " / ".join("n/a" if v is None else f"{v:.2f}" for v in r["accept_rate_by_pos"])
        fp = r.get("first_position")
        check = (
            "greedy"
            if fp is None
            else f"{fp['observed']:.3f} / {fp['expected_mean_overlap']:.3f} ({fp['z']:+.1f})"
        )
        lines.append(
            f"| {r['temperature']:g} | {r['verify_passes']} | {r['tau']:.3f} | "
            f"{r['tau_sglang']:.3f} | {rate} | {r['accept_len_hist']} | {check} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    args = parse_args()

    import torch
    from snakemake.utils import validate

    from draftsmith.bench import specdec
    from draftsmith.data.prompts import load_sources
    from draftsmith.engines.hf.engine import load_models
    from draftsmith.runtime.files import atomic_write_json, atomic_write_text, set_threads, versions

    set_threads(args.threads)
    cfg: dict = {}
    validate(cfg, str(ROOT / "draftsmith" / "config" / "config.schema.yaml"))
    rows = load_sources(cfg).heldout[: args.heldout]
    model, tokenizer, draft = load_models(
        Path(args.target), Path(args.draft), cfg["target"]["dtype"], "cpu"
    )
    aux_ids = list(draft.config.aux_layer_ids)
    stops = specdec.stop_ids(model, tokenizer)
    models = (model, tokenizer, draft, aux_ids, stops)

    overlaps = record_overlaps()
    results = []
    for t in [float(x) for x in args.temperatures.split(",")]:
        results.append(temperature_entry(args, models, rows, t, overlaps))
        print(json.dumps(results[-1]))
    out = {
        "target": args.target,
        "target_origin": target_origin(Path(args.target)),
        "draft": args.draft,
        "draft_key": json.loads((Path(args.draft) / "draftsmith_draft.json").read_text()).get(
            "key"
        ),
        "draft_vocab_size": draft.config.draft_vocab_size,
        "num_steps": args.num_steps,
        "max_new_tokens": args.max_new_tokens,
        "heldout_prompts": len(rows),
        "threads": args.threads,
        "cpu": torch.backends.cpu.get_cpu_capability(),
        "machine": platform.machine(),
        "versions": versions(),
        "results": results,
    }
    atomic_write_json(Path(args.out + ".json"), out)
    text = render_md(out, args.top_p)
    atomic_write_text(Path(args.out + ".md"), text)
    print(text[:-1])


if __name__ == "__main__":
    main()
