"""Speedup against the number of draft tokens K: which `bench.num_steps` pays on this machine.

One process, one target, one trained draft: every prompt of the set is decoded once by plain
greedy decoding and once by chain speculative decoding at each K (the order rotated from
prompt to prompt, so load drift favours no K), all timed with the warm-up excluded. Per K it
reports tau, the acceptance by position, the pass cost (one speculative pass in greedy steps)
split into the draft's part (chain proposals and the extension over accepted tokens) and the
target's verification forward, and the speedup over the same greedy runs. Every output is
compared with greedy's token for token. As the bench stage does on a CPU, the target takes the
few-query attention and each linear layer its measured form, for every K's verification rows
(draftsmith.engines.hf.bench.cpu_forms).

    nice -n 10 python benchmarks/bench_num_steps.py --target results/target --draft results/draft \
        [--num-steps 1,2,3,4] [--heldout 16] [--max-new-tokens 64] [--threads 2] [--config cfg.yaml]

The held-out set is the workflow's (`data` section of the schema defaults, or of --config), so a
draft is measured on rows it never trained on. Writes benchmarks/results/num_steps_<CPU kind>.json and .md.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import platform
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def full_config(path: str | None) -> dict:
    """The workflow's config with every schema default filled in (as Snakemake validates it)."""
    import yaml
    from snakemake.utils import validate

    cfg = yaml.safe_load(Path(path).read_text()) if path else {}
    validate(cfg, str(ROOT / "draftsmith" / "config" / "config.schema.yaml"))
    return cfg


class Timers:
    """Wall time of the draft's and the target's calls inside speculative_generate."""

    def __init__(self, clock):
        self.clock = clock
        self.seconds = {"draft": 0.0, "verify": 0.0, "prefill": 0.0}

    def wrap(self, name_of, fn):
        def timed(*args, **kwargs):
            t0 = self.clock()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[name_of(args, kwargs)] += self.clock() - t0

        return timed


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default=str(ROOT / "results" / "target"))
    ap.add_argument("--draft", default=str(ROOT / "results" / "draft"))
    ap.add_argument("--config", help="workflow config (default: the schema defaults)")
    ap.add_argument("--num-steps", default="1,2,3,4")
    ap.add_argument("--heldout", type=int, default=16)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument(
        "--clock",
        choices=["wall", "cpu"],
        default="wall",
        help="cpu: this process's CPU seconds (time.process_time), with --threads 1 a cost "
        "that other users' load hardly changes (a shared machine); wall: elapsed seconds",
    )
    ap.add_argument(
        "--out", help="results path without suffix (default benchmarks/results/num_steps_<kind>)"
    )
    return ap.parse_args()


def install_timers(ks: list[int], clock) -> tuple[dict, dict]:
    """Wrap the target forward and the draft's propose/extend so each K's calls are timed.

    Returns the Timers per K and the dict whose "k" names the K being decoded."""
    from draftsmith.algorithms.eagle3 import decode
    from draftsmith.bench import specdec

    timers = {k: Timers(clock) for k in ks}
    current = {"k": ks[0]}
    real_forward, real_propose, real_extend = (
        specdec.target_forward,
        decode.DraftRunner.propose,
        decode.DraftRunner.extend,
    )

    def phase_of_forward(a, kw):
        return "verify" if a[1].shape[1] == current["k"] + 1 else "prefill"

    def forward(*a, **kw):
        return timers[current["k"]].wrap(phase_of_forward, real_forward)(*a, **kw)

    def propose(*a, **kw):
        return timers[current["k"]].wrap(lambda *_: "draft", real_propose)(*a, **kw)

    def extend(*a, **kw):
        return timers[current["k"]].wrap(lambda *_: "draft", real_extend)(*a, **kw)

    specdec.target_forward, decode.DraftRunner.propose, decode.DraftRunner.extend = (
        forward,
        propose,
        extend,
    )
    return timers, current


