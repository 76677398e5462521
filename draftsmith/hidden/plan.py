"""Disk estimate for the hidden-state shards, before any capture runs.

Reads only the token files (their headers; for the compact storage modes also loss_mask and
row_offsets, to count trained positions) and the target's config.json (hidden size, layer
count, vocabulary), so it costs milliseconds even for a 1T-parameter target:

    python -m draftsmith plan --cfg '{"capture": {...}}' --target results/target \\
        --out results/hidden/plan.json results/tokens/rows_*.safetensors

Prints bytes per token in the configured storage mode (`capture.storage`), the total the
shards will take, what is already built, and the free space where they go; fails when the
shards still to build do not fit.
"""

from __future__ import annotations

import json
import shutil
import struct
import sys
from pathlib import Path

from draftsmith.config.checks import aux_layer_count, range_name
from draftsmith.runtime.files import atomic_write_json, command_parser, parse_cfg


class PlanError(ValueError):
    """A token file or target config the plan cannot read; the message names it."""


def token_counts(path: Path) -> tuple[int, int]:
    """(rows, tokens) of a token file, from its safetensors header alone."""
    try:
        with open(path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(n))
    except (OSError, struct.error, json.JSONDecodeError, UnicodeDecodeError) as e:
        raise PlanError(f"{path}: not a readable safetensors token file ({e})") from None
    try:
        return header["row_offsets"]["shape"][0] - 1, header["input_ids"]["shape"][0]
    except KeyError as e:
        raise PlanError(f"{path}: token file lacks tensor {e}") from None


def trained_count(path: Path) -> int:
    """Trained positions of a token file (what the compact storage modes store a teacher for)."""
    from safetensors import safe_open

    from draftsmith.hidden.storage import trained_mask

    try:
        with safe_open(str(path), "pt") as f:
            return int(trained_mask(f.get_tensor("loss_mask"), f.get_tensor("row_offsets")).sum())
    except Exception as e:  # noqa: BLE001 - safetensors raises several unrelated types
        raise PlanError(f"{path}: cannot read loss_mask/row_offsets ({e})") from None


def shard_bytes(
    rows: int,
    tokens: int,
    hidden: int,
    dtype: str,
    storage=None,
    trained=None,
    vocab=None,
    n_aux: int = 3,
) -> int:
    """Bytes of one shard in a storage mode (a 4 KiB header allowance included)."""
    from draftsmith.hidden.writer import estimate_bytes

    return estimate_bytes(tokens, rows, hidden, dtype, storage, trained, vocab, None, n_aux)


def human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    raise AssertionError("unreachable")


def make_plan(cfg: dict, token_files: list[Path], target: Path, out_dir: Path) -> dict:
    from draftsmith.hidden.storage import Storage
    from draftsmith.targets.layerids import resolve_setting
    from draftsmith.targets.model import target_config

    cap = cfg["capture"]
    text_cfg = target_config(target)
    hidden, n_layers = int(text_cfg["hidden_size"]), int(text_cfg["num_hidden_layers"])
    vocab = int(text_cfg["vocab_size"])
    dtype = cap["dtype"]
    storage = Storage.from_config(cap.get("storage"))
    ids = resolve_setting(
        cap["aux_layer_ids"], json.loads((Path(target) / "config.json").read_text())
    )
    shards, total, pending = [], 0, 0
    for f in sorted(token_files):
        rows, tokens = token_counts(f)
        trained = trained_count(f) if storage.final != "states" else None
        size = shard_bytes(rows, tokens, hidden, dtype, storage, trained, vocab, len(ids))
        built = (out_dir / f.name).is_file()
        shards.append(
            {
                "range": f.stem,
                "rows": rows,
                "tokens": tokens,
                "trained_positions": trained,
                "bytes": size,
                "built": built,
            }
        )
        total += size
        pending += 0 if built else size
    probe = out_dir if out_dir.exists() else next(p for p in out_dir.parents if p.exists())
    free = shutil.disk_usage(probe).free
    n_tokens = sum(s["tokens"] for s in shards)
    return {
        "hidden_size": hidden,
        "target_layers": n_layers,
        "aux_layer_ids": ids,
        "dtype": dtype,
        "storage": storage.name(dtype),
        # states, ids and mask per token, without the per-shard header and row offsets
        "bytes_per_token": round(
            (total - sum(4096 + 8 * (s["rows"] + 1) for s in shards)) / max(1, n_tokens)
        ),
        "rows": sum(s["rows"] for s in shards),
        "tokens": n_tokens,
        "total_bytes": total,
        "pending_bytes": pending,
        "free_bytes": free,
        "free_path": str(probe),
        "fits": pending <= free,
        "shards": shards,
    }


