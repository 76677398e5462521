"""bench_storage.py's storage modes and its figures from files: the shards' bytes per token
against SpecForge's layout, the trained runs' spread over seeds, and the report in markdown."""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from draftsmith.hidden.shards import open_shard  # noqa: E402
from draftsmith.hidden.storage import Storage  # noqa: E402
from draftsmith.hidden.writer import estimate_bytes  # noqa: E402

MODES = {
    "bfloat16": Storage(),
    "float8_e4m3": Storage(aux="float8_e4m3"),
    "float8_e4m3+trained": Storage(aux="float8_e4m3", final="trained"),
    "bfloat16+topk32": Storage(final="topk", topk=32),
    "float8_e4m3+topk32": Storage(aux="float8_e4m3", final="topk", topk=32),
    # the teacher's own top-40 over the draft vocabulary, exact, tail kept as one bucket: the
    # largest k within 0.4x here (uint16 draft ids + float16 log-probs + a flag byte)
    "float8_e4m3+topk40-draft": Storage(
        aux="float8_e4m3", final="topk", topk=40, topk_vocab="draft"
    ),
}
DRAFT_TOPK = "float8_e4m3+topk40-draft"
ABLATION = f"{DRAFT_TOPK}-renormalized"  # its shards, the tail dropped and renormalized instead
TRAINED = ("float8_e4m3+topk32", "float8_e4m3", "bfloat16+topk32", DRAFT_TOPK, ABLATION)
KIMI = {"hidden": 7168, "vocab": 163840, "layers": 61}
GOAL = 0.4


# ------------------------------------------------------------------------------------ bytes


def specforge_measured(work: Path) -> dict:
    """SpecForge layout of the reference shards (to-specforge): bytes and per-file overhead."""
    from draftsmith.interop.convert import to_specforge

    out = work / "specforge"
    files, t, r = 0, 0, 0
    for shard_path in sorted((work / "hidden" / "bfloat16").glob("rows_*.safetensors")):
        shard = open_shard(shard_path)
        if not (out / shard_path.stem).exists():
            to_specforge(shard_path, out / shard_path.stem, 2000)
        t, r = t + shard.n_tokens, r + len(shard)
    sizes = [p.stat().st_size for p in out.rglob("*.ckpt")]
    files = len(sizes)
    h = open_shard(next((work / "hidden" / "bfloat16").glob("rows_*.safetensors"))).manifest[
        "hidden_size"
    ]
    payload = t * (4 * h * 2 + 8 + 8)  # bf16 states, int64 input_ids and loss_mask
    return {
        "bytes": sum(sizes),
        "files": files,
        "tokens": t,
        "rows": r,
        "per_file_overhead": (sum(sizes) - payload) / files,
    }


def bytes_table(work: Path, sf: dict, dtype: str) -> dict:
    """Per mode: measured B/token here, computed B/token at Kimi-K2.5's shapes; ratios."""
    rows = {}
    shards = {m: sorted((work / "hidden" / m).glob("rows_*.safetensors")) for m in MODES}
    t = sf["tokens"]
    ref = [open_shard(p) for p in shards["bfloat16"]]
    trained = sum(int(s.trained.sum()) for s in ref)
    h, v = KIMI["hidden"], KIMI["vocab"]
    sf_kimi = t * (4 * h * 2 + 16) + sf["rows"] * sf["per_file_overhead"]
    for m, storage in MODES.items():
        size = sum(p.stat().st_size for p in shards[m])
        kimi = sum(
            estimate_bytes(s.n_tokens, len(s), h, dtype, storage, int(s.trained.sum()), v) - 4096
            for s in ref
        )
        worst = estimate_bytes(t, sf["rows"], h, dtype, storage, t, v) - 4096
        rows[m] = {
            "bytes": size,
            "bytes_per_token": size / t,
            "vs_specforge": size / sf["bytes"],
            "kimi_bytes_per_token": kimi / t,
            "kimi_vs_specforge": kimi / sf_kimi,
            "kimi_vs_specforge_all_trained": worst / (t * (4 * h * 2 + 16)),
        }
    return {
        "modes": rows,
        "specforge": {
            **sf,
            "bytes_per_token": sf["bytes"] / t,
            "kimi_bytes_per_token": sf_kimi / t,
        },
        "trained_positions": trained,
        "trained_fraction": trained / t,
    }


# ------------------------------------------------------------------------------------ runs


