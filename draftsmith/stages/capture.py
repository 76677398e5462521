"""Capture: the target's hidden states over one row range, written as a shard.

For every token the shard holds the aux states, one per capture.aux_layer_ids entry (SGLang's
"output of decoder layer i" ids: the residual stream leaving layer i, un-normalized, i.e.
transformers' `output_hidden_states[i + 1]`) and the final post-norm state (the input of the lm_head).
This module reads and checks the token file, resolves the layer ids and the provenance of the
manifest; the engine named by `capture.backend` (`draftsmith.engines`) runs the target and
writes the shard (`draftsmith.hidden.capture_base` holds what this CLI and the engines share:
`CaptureError` and `plan_batches`, the length-sorted batching). The shard is stored in the mode
`capture.storage` names (draftsmith/hidden/storage.py): engines hand `ShardWriter` the same states in
every mode and pass it `storage=` (and the target's lm_head for top-k teachers).

Disk: before the engine starts, the shard's size in its storage mode (`plan.shard_bytes`) is
compared with the free space where it goes, and a shard that cannot fit stops the job with both
figures; a disk that fills up during the capture anyway (another job wrote there) stops it with
the same kind of message instead of a traceback, and the temp file is removed.

    python -m draftsmith capture --cfg '{"capture": {...}, "target": {...}}' \\
        --tokens results/tokens/rows_000000-000128.safetensors --target results/target \\
        --out results/hidden/rows_000000-000128.safetensors --threads 2
"""

from __future__ import annotations

import errno
import shutil
from pathlib import Path

import torch

from draftsmith.config import settings
from draftsmith.config.checks import parse_range
from draftsmith.hidden.capture_base import CaptureError
from draftsmith.hidden.shards import STORAGE_DTYPES, ShardError
from draftsmith.hidden.storage import Storage, StorageError
from draftsmith.runtime.files import command_parser, init_logging, merge_run, parse_cfg, versions

DISK_FULL = (errno.ENOSPC, errno.EDQUOT)


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


def check_free_space(out: Path, need: int) -> None:
    """CaptureError when the disk under `out` has less than `need` bytes free."""
    out.parent.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(out.parent).free
    if need > free:
        raise CaptureError(disk_message(out, need, free))


def disk_message(out: Path, need: int, free: int) -> str:
    from draftsmith.hidden.plan import human

    return (
        f"not enough disk space for {out}: the shard needs {human(need)}, {out.parent} has "
        f"{human(free)} free. Free space there or put results/ on a larger disk; "
        f"`snakemake results/hidden/plan.json` estimates all shards before any capture runs."
    )


def shard_size(tokens: dict, text_cfg: dict, dtype: str, storage: Storage, n_aux: int) -> int:
    """Bytes the shard will take in its storage mode (what hidden_plan estimates per range)."""
    from draftsmith.hidden.plan import shard_bytes
    from draftsmith.hidden.storage import trained_mask

    trained = None
    if storage.final != "states":
        trained = int(trained_mask(tokens["loss_mask"], tokens["row_offsets"]).sum())
    n_tokens, n_rows = tokens["input_ids"].numel(), tokens["row_offsets"].numel() - 1
    hidden, vocab = int(text_cfg["hidden_size"]), int(text_cfg["vocab_size"])
    return shard_bytes(n_rows, n_tokens, hidden, dtype, storage, trained, vocab, n_aux)


def draft_vocab_ids(storage: Storage, vocab: Path | None):
    """The target id of each draft id where the storage mode keeps the teacher's top-k over the
    draft vocabulary (capture.storage.topk_vocab draft), else None."""
    if not storage.draft_topk:
        return None
    if vocab is None:
        raise SystemExit("error: capture.storage.topk_vocab draft needs --vocab")
    from draftsmith.data.vocab import load_vocab

    d2t, _ = load_vocab(vocab)
    return d2t + torch.arange(d2t.shape[0])


