"""capture.batch_tokens: capture time and stored bytes of real token ranges at several budgets.

    python benchmarks/bench_capture_budget.py --run benchmarks/work/default_run
        [--budgets 1024 2048 4096 8192] [--ranges 2] [--threads 2]

Reads a finished run's target and token files (results/target, results/tokens/*.safetensors),
captures each of the first `--ranges` row ranges with the hf engine at every budget in one
process (the target loaded once; budgets interleaved per range so drift favours none), and
reports per budget: capture seconds (forward and shard writing, the stage's own figure),
padded tokens the forwards computed (the engine's own batching and padding), and how many
stored values differ from the largest budget's shard (bit for bit, per tensor). The aux layers
and the storage dtype are the run's own (each range's shard manifest). The budget only groups
rows; the rows, their padding to a multiple of 16 tokens and the stored dtype are the same.

Writes benchmarks/results/capture_budget_<cpu kind>.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from draftsmith.engines.hf.engine import capture_shard, pad_rows  # noqa: E402
from draftsmith.hidden.capture_base import plan_batches  # noqa: E402
from draftsmith.runtime.hardware import cpu_facts  # noqa: E402


def padded_tokens(tokens: dict, budget: int) -> int:
    """Tokens the forwards compute at `budget`: the engine's own batches, padded as it pads."""
    offsets = tokens["row_offsets"].tolist()
    lengths = [b - a for a, b in zip(offsets, offsets[1:], strict=False)]
    return sum(
        pad_rows(tokens["input_ids"], offsets, rows).numel()
        for rows in plan_batches(lengths, budget)
    )


def differing(a: Path, b: Path) -> dict:
    """Per floating tensor: the fraction of values whose bits differ between two shards."""
    from safetensors.torch import load_file

    x, y = load_file(str(a)), load_file(str(b))
    return {k: float((x[k] != y[k]).float().mean()) for k in x if x[k].is_floating_point()}


def measure(run: Path, budgets: list[int], n_ranges: int, threads: int) -> dict:
    from safetensors.torch import load_file

    from draftsmith.targets.model import load_target

    ranges = sorted((run / "results" / "tokens").glob("rows_*.safetensors"))[:n_ranges]
    if not ranges:
        raise SystemExit(f"{run}: no results/tokens/rows_*.safetensors (run the workflow first)")
    torch.set_num_threads(threads)
    model, _ = load_target(run / "results" / "target", dtype=torch.float32)
    out = {b: {"seconds": 0.0, "tokens": 0, "padded": 0, "differs": {}} for b in budgets}
    with tempfile.TemporaryDirectory() as tmp:
        for i, path in enumerate(ranges):
            tokens = load_file(str(path))
            # the run's own capture: its aux layers and storage dtype, from the shard's manifest
            manifest = json.loads((run / "results" / "hidden" / f"{path.stem}.json").read_text())
            ids, dtype = manifest["aux_layer_ids"], manifest["dtype"]
            order = budgets if i % 2 == 0 else budgets[::-1]
            shards = {}
            for b in order:
                shard = Path(tmp) / str(b) / path.name
                shard.parent.mkdir(exist_ok=True)
                t0 = time.perf_counter()
                capture_shard(model, tokens, shard, ids, dtype, b, {}, progress=False)
                out[b]["seconds"] += time.perf_counter() - t0
                out[b]["tokens"] += int(tokens["input_ids"].numel())
                out[b]["padded"] += padded_tokens(tokens, b)
                shards[b] = shard
            ref = shards[max(budgets)]
            for b in budgets:
                for k, v in differing(shards[b], ref).items():
                    out[b]["differs"][k] = max(out[b]["differs"].get(k, 0.0), v)
    return {"ranges": [p.name for p in ranges], "threads": threads, "storage": dtype,
            "budgets": out}  # fmt: skip


def render(r: dict, kind: str, cpu: str) -> str:
    base = r["budgets"][str(max(int(b) for b in r["budgets"]))]
    lines = [
        f"# capture.batch_tokens on {cpu} ({kind})",
        "",
        f"Ranges {', '.join(r['ranges'])} of the default run, hf engine, float32 forward, "
        f"{r.get('storage', 'bfloat16')} storage, {r['threads']} threads; every budget in one "
        "process. Differing values: "
        "the largest fraction, over the ranges, of a tensor's stored values whose bits differ "
        "from the largest budget's shard.",
        "",
        "| budget | capture s | vs largest | tokens | padded tokens | aux differing | final differing |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for b, f in sorted(r["budgets"].items(), key=lambda kv: int(kv[0])):
        d = f["differs"]
        lines.append(
            f"| {b} | {f['seconds']:.1f} | {f['seconds'] / base['seconds']:.2f}x | {f['tokens']} "
            f"| {f['padded']} | {d.get('aux_hidden_states', 0):.4%} "
            f"| {d.get('last_hidden_states', 0):.4%} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--run", type=Path, default=ROOT / "benchmarks" / "work" / "default_run")
    ap.add_argument("--budgets", type=int, nargs="+", default=[1024, 2048, 4096, 8192])
    ap.add_argument("--ranges", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    args = ap.parse_args(argv)
    facts = cpu_facts()
    r = json.loads(json.dumps(measure(args.run, args.budgets, args.ranges, args.threads)))
    r.update(cpu=facts.model, kind=facts.kind, torch=torch.__version__)
    name = f"capture_budget_{facts.kind}"
    (args.out / f"{name}.json").write_text(json.dumps(r, indent=1) + "\n")
    (args.out / f"{name}.md").write_text(render(r, facts.kind, facts.model))
    print((args.out / f"{name}.md").read_text())


if __name__ == "__main__":
    main()
