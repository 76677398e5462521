"""Capture backend `hf`: the target's prefill over one row range, written as a shard.

For every token the shard holds the three aux states (SGLang's "output of decoder layer i"
ids: the residual stream leaving layer i, un-normalized, i.e. transformers'
`output_hidden_states[i + 1]`) and the final post-norm state (the input of the lm_head).
Forward hooks on exactly the decoder layers named by the ids grab their outputs, and the base
model's `last_hidden_state` (the final norm's output) is the post-norm state, so neither all N
layers' states nor the vocabulary-sized logits are ever materialized.

Rows are sorted by length and batched up to `capture.batch_tokens` (padded rows x longest row).
Padding goes on the right and no attention mask is passed: attention is causal, so a real token
only sees earlier real tokens and its states equal an unpadded forward's.

    python -m draftsmith.capture --cfg '{"capture": {...}, "target": {...}}' \\
        --tokens results/tokens/rows_000000-000128.safetensors --target results/target \\
        --out results/hidden/rows_000000-000128.safetensors --threads 2
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
from tqdm import tqdm

from draftsmith.common import init_logging, parse_cfg, set_threads, versions
from draftsmith.config import aux_layer_ids, parse_range
from draftsmith.shards import STORAGE_DTYPES, ShardError, ShardWriter


class CaptureError(ValueError):
    """Inputs the capture cannot use; the message names the file or key."""


def read_tokens(path: str | Path) -> dict[str, torch.Tensor]:
    """The data stage's token file: input_ids [T] int64, loss_mask [T] uint8, row_offsets [R+1]."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        t = load_file(str(path))
    except (SafetensorError, OSError) as e:
        raise CaptureError(f"{path}: cannot read token file ({e})") from None
    missing = {"input_ids", "loss_mask", "row_offsets"} - set(t)
    if missing:
        raise CaptureError(f"{path}: token file lacks {sorted(missing)}")
    ids, mask, ro = t["input_ids"], t["loss_mask"], t["row_offsets"]
    if ids.dim() != 1 or mask.shape != ids.shape:
        raise CaptureError(f"{path}: input_ids {list(ids.shape)} / loss_mask {list(mask.shape)}")
    if ro.dim() != 1 or int(ro[0]) != 0 or int(ro[-1]) != ids.numel() or (ro[1:] <= ro[:-1]).any():
        raise CaptureError(f"{path}: row_offsets must rise strictly from 0 to {ids.numel()}")
    return {"input_ids": ids.long(), "loss_mask": mask.to(torch.uint8), "row_offsets": ro.long()}


def decoder_parts(model) -> tuple[torch.nn.Module, torch.nn.ModuleList]:
    """(base model, its decoder layers) of a transformers causal LM (Llama, DeepSeek-V3, ...)."""
    base = getattr(model, "model", None)
    layers = getattr(base, "layers", None)
    if base is None or not isinstance(layers, torch.nn.ModuleList) or not hasattr(base, "norm"):
        raise CaptureError(
            f"{type(model).__name__}: expected .model.layers and .model.norm (a decoder-only LM)"
        )
    return base, layers


def plan_batches(lengths: list[int], batch_tokens: int) -> list[list[int]]:
    """Row indices grouped longest first so that len(group) * longest <= batch_tokens.

    A row longer than the budget forms a batch of its own.
    """
    order = sorted(range(len(lengths)), key=lambda r: (-lengths[r], r))
    batches: list[list[int]] = []
    for r in order:
        if batches and (len(batches[-1]) + 1) * lengths[batches[-1][0]] <= batch_tokens:
            batches[-1].append(r)
        else:
            batches.append([r])
    return batches


def pad_rows(input_ids: torch.Tensor, offsets: list[int], rows: list[int]) -> torch.Tensor:
    """[B, L] right-padded token ids (pad id 0: padded positions are never stored)."""
    longest = max(offsets[r + 1] - offsets[r] for r in rows)
    batch = torch.zeros(len(rows), longest, dtype=torch.long)
    for b, r in enumerate(rows):
        a, e = offsets[r], offsets[r + 1]
        batch[b, : e - a] = input_ids[a:e]
    return batch