def main(argv: list[str] | None = None) -> None:
    ap = command_parser("capture", __doc__)
    ap.add_argument("--cfg", required=True, help="JSON with the `capture` and `target` sections")
    ap.add_argument(
        "--tokens", type=Path, required=True, help="results/tokens/rows_<a>-<b>.safetensors"
    )
    ap.add_argument("--target", type=Path, required=True, help="the target HF dir (results/target)")
    ap.add_argument(
        "--out", type=Path, required=True, help="results/hidden/rows_<a>-<b>.safetensors"
    )
    ap.add_argument("--threads", type=int, default=0)
    from draftsmith.engines import stage_inputs

    for name, path in stage_inputs("capture").items():  # engines' own inputs (their WORKFLOW)
        ap.add_argument(f"--{name}", type=Path, help=f"{path} (for the engine that needs it)")
    ap.add_argument(
        "--vocab",
        type=Path,
        help="results/vocab/vocab.safetensors (capture.storage.topk_vocab draft)",
    )
    ap.add_argument("--run", default="", help="run settings JSON (default: $DRAFTSMITH_RUN)")
    args = ap.parse_args(argv)
    log = init_logging("draftsmith.stages.capture")
    job = settings.stage_job(merge_run(parse_cfg(args.cfg), args.run), "capture")
    from draftsmith.engines import stop_guard

    with stop_guard("capture", job.capture.backend):
        run(args, job, log)


def run(args, job: settings.JobSettings, log) -> None:
    """The capture job after its arguments: storage checks, the engine's shard, the log. The
    engine gets the typed settings (`job`: capture, target and its own section), its seam's
    contract (draftsmith.engines)."""
    cap = job.capture
    dtype = cap.dtype
    if dtype not in STORAGE_DTYPES:
        raise SystemExit(f"capture.dtype {dtype!r} is not one of {list(STORAGE_DTYPES)}")
    try:
        storage = Storage.from_config(cap.storage.as_dict())
    except StorageError as e:
        raise SystemExit(f"error: {e}") from None
    from draftsmith.engines import engine, engine_inputs
    from draftsmith.targets import model as tgt
    from draftsmith.targets.layerids import resolve_setting

    declared = engine_inputs(cap.backend, "capture")
    extra = {n: getattr(args, n) for n in declared if getattr(args, n) is not None}
    extra["draft_ids"] = draft_vocab_ids(storage, args.vocab)

    try:
        a, b = parse_range(args.out.stem)
        tokens = read_tokens(args.tokens)
        n_rows = tokens["row_offsets"].numel() - 1
        # fewer rows than the range is normal: regeneration drops rows whose prompt does not
        # fit data.max_length and tokenize may drop overlong ones (both count them in reports)
        if n_rows > b - a:
            raise CaptureError(
                f"{args.tokens}: {n_rows} rows, but range {args.out.stem} has only {b - a}"
            )
        text_cfg = tgt.target_config(args.target)
        n_layers = int(text_cfg["num_hidden_layers"])
        ids = resolve_setting(cap.aux_layer_ids, tgt.full_config(args.target))
        need = shard_size(tokens, text_cfg, dtype, storage, len(ids))
        check_free_space(args.out, need)
        fp = tgt.fingerprint(args.target)
        capture_range = engine("capture", cap.backend)
        log.info(
            "%s: %d rows, %d tokens, aux ids %s of %d layers, storage %s, backend %s",
            args.out.stem,
            n_rows,
            tokens["input_ids"].numel(),
            ids,
            n_layers,
            storage.name(dtype),
            cap.backend,
        )
        manifest = capture_range(
            tokens,
            job,
            target=args.target,
            out=args.out,
            ids=ids,
            manifest={
                "row_range": [a, b],
                "target_fingerprint": fp,
                "target_layers": n_layers,
                "tokens_file": str(args.tokens),
                "versions": versions(),
            },
            threads=args.threads,
            **extra,
        )
    except (CaptureError, ShardError, ValueError) as e:
        raise SystemExit(f"error: {e}") from None
    except OSError as e:
        if e.errno not in DISK_FULL:
            raise
        free = shutil.disk_usage(args.out.parent).free
        raise SystemExit(
            f"error: disk full while writing: {disk_message(args.out, need, free)}"
        ) from None
    log.info(
        "wrote %s (%d tokens, %.1f s, sha256 %s)",
        args.out,
        manifest["tokens"],
        manifest["capture_seconds"],
        manifest["sha256"][:16],
    )