def summarize_runs(report: dict, seeds: int) -> None:
    """The bf16 seed-to-seed spread and each mode's tau against it (from the runs so far)."""
    runs = report["runs"]
    taus = [runs[f"bfloat16-seed{s}"]["tau"] for s in range(seeds) if f"bfloat16-seed{s}" in runs]
    report["spread"] = {
        "taus": taus,
        "min": min(taus),
        "max": max(taus),
        "mean": statistics.mean(taus),
        "seeds_done": len(taus),
    }
    report["verdict"] = {}
    lo, hi = min(taus), max(taus)
    for m in TRAINED:
        by_seed = {s: runs[f"{m}-seed{s}"]["tau"] for s in range(seeds) if f"{m}-seed{s}" in runs}
        if 0 in by_seed:
            mode_taus = list(by_seed.values())
            mean = statistics.mean(mode_taus)
            paired = [
                t - runs[f"bfloat16-seed{s}"]["tau"]
                for s, t in by_seed.items()
                if f"bfloat16-seed{s}" in runs
            ]
            report["verdict"][m] = {
                "tau": by_seed[0],
                "taus": mode_taus,
                "seeds": list(by_seed),
                "mean": mean,
                "no_loss": by_seed[0] >= lo,
                "within": lo <= by_seed[0] <= hi,
                "seeds_within": sum(lo <= t <= hi for t in mode_taus),
                "seeds_below": sum(t < lo for t in mode_taus),
                "mean_within": lo <= mean <= hi,
                "paired_diffs": paired,
                "paired_mean": statistics.mean(paired) if paired else None,
            }


# ------------------------------------------------------------------------------------ report


def render_bytes(report: dict) -> list[str]:
    """The heading and the bytes-per-token table."""
    b, cap = report["bytes"], report["capture"]
    sf = b["specforge"]
    lines = [
        "# Shard storage modes (embedded default's rows)",
        "",
        f"`python benchmarks/bench_storage.py --epochs {report['epochs']} --seeds "
        f"{report['seeds']} --threads {report['threads']}`; {cap['tokens']} tokens in "
        f"{len(report['shards'])} shards, {b['trained_positions']} trained positions "
        f"({b['trained_fraction']:.1%}). Load average at start / end: {report['load_start']} / "
        f"{report['load_end']} (other jobs share the 2 cores: read times as ratios).",
        "",
        "## Bytes per token vs SpecForge's layout",
        "",
        f"SpecForge (`to-specforge` of the reference shards, {sf['files']} `.ckpt` files): "
        f"{sf['bytes_per_token']:.0f} B/token measured here (per-file overhead "
        f"{sf['per_file_overhead']:.0f} B); Kimi-K2.5 computed: {sf['kimi_bytes_per_token']:.0f} "
        f"B/token (hidden {KIMI['hidden']}, bf16, int64 ids and mask). Goal: <= {GOAL}x.",
        "",
        "| mode | B/token here | vs SpecForge here | Kimi-K2.5 B/token | vs SpecForge (Kimi) | "
        "Kimi, every token trained |",
        "|---|---|---|---|---|---|",
    ]
    for m, r in b["modes"].items():
        lines.append(
            f"| `{m}` | {r['bytes_per_token']:.0f} | {r['vs_specforge']:.3f} | "
            f"{r['kimi_bytes_per_token']:.0f} | {r['kimi_vs_specforge']:.3f} | "
            f"{r['kimi_vs_specforge_all_trained']:.3f} |"
        )
    return lines


