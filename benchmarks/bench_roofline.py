"""This CPU's matmul ceiling at the embedded default's shapes, and the verification pass cost.

Every stage of the embedded default (SmolLM2-135M-Instruct target: hidden 576, intermediate
1536, 9 / 3 heads of 64, 30 layers, vocab 49152; draft vocabulary 4096) spends its time in a
handful of linear layers. This script times each of them, fp32 and bf16, at the row count M
the stage runs them with:

- capture (prefill): M = 512 tokens through the target's projections and its lm_head;
- training: M = 1024 tokens (`train.batch_tokens`) through the draft's projections
  (fc 3H -> H, attention input 2H, MLP) and its 4096-row lm_head;
- decode / verification: M = 1..5 rows (one greedy step, or K = 1..4 drafted tokens plus one)
  through the target's projections and lm_head.

Reported per shape: achieved GFLOP/s (2 M K N / time), its fraction of the peak measured in the
same run (the best of a few large square GEMMs, per dtype), the bf16 / fp32 time ratio, and,
for the decode rows, the weight bytes read per second against a large-copy bandwidth measured
in the same run. Then, where cheap, the verification pass cost: the wall time of one target
forward of K + 1 tokens on a KV cache of `--context` tokens, in units of one greedy step (a
forward of 1 token on the same cache), K = 1..4, on a random-weight model of the default's
shapes (timing does not depend on the weights; nothing is downloaded), or on `--target DIR`.

    nice -n 10 python benchmarks/bench_roofline.py [--threads 2] [--min-time 0.2]
Writes benchmarks/results/roofline.json and roofline.md.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from draftsmith.runtime.files import atomic_write_json, atomic_write_text, set_threads  # noqa: E402

H, I_SIZE, V, K_DRAFT, HEADS, KV, HEAD_DIM, LAYERS = 576, 1536, 49152, 4096, 9, 3, 64, 30
QKV = (HEADS + 2 * KV) * HEAD_DIM  # fused q, k, v output width
TARGET = {  # name -> (in, out) of one target linear layer
    "qkv": (H, QKV),
    "o_proj": (HEADS * HEAD_DIM, H),
    "gate_up": (H, 2 * I_SIZE),
    "down": (I_SIZE, H),
    "lm_head": (H, V),
}
DRAFT = {
    "fc (3H -> H)": (3 * H, H),
    "qkv (2H in)": (2 * H, QKV),
    "gate_up": (H, 2 * I_SIZE),
    "down": (I_SIZE, H),
    "lm_head (draft vocab)": (H, K_DRAFT),
}
STAGES = [("capture", 512, TARGET), ("train", 1024, DRAFT)] + [
    (f"decode M={m}", m, TARGET) for m in range(1, 6)
]
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def timed(fn, min_time: float, clock=time.perf_counter) -> float:
    """Median seconds per call over repeats filling ~min_time (after one warm-up call).

    clock: time.perf_counter (elapsed) or time.process_time (this process's CPU seconds: with
    one thread, a figure that other users' load on a shared machine hardly changes)."""
    fn()
    t0 = clock()
    fn()
    once = max(clock() - t0, 1e-6)
    reps = max(3, min(200, int(min_time / once)))
    times = []
    for _ in range(reps):
        t0 = clock()
        fn()
        times.append(clock() - t0)
    return sorted(times)[len(times) // 2]


def linear_time(m: int, k: int, n: int, dtype, min_time: float, clock=time.perf_counter) -> float:
    x = torch.randn(m, k).to(dtype)
    w = torch.randn(n, k).to(dtype)
    with torch.inference_mode():
        return timed(lambda: F.linear(x, w), min_time, clock)


def peak_gflops(dtype, min_time: float, clock=time.perf_counter) -> float:
    """Best GFLOP/s of large square GEMMs. On a CPU without native bf16 (draftsmith.runtime.hardware)
    the bf16 peak is taken at 1024 only: it is emulated there (~1 GFLOP/s), and a 2048 GEMM
    would take half a minute to say the same."""
    from draftsmith.runtime.hardware import cpu_facts

    slow = dtype == torch.bfloat16 and not cpu_facts().native_bf16
    best = 0.0
    for size in (1024,) if slow else (1024, 2048):
        t = linear_time(size, size, size, dtype, min_time, clock)
        best = max(best, 2 * size**3 / t / 1e9)
    return best


def copy_bandwidth(min_time: float, clock=time.perf_counter) -> float:
    """GB/s of a 256 MiB tensor copy (read + write), a stand-in for memory bandwidth."""
    src = torch.empty(64 * 2**20, dtype=torch.float32).fill_(1.0)
    dst = torch.empty_like(src)
    t = timed(lambda: dst.copy_(src), min_time, clock)
    return 2 * src.numel() * 4 / t / 1e9


def random_target():
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        hidden_size=H,
        intermediate_size=I_SIZE,
        num_attention_heads=HEADS,
        num_key_value_heads=KV,
        head_dim=HEAD_DIM,
        num_hidden_layers=LAYERS,
        vocab_size=V,
        tie_word_embeddings=True,
        max_position_embeddings=8192,
    )
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg).eval()


