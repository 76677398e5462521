"""What a training run reads, checked, and the order it reads it in.

`check_inputs` reads the target's frozen pieces (embedding, lm_head, final norm), the draft
vocabulary and the shards, checks the shards' layer ids and target against the config and
checks each shard's bytes against its manifest's crc32 at every start (sha256 for an older
manifest without one). `prepare_run` computes the
teacher flags once per run directory and the data plan: every row of every shard, shuffled per
epoch with a seeded generator, packed first-fit into `batch_tokens // longest_row` packs of
`longest_row` tokens; one batch is one optimizer step (rows held out by `train.eval_rows`,
draftsmith.algorithms.eagle3.offline, are not in it). `run_key` names the run directory from
everything that changes the result. `row_tensors` is what the step reads of one row.
"""

from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors.torch import load_file, save_file
from tqdm import tqdm

from draftsmith.algorithms.batches import teacher_ok
from draftsmith.algorithms.offline import split_rows
from draftsmith.algorithms.spec import AlgorithmSpec
from draftsmith.data.vocab import load_vocab
from draftsmith.hidden.segments import pack_order, packs_per_batch, plan_segmented, segment_of
from draftsmith.hidden.shards import ShardError, open_shard, verify_read
from draftsmith.hidden.storage import StorageError, check_draft_vocab
from draftsmith.runtime.files import atomic_path, remove_stale_temps, sha256_file
from draftsmith.runtime.repair import discard_refused_shards
from draftsmith.targets.layerids import resolve_setting
from draftsmith.targets.layout import LayoutError, read_pieces, text_config

if TYPE_CHECKING:
    from draftsmith.config.settings import JobSettings, TrainSettings

# train keys that do not change the result (and so do not change the run key)
NON_SEMANTIC = ("role", "checkpoint_every", "checkpoint_seconds")
log = logging.getLogger("draftsmith.train.loop")


def target_tensors(target_dir: Path) -> dict[str, torch.Tensor]:
    """The frozen target pieces training needs, in float32: embed, lm_head (the embedding when
    tied), norm; found by `draftsmith.targets.layout` in plain and wrapped checkpoints alike."""
    try:
        pieces = read_pieces(target_dir)
    except LayoutError as e:
        raise SystemExit(f"error: {e}") from None
    found = {k: v.float() for k, v in pieces.items() if k != "lm_head"}
    tied = pieces["lm_head"] is pieces["embed"]
    found["lm_head"] = found["embed"] if tied else pieces["lm_head"].float()
    return found


def run_key(
    cfg: dict, shard_paths: list[Path], vocab: Path, target_dir: Path, precision: str
) -> str:
    train = {k: v for k, v in cfg["train"].items() if k not in NON_SEMANTIC}
    if "precision" in train:  # as configured; the resolved one is hashed below, and only it
        train["precision"] = "auto"  # changes the result: bf16 written out resumes auto's run
    h = hashlib.sha256()
    h.update(json.dumps([train, cfg["draft"], cfg["capture"]], sort_keys=True).encode())
    h.update(precision.encode())  # resolved: a run never resumes in another precision
    for p in shard_paths:  # the sha256 covers the tensors and the manifest copy in the header
        h.update(
            p.name.encode() + json.loads(p.with_suffix(".json").read_text())["sha256"].encode()
        )
    h.update(sha256_file(vocab).encode())
    meta = target_dir / "draftsmith_target.json"
    h.update(meta.read_bytes() if meta.exists() else (target_dir / "config.json").read_bytes())
    return h.hexdigest()[:16]


def prove_shards(shards) -> None:
    """Check every shard's bytes against its manifest at each start (draftsmith.hidden.shards
    `verify_read`: crc32 of what training reads; sha256 for a manifest without crc32)."""
    checks = [
        verify_read(s) for s in tqdm(shards, desc="verify shards", unit="shard", disable=None)
    ]
    log.info(
        "%d shard(s) checked against their manifests: %d by crc32, %d by sha256 (manifests "
        "older than crc32)",
        len(shards),
        checks.count("crc32"),
        checks.count("sha256"),
    )


def plan_epochs(lengths: list[int], tcfg: TrainSettings) -> tuple[list, int]:
    """Per epoch: batches -> packs -> row indices (seeded, independent of the process count)."""
    pack_len = max(lengths)
    per_batch = packs_per_batch(pack_len, tcfg)
    plans = []
    for epoch in range(tcfg.epochs):
        gen = torch.Generator().manual_seed(tcfg.seed * 1_000_003 + epoch)
        order = torch.randperm(len(lengths), generator=gen).tolist()
        plans.append(pack_order(order, lengths, pack_len, per_batch))
    return plans, pack_len


def plan_rows(rows, names: list[str], tcfg: TrainSettings):
    """(plans, pack_len) of the training rows: by segment (draftsmith.hidden.segments) when
    train.segment_rows is set, else every row shuffled per epoch (`plan_epochs`)."""
    lengths = [b - a for _, a, b in rows]
    seg_rows = tcfg.segment_rows
    if not seg_rows:
        return plan_epochs(lengths, tcfg)
    segs = [segment_of(names[s], seg_rows) for s, _, _ in rows]
    plans, pack_len, _ = plan_segmented(lengths, segs, tcfg)
    return plans, pack_len


