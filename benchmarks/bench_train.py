"""Training throughput and peak memory at the embedded default's shapes (SmolLM2-135M target).

Random shard data of the real shapes: H=576, 9 heads / 3 KV heads, head_dim 64, intermediate
1536, target vocab 49152, draft vocab 4096, rows of 60-400 tokens with assistant tails.
Runs `draftsmith.train.loop.train` for a few optimizer steps per setting, reads the tokens/s and
peak RSS it logs, and reports each against the baseline measured in the same run (ttt_steps=7
in fp32, the CPU default), next to bf16 autocast and ttt_steps=1 (no unroll). Also times the one-off teacher argmax
pass (full-vocabulary logits in chunks).

    python benchmarks/bench_train.py [--steps 4] [--threads 2]
Writes benchmarks/results/train.json and train.md.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from draftsmith.config.settings import job as job_settings  # noqa: E402
from draftsmith.hidden.writer import ShardWriter  # noqa: E402
from draftsmith.runtime.files import (  # noqa: E402
    atomic_write_json,
    atomic_write_text,
    merge_run,
    set_threads,
)
from draftsmith.train.loop import recorded, train  # noqa: E402

H, V, K, LAYERS, I_SIZE = 576, 49152, 4096, 30, 1536
IDS = [1, 14, 26]


def make_inputs(root: Path, tokens: int, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    target = root / "target"
    target.mkdir(parents=True)
    cfg = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": H,
        "intermediate_size": I_SIZE,
        "num_attention_heads": 9,
        "num_key_value_heads": 3,
        "head_dim": 64,
        "num_hidden_layers": LAYERS,
        "vocab_size": V,
        "rms_norm_eps": 1e-5,
        "rope_parameters": {"rope_theta": 100000.0, "rope_type": "default"},
        "max_position_embeddings": 8192,
        "hidden_act": "silu",
        "tie_word_embeddings": True,
    }
    (target / "config.json").write_text(json.dumps(cfg))
    embed = torch.randn(V, H, generator=g) * 0.05
    save_file(
        {"model.embed_tokens.weight": embed, "model.norm.weight": torch.ones(H)},
        str(target / "model.safetensors"),
    )
    hot = torch.arange(K) * (V // K)
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[hot] = True
    save_file(
        {"d2t": hot - torch.arange(K), "t2d": t2d, "counts": torch.ones(K, dtype=torch.long)},
        str(root / "vocab.safetensors"),
    )
    lengths = []
    while sum(lengths) < tokens:
        lengths.append(int(torch.randint(60, 400, (1,), generator=g)))
    n = sum(lengths)
    offsets = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    ids = hot[torch.randint(0, K, (n,), generator=g)]
    mask = torch.zeros(n, dtype=torch.uint8)
    for a, b in zip(offsets[:-1].tolist(), offsets[1:].tolist(), strict=True):
        mask[a + (b - a) // 3 : b] = 1
    last = embed[ids] * 20 + torch.randn(n, H, generator=g)
    aux = torch.randn(n, 3 * H, generator=g).to(torch.bfloat16)
    path = root / "hidden" / f"rows_000000-{len(lengths):06d}.safetensors"
    path.parent.mkdir()
    with ShardWriter(
        path,
        input_ids=ids,
        loss_mask=mask,
        row_offsets=offsets,
        hidden_size=H,
        dtype="bfloat16",
        manifest={"aux_layer_ids": IDS},
    ) as w:
        w.write(0, aux, last.to(torch.bfloat16))
    return {"target": target, "vocab": root / "vocab.safetensors", "shards": [path]}


def run(
    inputs: dict,
    root: Path,
    name: str,
    steps: int,
    ttt: int,
    precision: str,
    batch_tokens: int = 2048,
) -> dict:
    cfg = {
        "train": {
            "role": "cpu",
            "ttt_steps": ttt,
            "epochs": 1,
            "lr": 3e-4,
            "warmup_ratio": 0.05,
            "batch_tokens": batch_tokens,
            "max_steps": steps,
            "seed": 0,
            "checkpoint_every": 0,
            "checkpoint_seconds": 0,
            "noise_std": 0.0,
            "nproc": 1,
            "precision": precision,
        },
        "draft": {"vocab_size": K, "init_from_target": True},
        "capture": {"aux_layer_ids": IDS},
    }
    out = root / name
    t0 = time.perf_counter()
    train(
        recorded(job_settings(merge_run(cfg, sections=("train",)), ("train", "draft", "capture"))),
        inputs["shards"],
        inputs["vocab"],
        inputs["target"],
        out / "draft",
        out / "metrics.jsonl",
        root / "state",
    )
    wall = time.perf_counter() - t0
    recs = [json.loads(ln) for ln in (out / "metrics.jsonl").read_text().splitlines()]
    timed = recs[1:] or recs  # the first step warms up allocators
    tok = sum(r["tokens"] for r in timed)
    secs = sum(r["tokens"] / r["tokens_per_s"] for r in timed)
    return {
        "name": name,
        "ttt_steps": ttt,
        "precision": precision,
        "steps": len(recs),
        "tokens_per_s": tok / secs,
        "s_per_step": secs / len(timed),
        "peak_rss_mb": max(r["peak_rss_mb"] for r in recs),
        "wall_s": wall,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=12000, help="tokens of random shard data")
    args = ap.parse_args()
    set_threads(args.threads)
    load_start = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        inputs = make_inputs(root, args.tokens)
        t0 = time.perf_counter()
        from draftsmith.algorithms.batches import teacher_argmax_in_vocab
        from draftsmith.hidden.shards import open_shard
        from draftsmith.train.loop import target_tensors

        shard = open_shard(inputs["shards"][0])
        heads = target_tensors(inputs["target"])
        t2d = torch.zeros(V, dtype=torch.bool)
        need = torch.zeros(shard.n_tokens, dtype=torch.bool)
        need[:-1] = shard.loss_mask[1:].bool()
        teacher_argmax_in_vocab(shard.last_hidden_states, heads["lm_head"], t2d, need)
        teacher_s = time.perf_counter() - t0
        base = run(inputs, root, "ttt7-fp32", args.steps, 7, "fp32")
        results = [
            base,
            run(inputs, root, "ttt7-bf16", args.steps, 7, "bf16"),
            run(inputs, root, "ttt1-fp32", args.steps, 1, "fp32"),
        ]
    for r in results:
        r["speed_vs_baseline"] = r["tokens_per_s"] / base["tokens_per_s"]
    report = {
        "bench": "train",
        "threads": args.threads,
        "load_average_at_start": load_start,
        "load_average_at_end": os.getloadavg()[0],
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY", "unset (libgomp default: spin)"),
        "device": "cpu",
        "shapes": {
            "hidden": H,
            "heads": 9,
            "kv_heads": 3,
            "head_dim": 64,
            "intermediate": I_SIZE,
            "target_vocab": V,
            "draft_vocab": K,
        },
        "teacher_argmax_tokens_per_s": int(need.sum()) / teacher_s,
        "runs": results,
        "note": "peak_rss_mb is the process maximum so far, so later runs include earlier peaks",
    }
    out = ROOT / "benchmarks" / "results"
    atomic_write_json(out / "train.json", report)
    lines = [
        "# Training throughput (CPU, embedded-default shapes)",
        "",
        f"threads: {args.threads}; teacher argmax pass: "
        f"{report['teacher_argmax_tokens_per_s']:.0f} needed tokens/s; "
        f"1-min load average at start/end: {load_start:.1f}/{report['load_average_at_end']:.1f} "
        "(other jobs on the same cores slow every row alike); "
        f"OMP_WAIT_POLICY: {report['omp_wait_policy']}",
        "",
        "baseline: ttt_steps 7, fp32 (the CPU default); batch_tokens 2048",
        "",
        "| run | tokens/s | s/step | peak RSS MB | speed vs baseline |",
        "|---|---|---|---|---|",
    ]
    for r in results:
        lines.append(
            f"| {r['name']} | {r['tokens_per_s']:.0f} | {r['s_per_step']:.2f} | "
            f"{r['peak_rss_mb']:.0f} | {r['speed_vs_baseline']:.2f} |"
        )
    atomic_write_text(out / "train.md", "\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