def pass_costs(model, context: int, max_k: int, min_time: float, clock=time.perf_counter) -> dict:
    """Seconds of one forward of n tokens on a `context`-token cache, n = 1..max_k + 1."""
    from transformers import DynamicCache

    vocab = model.config.vocab_size
    ids = torch.randint(
        0, vocab, (1, context + max_k + 1), generator=torch.Generator().manual_seed(0)
    )
    cache = DynamicCache()
    with torch.inference_mode():
        model(input_ids=ids[:, :context], past_key_values=cache, use_cache=True)

        def step(n):
            model(input_ids=ids[:, context : context + n], past_key_values=cache, use_cache=True)
            cache.crop(-n)  # drop the n tokens just added

        return {n: timed(lambda n=n: step(n), min_time, clock) for n in range(1, max_k + 2)}


def cpu_line(r: dict) -> str:
    """The CPU kind and what bf16 runs on there (draftsmith.runtime.hardware), as results state it."""
    f = r.get("cpu_facts")
    if not f:
        return "capability not recorded"
    bf16 = "native bf16" if f["native_bf16"] else "bf16 emulated, peak at 1024 only"
    return f"kind {f['kind']}, torch capability {f['capability']}, {bf16}"


def render_md(r: dict) -> str:
    lines = [
        "# Roofline: matmul ceiling at the embedded default's shapes",
        "",
        f"CPU: {r['cpu']} ({cpu_line(r)}); {r['threads']} thread(s); torch {r['torch']}; "
        f"{r.get('clock', 'wall')} clock (cpu: this process's CPU seconds), load average "
        f"{r.get('load_average', float('nan')):.1f} (1 min, after the matmuls). Everything below was "
        "measured in one run (`python benchmarks/bench_roofline.py`); the machine may have been "
        "shared, so compare the ratios, which come from the same run, rather than absolute "
        "figures across runs.",
        "",
        f"Peak (best large square GEMM): fp32 {r['peak_gflops']['fp32']:.1f} GFLOP/s, "
        f"bf16 {r['peak_gflops']['bf16']:.1f} GFLOP/s "
        f"(bf16 / fp32 {r['peak_gflops']['bf16'] / r['peak_gflops']['fp32']:.2f}x). "
        f"Copy bandwidth: {r['copy_gb_s']:.1f} GB/s.",
        "",
        "| stage | layer | M x K -> N | fp32 GFLOP/s (% of peak) | bf16 GFLOP/s (% of peak) "
        "| bf16 speedup | fp32 weight GB/s |",
        "|---|---|---|---|---|---|---|",
    ]
    for s in r["shapes"]:
        f32, b16 = s["gflops"]["fp32"], s["gflops"]["bf16"]
        lines.append(
            f"| {s['stage']} | {s['layer']} | {s['m']} x {s['k']} -> {s['n']} "
            f"| {f32:.1f} ({100 * f32 / r['peak_gflops']['fp32']:.0f}%) "
            f"| {b16:.1f} ({100 * b16 / r['peak_gflops']['bf16']:.0f}%) "
            f"| {s['time_s']['fp32'] / s['time_s']['bf16']:.2f}x "
            f"| {s['weight_gb_s_fp32']:.1f} |"
        )
    lines += ["", "Per stage, summed over its layers (time-weighted achieved FLOP/s):", ""]
    lines += ["| stage | fp32 GFLOP/s (% of peak) | bf16 GFLOP/s (% of peak) | bf16 speedup |"]
    lines += ["|---|---|---|---|"]
    for name, st in r["stages"].items():
        lines.append(
            f"| {name} | {st['fp32']:.1f} ({100 * st['fp32'] / r['peak_gflops']['fp32']:.0f}%) "
            f"| {st['bf16']:.1f} ({100 * st['bf16'] / r['peak_gflops']['bf16']:.0f}%) "
            f"| {st['bf16_speedup']:.2f}x |"
        )
    if r.get("pass_cost"):
        pc = r["pass_cost"]
        lines += [
            "",
            f"Verification pass cost ({pc['model']}, fp32, KV cache of {pc['context']} tokens): "
            "one target forward of K + 1 tokens in units of one greedy step (a 1-token forward, "
            f"{1000 * pc['seconds']['1']:.1f} ms).",
            "",
            "| K (drafted tokens) | tokens verified | ms | greedy steps |",
            "|---|---|---|---|",
        ]
        for n, sec in pc["seconds"].items():
            if int(n) > 1:
                lines.append(
                    f"| {int(n) - 1} | {n} | {1000 * sec:.1f} | {sec / pc['seconds']['1']:.2f} |"
                )
        lines += [
            "",
            "Speedup of a chain of K drafted tokens is tau / (pass cost + K draft steps in greedy "
            "steps): with a pass cost c_K, tau must exceed c_K (plus the draft's own cost) for "
            "speculation to win on this CPU.",
        ]
    return "\n".join(lines) + "\n"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--min-time", type=float, default=0.2, help="seconds of repeats per shape")
    ap.add_argument("--context", type=int, default=256, help="KV cache tokens for the pass cost")
    ap.add_argument("--max-k", type=int, default=4)
    ap.add_argument("--target", type=Path, help="an HF model dir (default: random weights)")
    ap.add_argument("--no-pass-cost", action="store_true")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    ap.add_argument(
        "--clock",
        choices=["wall", "cpu"],
        default="wall",
        help="cpu: this process's CPU seconds (use with --threads 1 on a shared machine)",
    )
    return ap.parse_args(argv)