@torch.inference_mode()
def forward_states(model, batch: torch.Tensor, ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """aux [B, L, 3H] (outputs of layers `ids`, in order) and last [B, L, H] (post-norm)."""
    base, layers = decoder_parts(model)
    grabbed: dict[int, torch.Tensor] = {}

    def grab(i):
        def hook(_module, _inputs, output):
            grabbed[i] = output[0] if isinstance(output, tuple) else output

        return hook

    handles = [layers[i].register_forward_hook(grab(i)) for i in sorted(set(ids))]
    try:
        out = base(input_ids=batch.to(base.device), use_cache=False)
    finally:
        for h in handles:
            h.remove()
    aux = torch.cat([grabbed[i] for i in ids], dim=-1)
    return aux, out.last_hidden_state


def capture_shard(
    model,
    tokens: dict[str, torch.Tensor],
    out: str | Path,
    ids: list[int],
    dtype: str,
    batch_tokens: int,
    manifest: dict,
    progress: bool = True,
) -> dict:
    """Run the prefill over every row of `tokens` and write the shard at `out`; return the manifest."""
    hidden = int(model.config.get_text_config().hidden_size)
    offsets = tokens["row_offsets"].tolist()
    lengths = [b - a for a, b in zip(offsets, offsets[1:], strict=False)]
    batches = plan_batches(lengths, batch_tokens)
    t0 = time.perf_counter()
    with ShardWriter(
        out,
        input_ids=tokens["input_ids"],
        loss_mask=tokens["loss_mask"],
        row_offsets=tokens["row_offsets"],
        hidden_size=hidden,
        dtype=dtype,
        manifest={**manifest, "aux_layer_ids": list(ids), "backend": "hf"},
    ) as writer:
        for rows in tqdm(batches, desc=Path(out).stem, unit="batch", disable=not progress):
            aux, last = forward_states(model, pad_rows(tokens["input_ids"], offsets, rows), ids)
            for b, r in enumerate(rows):
                n = lengths[r]
                writer.write(offsets[r], aux[b, :n], last[b, :n])
        writer.manifest["capture_seconds"] = round(time.perf_counter() - t0, 3)
        writer.manifest["batches"] = len(batches)
    return writer.manifest


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m draftsmith.capture", description=__doc__)
    ap.add_argument("--cfg", required=True, help="JSON with the `capture` and `target` sections")
    ap.add_argument(
        "--tokens", type=Path, required=True, help="results/tokens/rows_<a>-<b>.safetensors"
    )
    ap.add_argument("--target", type=Path, required=True, help="the target HF dir (results/target)")
    ap.add_argument(
        "--out", type=Path, required=True, help="results/hidden/rows_<a>-<b>.safetensors"
    )
    ap.add_argument("--threads", type=int, default=0)
    args = ap.parse_args(argv)
    log = init_logging("draftsmith.capture")
    cfg = parse_cfg(args.cfg)
    if "capture" not in cfg:
        raise SystemExit("--cfg has no `capture` section")
    cap = cfg["capture"]
    if cap.get("backend", "hf") != "hf":
        raise SystemExit(f"capture.backend {cap['backend']!r}: this command implements only 'hf'")
    dtype = cap.get("dtype", "bfloat16")
    if dtype not in STORAGE_DTYPES:
        raise SystemExit(f"capture.dtype {dtype!r} is not one of {list(STORAGE_DTYPES)}")
    set_threads(args.threads)
    from draftsmith import target as tgt

    try:
        a, b = parse_range(args.out.stem)
        tokens = read_tokens(args.tokens)
        n_rows = tokens["row_offsets"].numel() - 1
        if n_rows != b - a:
            raise CaptureError(
                f"{args.tokens}: {n_rows} rows, but range {args.out.stem} has {b - a}"
            )
        n_layers = int(tgt.target_config(args.target)["num_hidden_layers"])
        ids = aux_layer_ids(cap.get("aux_layer_ids", "auto"), n_layers)
        fp = tgt.fingerprint(args.target)
        torch_dtype = getattr(torch, cfg.get("target", {}).get("dtype", "float32"))
        model, _ = tgt.load_target(args.target, dtype=torch_dtype)
        log.info(
            "%s: %d rows, %d tokens, aux ids %s of %d layers, storage %s",
            args.out.stem,
            n_rows,
            tokens["input_ids"].numel(),
            ids,
            n_layers,
            dtype,
        )
        manifest = capture_shard(
            model,
            tokens,
            args.out,
            ids,
            dtype,
            int(cap.get("batch_tokens", 8192)),
            manifest={
                "row_range": [a, b],
                "target_fingerprint": fp,
                "target_layers": n_layers,
                "forward_dtype": str(torch_dtype).removeprefix("torch."),
                "tokens_file": str(args.tokens),
                "versions": versions(),
            },
        )
    except (CaptureError, ShardError, ValueError) as e:
        raise SystemExit(f"error: {e}") from None
    log.info(
        "wrote %s (%d tokens, %.1f s, sha256 %s)",
        args.out,
        manifest["tokens"],
        manifest["capture_seconds"],
        manifest["sha256"][:16],
    )


if __name__ == "__main__":
    main()
