"""What one speculative pass costs against its floor: before and after packed verification, and
with the few-query attention.

One process, the embedded target (SmolLM2-135M-Instruct, `results/target`) and a draft of the
default's shape: the trained export at `--draft` when it exists, else a randomly initialised
EAGLE-3 draft built from the target's config as training builds one (one decoder layer, a
`--draft-vocab`-token head; cost does not depend on the weights, acceptance does). The target's
linear layers are routed two ways, as the bench stage does (`draftsmith.engines.hf.bench.
route_linears`): `before`, F.linear or the transposed product at every row count; `after`, the
verification's K + 1 rows may also take oneDNN's prepacked form; `few-query`, `after`'s routes
with the target's attention computed by `draftsmith.engines.hf.attention` (grouped products for
up to 8 queries per row) instead of transformers' sdpa, as the bench stage runs it on a CPU.
Per repetition, the ways alternating (the order flipped every repetition), each of a few fixed chat prompts is decoded
by plain greedy decoding and by chain speculative decoding (K = `--num-steps`), and the pieces
of the floor are timed: one target forward of 1 token and of K + 1 tokens (aux states kept, as
verification does) on the prompt's cache, and the draft's K proposals.

- greedy step: greedy seconds per generated token (prefill amortised, as the bench counts);
- pass: speculative seconds per verification pass; pass_cost = pass / greedy step;
- floor (measured): (forward of K + 1 tokens + K draft proposals) / forward of 1 token;
- floor (bytes): 1 + K c, c = the draft's parameter bytes over the target's (verification
  assumed to cost one step, which a CPU's BLAS does not reach).

Medians over repetitions; every speculative output is compared with greedy token for token and
the accepted lengths of both ways with each other.

    nice -n 10 python benchmarks/bench_pass_cost.py [--target results/target] [--draft results/draft]
        [--num-steps 2] [--reps 5] [--max-new-tokens 48] [--threads 1] [--name STEM]

Writes benchmarks/results/pass_cost_<CPUKIND>.json and .md (`--name` replaces the stem, e.g.
pass_cost_AVX2-capped for a run with the kernels capped).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

PROMPTS = (
    "Explain how a bicycle's gears help a rider climb a hill.",
    "Write a short poem about the sea at night.",
    "What are three tips for learning a new language?",
)
WAYS = ("before", "after", "few-query")


def random_draft(model, vocab: int, aux_ids: list[int]):
    """An EAGLE-3 draft of the default's shape for `model`, random weights, as training builds
    it (DraftConfig.from_target_config; lm_head from the target's rows of its hot tokens)."""
    from draftsmith.algorithms.eagle3.model import DraftConfig, Eagle3Draft

    torch.manual_seed(0)
    cfg = DraftConfig.from_target_config(model.config.to_dict(), vocab, aux_ids)
    draft = Eagle3Draft(cfg).to(model.dtype)
    hot = torch.randperm(cfg.vocab_size)[:vocab].sort().values
    t2d = torch.zeros(cfg.vocab_size, dtype=torch.bool)
    t2d[hot] = True
    draft.set_vocab(hot - torch.arange(vocab), t2d)
    with torch.no_grad():
        draft.lm_head.weight.copy_(model.lm_head.weight[hot])
    return draft.eval()


def load(args):
    """(target, tokenizer, draft, where the draft came from)."""
    from draftsmith.engines.hf.bench import load_models
    from draftsmith.targets.model import load_target

    if (Path(args.draft) / "config.json").exists():
        model, tok, draft = load_models(Path(args.target), Path(args.draft), "float32", "cpu")
        return model, tok, draft, f"export {args.draft}"
    model, tok = load_target(Path(args.target), dtype=torch.float32, device="cpu")
    layers = model.config.num_hidden_layers
    aux = [1, layers // 2 - 1, layers - 4]  # SGLang's default aux layers
    return model, tok, random_draft(model, args.draft_vocab, aux), "random (training's shape)"


def snapshot(model) -> dict:
    """Each linear layer's routed forward (None: F.linear), to reinstall a routing later."""
    return {m: m.__dict__.get("forward") for m in model.modules() if isinstance(m, torch.nn.Linear)}


def install(routing: dict) -> None:
    for m, fwd in routing.items():
        if fwd is None:
            m.__dict__.pop("forward", None)
        else:
            m.__dict__["forward"] = fwd


def routings(model, draft, k: int) -> dict:
    """{way: (target routing, summary)}; the draft routed once (the same every way); the
    few-query way takes `after`'s routes."""
    from draftsmith.engines.hf.bench import route_linears

    out = {}
    for way in WAYS[:2]:
        summary = route_linears(model, draft, k, "cpu", verify_packed=way == "after")
        out[way] = (snapshot(model), summary)
    out["few-query"] = out["after"]
    return out


def set_attention(model, way: str) -> None:
    """The target's attention for `way`: the few-query one, or transformers' sdpa."""
    from draftsmith.engines.hf.attention import use_decode_attention

    if way == "few-query":
        use_decode_attention(model)
    else:
        model.set_attn_implementation("sdpa")


def forward_seconds(model, draft, ids: list[int], k: int, aux_ids: list[int]) -> dict:
    """One target forward of 1 and of k + 1 tokens on the prompt's cache, the draft's k
    proposals: seconds each (best of 3)."""
    from transformers import DynamicCache

    from draftsmith.bench import specdec

    cache = DynamicCache()
    _, aux = specdec.target_forward(model, torch.tensor([ids]), cache, aux_ids, True)
    runner = specdec.draft_runner(draft, model, aux_ids)
    runner.extend(ids[1:] + [ids[-1]], aux)

    def forward(n):
        specdec.target_forward(model, torch.tensor([ids[-n:]]), cache, aux_ids, n == 1)
        cache.crop(-n)

    def propose():
        runner.propose(k)
        runner.cache.truncate(runner.positions)

    out = {}
    for name, fn in (
        ("step", lambda: forward(1)),
        ("verify", lambda: forward(k + 1)),
        ("draft", propose),
    ):
        times = []
        for _ in range(3):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        out[name] = min(times)
    return out


def one_rep(model, tok, draft, args, aux_ids: list[int], ways: list[str], routing: dict) -> dict:
    """{way: {greedy_step, pass, fwd_step, fwd_verify, draft, accepted, identical}} of one
    repetition over every prompt, the ways in the given order."""
    from draftsmith.bench import specdec

    stops = specdec.stop_ids(model, tok)
    k, n = args.num_steps, args.max_new_tokens
    out = {}
    for way in ways:
        install(routing[way][0])
        set_attention(model, way)
        r = dict.fromkeys(("greedy_s", "spec_s", "fwd_step", "fwd_verify", "draft"), 0.0)
        r |= {"tokens": 0, "passes": 0, "accepted": [], "identical": 0}
        for text in PROMPTS:
            ids = specdec.prompt_ids(tok, [{"role": "user", "content": text}])
            t0 = time.perf_counter()
            base = specdec.greedy_generate(model, ids, n, stops)
            t1 = time.perf_counter()
            trace = specdec.speculative_generate(model, draft, ids, n, stops, k, aux_ids)
            t2 = time.perf_counter()
            f = forward_seconds(model, draft, ids, k, aux_ids)
            r["greedy_s"] += t1 - t0
            r["spec_s"] += t2 - t1
            r["fwd_step"] += f["step"]
            r["fwd_verify"] += f["verify"]
            r["draft"] += f["draft"]
            r["tokens"] += len(base)
            r["passes"] += trace.passes
            r["accepted"].append(trace.accepted)
            r["identical"] += trace.tokens == base
        step = r["greedy_s"] / r["tokens"]
        out[way] = {
            "greedy_step_ms": 1e3 * step,
            "pass_ms": 1e3 * r["spec_s"] / r["passes"],
            "pass_cost": r["spec_s"] / r["passes"] / step,
            "verify_cost": r["fwd_verify"] / r["fwd_step"],
            "draft_cost": r["draft"] / r["fwd_step"],
            "floor_measured": (r["fwd_verify"] + r["draft"]) / r["fwd_step"],
            "accepted": r["accepted"],
            "identical": r["identical"],
        }
    return out


def bytes_floor(model, draft, k: int) -> tuple[float, float]:
    """(c, 1 + k c): the draft's parameter bytes per step over the target's (the target's
    input embedding counted once: tied with its lm_head)."""

    def nbytes(m):
        seen = {p.data_ptr(): p.numel() * p.element_size() for p in m.parameters()}
        return sum(seen.values())

    c = nbytes(draft) / nbytes(model)
    return c, 1 + k * c


def medians(reps: list[dict]) -> dict:
    keys = ("greedy_step_ms", "pass_ms", "pass_cost", "verify_cost", "draft_cost", "floor_measured")
    out = {}
    for way in WAYS:
        out[way] = {key: statistics.median(r[way][key] for r in reps) for key in keys}
        out[way]["identical"] = f"{min(r[way]['identical'] for r in reps)}/{len(PROMPTS)}"
    for a, b in (("after", "before"), ("few-query", "after")):
        out[f"{a}_over_{b}".replace("-", "_")] = statistics.median(
            r[a]["pass_cost"] / r[b]["pass_cost"] for r in reps
        )
    out["same_acceptance"] = all(r["after"]["accepted"] == r["before"]["accepted"] for r in reps)
    out["same_acceptance_few_query"] = all(
        r["few-query"]["accepted"] == r["after"]["accepted"] for r in reps
    )
    return out


def render(report: dict) -> str:
    m, f = report["medians"], report["floor_bytes"]
    lines = [
        f"# Speculative pass cost against its floor ({report['cpu_kind']})",
        "",
        f"CPU {report['cpu']}, torch capability {report['capability']}, {report['threads']} "
        f"thread(s), load average {report['load'][0]:.1f} -> {report['load'][1]:.1f} (a shared "
        f"machine: compare ratios, measured interleaved). Target {report['target']}, draft "
        f"{report['draft']}, K = {report['num_steps']}, {len(PROMPTS)} prompts x "
        f"{report['max_new_tokens']} new tokens, median of {report['reps']} repetitions.",
        "",
        "| way | greedy step ms | pass ms | pass cost | verify K+1 | K draft steps "
        "| floor (measured) | identical |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for way in WAYS:
        r = m[way]
        lines.append(
            f"| {way} | {r['greedy_step_ms']:.1f} | {r['pass_ms']:.1f} | {r['pass_cost']:.2f} "
            f"| {r['verify_cost']:.2f} | {r['draft_cost']:.2f} | {r['floor_measured']:.2f} "
            f"| {r['identical']} |"
        )
    lines += [
        "",
        f"after / before pass cost: {m['after_over_before']:.3f} (median of per-repetition "
        f"ratios); accepted lengths identical both ways: {m['same_acceptance']}. few-query / "
        f"after pass cost: {m['few_query_over_after']:.3f}; accepted lengths identical: "
        f"{m['same_acceptance_few_query']}. Floor from "
        f"bytes: 1 + K c = {f['floor']:.3f} (c = {f['c']:.4f}, the draft's bytes over the "
        "target's; it assumes verifying K + 1 tokens costs one step). Costs in greedy steps "
        "(verify, draft, floor: over one target forward of 1 token on the same cache).",
        "",
        f"Target routes before: {report['routes']['before']['target']}. After: "
        f"{report['routes']['after']['target']}.",
    ]
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default=str(ROOT / "results" / "target"))
    ap.add_argument("--draft", default=str(ROOT / "results" / "draft"))
    ap.add_argument("--draft-vocab", type=int, default=4096)
    ap.add_argument("--num-steps", type=int, default=2)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    ap.add_argument("--name", default="", help="results file stem (default pass_cost_<kind>)")
    args = ap.parse_args()

    from draftsmith.runtime.files import atomic_write_json, atomic_write_text, set_threads
    from draftsmith.runtime.hardware import cpu_facts

    set_threads(args.threads)
    facts = cpu_facts()
    print(f"torch cpu capability: {torch.backends.cpu.get_cpu_capability()} ({facts.kind})")
    load_before = os.getloadavg()[0]
    model, tok, draft, where = load(args)
    aux_ids = list(draft.config.aux_layer_ids)
    routing = routings(model, draft, args.num_steps)
    with torch.inference_mode():
        one_rep(model, tok, draft, args, aux_ids, list(WAYS), routing)  # warm-up
        reps = []
        for i in range(args.reps):
            ways = list(WAYS) if i % 2 == 0 else list(reversed(WAYS))
            reps.append(one_rep(model, tok, draft, args, aux_ids, ways, routing))
            print(f"rep {i}: " + ", ".join(f"{w} {reps[-1][w]['pass_cost']:.3f}" for w in WAYS))
    c, floor = bytes_floor(model, draft, args.num_steps)
    report = {
        "cpu_kind": facts.kind,
        "capability": torch.backends.cpu.get_cpu_capability(),
        "cpu": facts.model,
        "threads": torch.get_num_threads(),
        "load": [load_before, os.getloadavg()[0]],
        "target": args.target,
        "draft": where,
        "num_steps": args.num_steps,
        "max_new_tokens": args.max_new_tokens,
        "reps": args.reps,
        "routes": {w: routing[w][1] for w in WAYS},
        "floor_bytes": {"c": c, "floor": floor},
        "medians": medians(reps),
        "repetitions": reps,
    }
    out = Path(args.out) / (args.name or f"pass_cost_{facts.kind}")
    out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_json(out.with_suffix(".json"), report)
    text = render(report)
    atomic_write_text(out.with_suffix(".md"), text)
    print(text)


if __name__ == "__main__":
    main()