def decode_all(args, cfg: dict, clock, ks: list[int], rows: list) -> dict:
    """Greedy and every K on each prompt (order rotated), warm-up excluded: seconds, traces."""
    from tqdm import tqdm

    from draftsmith.bench import specdec
    from draftsmith.data.prompts import prompt_turns
    from draftsmith.engines.hf.bench import cpu_forms
    from draftsmith.engines.hf.engine import load_models

    model, tokenizer, draft = load_models(
        Path(args.target), Path(args.draft), cfg["target"]["dtype"], "cpu"
    )
    aux_ids = list(draft.config.aux_layer_ids)
    routes = cpu_forms(model, draft, ks, "cpu")
    stops = specdec.stop_ids(model, tokenizer)
    timers, current = install_timers(ks, clock)

    def spec(ids, k, n=args.max_new_tokens):
        current["k"] = k
        return specdec.speculative_generate(model, draft, ids, n, stops, k, aux_ids)

    warm = specdec.prompt_ids(tokenizer, prompt_turns(rows[0]))
    for k in ks:
        spec(warm, k, 16)
    specdec.greedy_generate(model, warm, 16, stops)
    for t in timers.values():
        t.seconds = dict.fromkeys(t.seconds, 0.0)

    load_before = os.getloadavg()[0]
    names = ["greedy", *ks]
    seconds = dict.fromkeys(names, 0.0)
    traces = {k: [] for k in ks}
    greedy_out, greedy_tokens = [], 0
    for i, row in enumerate(tqdm(rows, desc="prompts", unit="prompt")):
        ids = specdec.prompt_ids(tokenizer, prompt_turns(row))
        order = names[i % len(names) :] + names[: i % len(names)]
        for name in order:
            t0 = clock()
            if name == "greedy":
                out = specdec.greedy_generate(model, ids, args.max_new_tokens, stops)
                greedy_out.append(out)
                greedy_tokens += len(out)
            else:
                traces[name].append(spec(ids, name))
            seconds[name] += clock() - t0
    return {
        "timers": timers,
        "routes": routes,
        "load_before": load_before,
        "seconds": seconds,
        "traces": traces,
        "greedy_out": greedy_out,
        "greedy_tps": greedy_tokens / seconds["greedy"],
    }


def k_results(ks: list[int], run: dict) -> list[dict]:
    """Per K: tau, acceptance, speedup and the pass cost split, in greedy steps."""
    from draftsmith.bench import specdec

    seconds, traces, greedy_tps = run["seconds"], run["traces"], run["greedy_tps"]
    results = []
    for k in ks:
        s = specdec.summarize(traces[k])
        passes = s["verify_passes"]
        split = run["timers"][k].seconds
        tps = s["generated_tokens"] / seconds[k]
        results.append(
            {
                "num_steps": k,
                "tau": s["tau"],
                "tau_sglang": s["tau_sglang"],
                "accept_rate_by_pos": s["accept_rate_by_pos"],
                "verify_passes": passes,
                "spec_tokens_per_s": tps,
                "speedup": tps / greedy_tps,
                "pass_cost": seconds[k] / passes * greedy_tps,
                "draft_cost": split["draft"] / passes * greedy_tps,
                "verify_cost": split["verify"] / passes * greedy_tps,
                "identical_outputs": sum(
                    t.tokens == g for t, g in zip(traces[k], run["greedy_out"], strict=True)
                ),
            }
        )
    return results


def kind_name(report: dict) -> str:
    """The CPU kind the kernels ran at: torch's, `-capped` where the environment capped them."""
    return report["cpu_kind"] + ("-capped" if report.get("kernel_caps") else "")