def upper_bound(cfg: dict, ranges: list[tuple[int, int]], text_cfg: dict) -> str:
    """The shards' disk estimate before any row is tokenized (what a dry run prints).

    Every row is counted at `data.max_length` tokens (and, in the compact final-state modes,
    every token as trained), so this bounds the real total from above; the `hidden_plan` rule
    gives the exact figure from the token files.
    """
    from draftsmith.hidden.storage import Storage

    cap, max_len = cfg["capture"], int(cfg["data"]["max_length"])
    hidden, vocab = int(text_cfg["hidden_size"]), int(text_cfg.get("vocab_size", 0)) or None
    dtype = cap["dtype"]
    storage = Storage.from_config(cap.get("storage"))
    n_aux = aux_layer_count(cap["aux_layer_ids"])
    sizes, tokens = {}, 0
    for a, b in ranges:
        n = (b - a) * max_len
        trained = n if storage.final != "states" else None
        sizes[range_name(a, b)] = shard_bytes(
            b - a, n, hidden, dtype, storage, trained, vocab, n_aux
        )
        tokens += n
    total, rows = sum(sizes.values()), sum(b - a for a, b in ranges)
    text = (
        f"hidden-state shards (upper bound, every row at data.max_length {max_len}): "
        f"{len(ranges)} ranges, {rows} rows, <= {tokens} tokens x "
        f"{round(total / max(1, tokens))} B/token (storage {storage.name(dtype)}, hidden "
        f"{hidden}) = at most {human(total)}"
    )
    if cap.get("keep", True):
        return text
    from draftsmith.hidden.segments import bound_text, peak_bytes

    train = cfg["train"]
    return (
        f"{text}\n  {bound_text(peak_bytes(sizes, train['segment_rows'], train['epochs']), human)}"
    )


def segmented(cfg: dict, plan: dict) -> None:
    """Segment mode (capture.keep false): the shards on disk at once are at most two
    segments' (draftsmith.hidden.segments), which is what must fit; the plan says so."""
    if cfg["capture"].get("keep", True):
        return
    from draftsmith.hidden.segments import peak_bytes

    train = cfg["train"]
    sizes = {s["range"]: s["bytes"] for s in plan["shards"]}
    plan["segments"] = peak_bytes(sizes, train["segment_rows"], train["epochs"])
    plan["pending_bytes"] = plan["segments"]["peak_bytes"]
    plan["fits"] = plan["pending_bytes"] <= plan["free_bytes"]


def summary(plan: dict) -> str:
    if "segments" in plan:
        from draftsmith.hidden.segments import bound_text

        return f"{offline_summary(plan)}\n  {bound_text(plan['segments'], human)}"
    return offline_summary(plan)


def offline_summary(plan: dict) -> str:
    return (
        f"hidden-state shards: {len(plan['shards'])} ranges, {plan['rows']} rows, "
        f"{plan['tokens']} tokens x {plan['bytes_per_token']} B/token "
        f"(storage {plan['storage']}, hidden {plan['hidden_size']}; states, ids, mask)\n"
        f"  total {human(plan['total_bytes'])}, still to build {human(plan['pending_bytes'])}, "
        f"free in {plan['free_path']}: {human(plan['free_bytes'])}"
    )


def main(argv: list[str] | None = None) -> None:
    ap = command_parser("plan", __doc__)
    ap.add_argument("--cfg", required=True, help="JSON with the `capture` section")
    ap.add_argument("--target", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True, help="results/hidden/plan.json")
    ap.add_argument("tokens", type=Path, nargs="+", help="results/tokens/rows_*.safetensors")
    args = ap.parse_args(argv)
    cfg = parse_cfg(args.cfg)
    if "capture" not in cfg:
        raise SystemExit("--cfg has no `capture` section")
    try:
        plan = make_plan(cfg, args.tokens, args.target, args.out.parent)
    except (PlanError, ValueError) as e:
        raise SystemExit(f"error: {e}") from None
    segmented(cfg, plan)
    print(summary(plan))
    print(summary(plan), file=sys.stderr)
    if not plan["fits"]:
        raise SystemExit(
            f"error: the shards still to build need {human(plan['pending_bytes'])} "
            f"but {plan['free_path']} has {human(plan['free_bytes'])} free"
        )
    atomic_write_json(args.out, plan)