def teacher_flags(
    shards, names, heads, t2d, run_dir, rank: int, world: int, device, all_positions=False
) -> dict:
    """Per shard [T] bool: target argmax in the draft vocab (trained positions only, or every
    position with `all_positions`), cached."""
    path = run_dir / "teacher_ok.safetensors"
    if rank == 0 and not path.exists():
        flags, lm_head = {}, heads["lm_head"].to(device)
        for name, s in tqdm(
            list(zip(names, shards, strict=True)), desc="teacher argmax", disable=None
        ):
            flags[name] = teacher_ok(s, lm_head, t2d, all_positions)
        with atomic_path(path) as tmp:
            save_file(flags, str(tmp))
    if world > 1:
        torch.distributed.barrier()
    return load_file(str(path))


@dataclass
class Inputs:
    """What training reads, checked: target config and pieces, vocabulary, open shards."""

    target_cfg: dict
    aux_ids: list[int]
    d2t: torch.Tensor
    t2d: torch.Tensor
    heads: dict[str, torch.Tensor]
    fingerprint: str | None
    shards: list
    algorithm: AlgorithmSpec  # draft.algorithm's spec, resolved once for the run
    target_dir: Path | None = None  # what a trainer reads more of (draft.init_layer_from_target)


@dataclass
class Data:
    """The run's data plan: rows (shard, start, end), per-epoch batches, teacher flags."""

    names: list[str]
    ok: dict
    rows: list[tuple[int, int, int]]
    plans: list
    pack_len: int
    total: int
    all_positions: bool
    eval_rows: list[tuple[int, int, int]]  # held out of training (train.eval_rows)


def check_inputs(
    job: JobSettings,
    shard_paths: list[Path],
    vocab_path: Path,
    target_dir: Path,
    rank,
    spec: AlgorithmSpec,
) -> Inputs:
    """Target pieces, vocabulary and shards, with layer ids and target checked against the
    manifests and each shard's bytes checked against its checksum (rank 0, `prove_shards`).
    `spec`: the draft's algorithm, resolved once by the stage that runs the training."""
    frozen = frozen_inputs(job, vocab_path, target_dir, spec)
    d2t = frozen.d2t
    expect = {"aux_layer_ids": frozen.aux_ids, "hidden_size": int(frozen.target_cfg["hidden_size"])}
    if frozen.fingerprint is not None:
        expect["target_fingerprint"] = frozen.fingerprint
    try:
        shards = [open_shard(p, expect=expect) for p in shard_paths]
        for s in shards:  # a top-k teacher over the draft vocabulary must be over this one
            try:
                check_draft_vocab(s.manifest, d2t + torch.arange(d2t.shape[0]))
            except StorageError as e:
                raise ShardError(f"{s.path}: {e}") from None
        if rank == 0:
            prove_shards(shards)
    except ShardError as e:
        raise discard_refused_shards(e, shard_paths) from None  # the next run rebuilds them
    frozen.shards = shards
    return frozen


def frozen_inputs(
    job: JobSettings, vocab_path: Path, target_dir: Path, spec: AlgorithmSpec
) -> Inputs:
    """What training reads besides the shards: target config and pieces, the vocabulary
    (checked against draft.vocab_size), the target's fingerprint; `shards` left empty."""
    whole = json.loads((target_dir / "config.json").read_text())
    target_cfg = text_config(whole)
    ids = resolve_setting(job.capture.aux_layer_ids, whole)
    d2t, t2d = load_vocab(vocab_path)
    if d2t.shape[0] != job.draft.vocab_size:
        raise SystemExit(
            f"{vocab_path}: {d2t.shape[0]} draft tokens, draft.vocab_size is {job.draft.vocab_size}"
        )
    heads = target_tensors(target_dir)
    meta_file = target_dir / "draftsmith_target.json"
    fingerprint = None
    if meta_file.exists():
        fingerprint = json.loads(meta_file.read_text())["fingerprint"]
    return Inputs(target_cfg, ids, d2t, t2d, heads, fingerprint, [], spec, target_dir)


def prepare_run(
    job: JobSettings, inputs: Inputs, shard_paths: list[Path], run_dir: Path, rank, world, device
) -> Data:
    """Teacher flags (cached in the run dir) and the data plan of every epoch."""
    tcfg = job.train
    names = [p.stem for p in shard_paths]
    if rank == 0:
        remove_stale_temps(run_dir, ".tmp-step-")  # staging dirs of a killed run
    all_positions = tcfg.loss_positions == "all"
    finals = {s.storage.final for s in inputs.shards}
    if all_positions and finals != {"states"}:
        raise SystemExit(
            f"train.loss_positions all needs capture.storage.final states (the teacher at "
            f"every position); the shards hold {sorted(finals)}"
        )
    ok = teacher_flags(
        inputs.shards, names, inputs.heads, inputs.t2d, run_dir, rank, world, device, all_positions
    )
    rows = [
        (s, a, b)
        for s, sh in enumerate(inputs.shards)
        for a, b in zip(sh.row_offsets[:-1].tolist(), sh.row_offsets[1:].tolist(), strict=True)
    ]
    rows, held = split_rows(rows, tcfg.eval_rows)
    plans, pack_len = plan_rows(rows, names, tcfg)
    total = sum(len(p) for p in plans)
    total = min(total, tcfg.max_steps) if tcfg.max_steps else total
    return Data(names, ok, rows, plans, pack_len, total, all_positions, held)


def row_tensors(shards, names, ok, row, all_positions: bool = False) -> dict:
    """One row's tensors; `all_positions` (train.loss_positions all) trains every position."""
    s, a, b = row
    sh = shards[s]
    mask = sh.loss_mask[a:b]
    return {
        "input_ids": sh.input_ids[a:b],
        "loss_mask": torch.ones_like(mask) if all_positions else mask,
        "ok": ok[names[s]][a:b],
        "aux": sh.aux(a, b),
        **sh.teacher(a, b),  # the same interface in every storage mode
    }