def render_md(report: dict) -> str:
    """num_steps.md from the report (num_steps.json)."""
    load_before, load_after = report["load_average"]
    lines = [
        "# Speedup against the number of draft tokens K (hf engine, chain, greedy)"
        + (f" ({kind_name(report)})" if report.get("cpu_kind") else ""),
        "",
        (f"CPU {report['cpu']} (torch kind {report['cpu_kind']}). " if report.get("cpu") else "")
        + f"{report['prompts']} held-out prompts, {report['max_new_tokens']} new tokens, "
        f"{report['threads']} threads, {report['clock']} clock, load average "
        f"{load_before:.1f} -> {load_after:.1f}; greedy "
        f"{report['greedy_tokens_per_s']:.1f} tok/s in the same run. "
        "Costs in greedy decoding steps per speculative pass (draft = chain + extension, "
        "verify = the target's forward of K + 1 tokens).",
        "",
    ]
    caps = report.get("kernel_caps")
    if report.get("omp") or caps:
        words = [f"Waiting: {report['omp']}."] if report.get("omp") else []
        if caps:
            words.append("Kernels capped: " + ", ".join(f"{k}={v}" for k, v in caps.items()) + ".")
        lines += [" ".join(words), ""]
    lines += [
        "| K | tau | tau (SGLang count) | accept rate by position | pass cost | draft | verify "
        "| tok/s | speedup | identical |",
        "|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in report["results"]:
        rates = " / ".join("-" if v is None else f"{v:.2f}" for v in r["accept_rate_by_pos"])
        lines.append(
            f"| {r['num_steps']} | {r['tau']:.3f} | {r['tau_sglang']:.3f} | {rates} "
            f"| {r['pass_cost']:.2f} | {r['draft_cost']:.2f} | {r['verify_cost']:.2f} "
            f"| {r['spec_tokens_per_s']:.1f} | {r['speedup']:.2f}x "
            f"| {r['identical_outputs']}/{report['prompts']} |"
        )
    routes = report.get("linear_routes")
    if routes:
        lines += [
            "",
            f"Linear layers, measured: target {routes['target']}; draft {routes['draft']}.",
        ]
    return "\n".join(lines) + "\n"


CAPS = ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS")


def main() -> None:
    args = parse_args()
    # libgomp's wait policy as a bench job gets it (draftsmith/runtime/threads.py): chosen when
    # the package is imported, before torch loads libgomp; the caller's own setting wins
    os.environ.setdefault("DRAFTSMITH_OMP", "auto")
    importlib.import_module("draftsmith")
    import torch

    from draftsmith.data.prompts import load_sources
    from draftsmith.runtime.files import atomic_write_json, atomic_write_text, set_threads, versions
    from draftsmith.runtime.hardware import cpu_facts
    from draftsmith.runtime.threads import policy_note

    facts = cpu_facts()

    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    set_threads(args.threads)
    ks = [int(k) for k in args.num_steps.split(",")]
    cfg = full_config(args.config)
    rows = load_sources(cfg).heldout[: args.heldout]
    run = decode_all(args, cfg, clock, ks, rows)
    report = {
        "target": args.target,
        "draft": args.draft,
        "draft_training": json.loads((Path(args.draft) / "config.json").read_text()).get(
            "draftsmith", {}
        ),
        "prompts": len(rows),
        "max_new_tokens": args.max_new_tokens,
        "threads": torch.get_num_threads(),
        "clock": args.clock,
        "greedy_tokens_per_s": run["greedy_tps"],
        "load_average": [run["load_before"], os.getloadavg()[0]],
        "machine": platform.processor() or platform.machine(),
        "cpu": facts.model,
        "cpu_kind": facts.kind,
        "versions": versions(),
        "linear_routes": run["routes"],
        "omp": policy_note() or "libgomp's settings as the environment has them",
        "kernel_caps": {k: os.environ[k] for k in CAPS if k in os.environ},
        "results": k_results(ks, run),
    }
    out = Path(args.out or ROOT / "benchmarks" / "results" / f"num_steps_{kind_name(report)}")
    out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_json(out.with_suffix(".json"), report)
    text = render_md(report)
    atomic_write_text(out.with_suffix(".md"), text)
    print(text[:-1])


if __name__ == "__main__":
    main()