def render_throughput(report: dict) -> list[str]:
    """Capture and read throughput per mode."""
    cap, rd = report["capture"], report["read"]
    first = cap["runs"][0]
    lines = [
        "",
        "## Capture and read throughput",
        "",
        f"Capture: one float32 forward per batch ({first['forward_cpu_s']:.0f} CPU-s, "
        f"{first['forward_wall_s']:.0f} s wall for {cap['tokens']} tokens, {cap['threads']} "
        "threads), the same states written in every mode of that capture run; a mode added "
        "later was captured in a run of its own with the reference beside it, and its cost is "
        "against that run's forward + reference. Read: every row's `aux` + `teacher` "
        "decoded as training reads them (float8 dequantized to float32, top-k expanded to [n, k] "
        "with padding), one torch thread, best of 5, modes interleaved (a later mode: with the "
        "reference, in its own pass); CPU time (wall time under this load is in the JSON).",
        "",
        "| mode | capture run | encode + write CPU-s | capture tokens/CPU-s | capture cost vs "
        "reference | read tokens/CPU-s warm | cold | reference in the same pass, warm / cold |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for m in MODES:
        n_run, run = next((i, r) for i, r in enumerate(cap["runs"]) if m in r["modes"])
        w = run["write_cpu_s"][m]
        cost = run["forward_cpu_s"] + w
        ref_cost = run["forward_cpu_s"] + run["write_cpu_s"]["bfloat16"]
        same = rd[m].get("reference_same_pass", rd["bfloat16"])
        lines.append(
            f"| `{m}` | {n_run + 1} | {w:.1f} | {cap['tokens'] / cost:.0f} | "
            f"{cost / ref_cost:.3f} | {rd[m]['warm_tokens_per_cpu_s']:.0f} | "
            f"{rd[m]['cold_tokens_per_cpu_s']:.0f} | {same['warm_tokens_per_cpu_s']:.0f} / "
            f"{same['cold_tokens_per_cpu_s']:.0f} |"
        )
    return lines


def render_fidelity(report: dict) -> list[str]:
    """Teacher fidelity of the top-k and float8 modes."""
    f = report["fidelity"]
    lines = [
        "",
        "## Teacher fidelity (trained positions)",
        "",
        f"- top-32 (of the full vocabulary, restricted to the {report['draft_vocab']}-token draft "
        f"vocabulary and renormalized): the exact teacher's mass it covers "
        f"{f['topk32_mass_covered']:.4f}, total variation {f['topk32_total_variation_mean']:.4f}, "
        f"KL(top-k || exact) {f['topk32_kl_mean']:.4f} nats, argmax agreement "
        f"{f['topk32_argmax_agreement']:.4f} (means over trained positions)",
        f"- float8 e4m3 aux states: relative RMS error {f['fp8_aux_relative_rms_error']:.4f} "
        "against the bf16 reference",
    ]
    for m, g in f.get("modes", {}).items():
        lines.append(
            f"- `{m}` (the teacher's own top-{g['k']} over the draft vocabulary, exact "
            f"log-probs, the rest as one bucket): mass covered {g['mass_covered']:.4f} (the full "
            f"vocabulary's top-{g['k']} covers {g['full_vocab_topk_mass_covered']:.4f}, "
            f"{g['full_vocab_topk_entries_outside_draft_vocab']:.1f} of its {g['k']} entries "
            f"outside the draft vocabulary), listed probabilities off by "
            f"{g['listed_abs_error']:.1e} in total, tail mass off by "
            f"{g['tail_mass_abs_error']:.1e} (float16 rounding), argmax agreement "
            f"{g['argmax_agreement']:.4f}"
        )
    return lines


def render_runs(report: dict) -> list[str]:
    """The trained runs: held-out tau per run."""
    lines = [
        "",
        "## Held-out tau of a draft trained on each mode",
        "",
        f"Same config (the embedded default, `train.epochs` {report['epochs']}); run `<mode>-seed<s>`"
        " trains with seed s, and the same seed gives every mode the same initialization and "
        "data order (the step count follows the seed's packing); "
        f"{report['runs']['bfloat16-seed0']['prompts']} held-out prompts, K = 4, 64 new "
        "tokens, speculative decoding (lossless, greedy). `-renormalized`: the ablation of the "
        "tail bucket (the draft-vocabulary top-k shards, tail dropped and renormalized).",
        "",
        "| run | steps | held-out tau | accept by position | train acc@0..3 (last 10%) | "
        "train wall s (load varies) |",
        "|---|---|---|---|---|---|",
    ]
    for name, r in report["runs"].items():
        acc = " / ".join(f"{x:.2f}" for x in r["train_acc_last10pct"])
        rate = " / ".join("-" if x is None else f"{x:.2f}" for x in r["accept_rate_by_pos"])
        lines.append(
            f"| {name} | {r['steps']} | {r['tau']:.3f} | {rate} | {acc} | {r['train_seconds']:.0f} |"
        )
    return lines


def render_verdict(report: dict) -> list[str]:
    """Each mode's tau against the bf16 seed-to-seed range, and what is not finished."""
    s = report["spread"]
    lines = [
        "",
        f"bf16 seed-to-seed: tau {', '.join(f'{x:.3f}' for x in s['taus'])}: range "
        f"[{s['min']:.3f}, {s['max']:.3f}], mean {s['mean']:.3f}.",
        "",
        "| mode | tau (seed 0) | seed 0 vs the bf16 seed range | all its seeds (0, 1, ...) | "
        "seeds inside / above / below the range | mean | mean - bf16 mean | mean vs the range | "
        "paired: tau - bf16 tau of the same seed, mean |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for m, v in report["verdict"].items():
        n_in, n_below = v.get("seeds_within", 0), v.get("seeds_below", 0)
        paired = v.get("paired_diffs") or []
        paired_text = ", ".join(f"{x:+.3f}" for x in paired)
        if paired:
            paired_text += f" (mean {v['paired_mean']:+.3f})"
        lines.append(
            f"| `{m}` | {v['tau']:.3f} | "
            f"{'inside' if v['within'] else 'above' if v['no_loss'] else 'below'} | "
            f"{', '.join(f'{x:.3f}' for x in v['taus'])} | {n_in} / "
            f"{len(v['taus']) - n_in - n_below} / {n_below} of "
            f"{len(v['taus'])} | {v['mean']:.3f} | {v['mean'] - s['mean']:+.3f} | "
            f"{'inside' if v.get('mean_within') else 'above' if v['mean'] > s['max'] else 'below'} | "
            f"{paired_text} |"
        )
    ident = report.get("trained_identity")
    if ident:
        lines += [
            "",
            f"`float8_e4m3+trained`: its first {ident['steps']} training losses are "
            f"{'bit-identical' if ident['identical_losses'] else 'NOT identical'} to "
            "`float8_e4m3`'s (same teacher at every trained position), so its tau is that of "
            "`float8_e4m3`.",
        ]
    missing = [m for m in TRAINED if m not in report["verdict"]]
    if missing or report["spread"]["seeds_done"] < report["seeds"]:
        lines += [
            "",
            f"Not finished in this run: {missing} and {report['seeds'] - report['spread']['seeds_done']} reference seeds.",
        ]
    return lines


def render(report: dict) -> str:
    lines = render_bytes(report) + render_throughput(report) + render_fidelity(report)
    lines += render_runs(report) + render_verdict(report)
    lines.append("")
    return "\n".join(lines)