def stage_shapes(min_time: float, clock) -> tuple[list[dict], dict]:
    """Every stage's linear shapes timed in fp32 and bf16: per-shape rows, per-stage GFLOP/s."""
    shapes, stages = [], {}
    for stage, m, layers in STAGES:
        tot = {"fp32": 0.0, "bf16": 0.0}
        flops = 0
        for layer, (k, n) in layers.items():
            t = {d: linear_time(m, k, n, dt, min_time, clock) for d, dt in DTYPES.items()}
            f = 2 * m * k * n
            flops += f
            for d in tot:
                tot[d] += t[d]
            shapes.append(
                {
                    "stage": stage,
                    "layer": layer,
                    "m": m,
                    "k": k,
                    "n": n,
                    "time_s": t,
                    "gflops": {d: f / t[d] / 1e9 for d in t},
                    "weight_gb_s_fp32": k * n * 4 / t["fp32"] / 1e9,
                }
            )
            print(
                f"{stage:12s} {layer:22s} fp32 {f / t['fp32'] / 1e9:7.1f} bf16 "
                f"{f / t['bf16'] / 1e9:7.1f} GFLOP/s",
                flush=True,
            )
        stages[stage] = {
            "fp32": flops / tot["fp32"] / 1e9,
            "bf16": flops / tot["bf16"] / 1e9,
            "bf16_speedup": tot["fp32"] / tot["bf16"],
        }
    return shapes, stages


def pass_cost(args, clock) -> dict:
    """The target's pass cost for 1..max_k + 1 tokens, in seconds and in greedy steps."""
    if args.target:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(args.target, dtype=torch.float32).eval()
        name = str(args.target)
    else:
        model, name = random_target(), "random weights, SmolLM2-135M shapes"
    sec = pass_costs(model, args.context, args.max_k, args.min_time, clock)
    print("pass cost (greedy steps):", {n: round(s / sec[1], 2) for n, s in sec.items()})
    return {
        "model": name,
        "context": args.context,
        "seconds": {str(n): s for n, s in sec.items()},
        "greedy_steps": {str(n): s / sec[1] for n, s in sec.items()},
    }


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    set_threads(args.threads)
    from draftsmith.runtime.hardware import cpu_facts

    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    peak = {d: peak_gflops(t, args.min_time, clock) for d, t in DTYPES.items()}
    shapes, stages = stage_shapes(args.min_time, clock)
    report = {
        "cpu": platform.processor() or platform.machine(),
        "cpu_facts": cpu_facts().as_dict(),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "peak_gflops": peak,
        "clock": args.clock,
        "load_average": os.getloadavg()[0],
        "copy_gb_s": copy_bandwidth(args.min_time, clock),
        "shapes": shapes,
        "stages": stages,
    }
    try:
        report["cpu"] = next(
            ln.split(":", 1)[1].strip()
            for ln in Path("/proc/cpuinfo").read_text().splitlines()
            if ln.startswith("model name")
        )
    except (OSError, StopIteration):
        pass
    if not args.no_pass_cost:
        report["pass_cost"] = pass_cost(args, clock)
    args.out.mkdir(parents=True, exist_ok=True)
    atomic_write_json(args.out / "roofline.json", report)
    atomic_write_text(args.out / "roofline.md", render_md(report))
    print(f"wrote {args.out / 'roofline.md'}")


if __name__ == "__main__":
    main()
