"""Segment mode's training: one job per (epoch, segment), then the export of the last one.

    python -m draftsmith segment-train train --cfg JSON --segment epoch001-seg0002 \
        --shards results/segments/epoch001/rows_*.safetensors --tokens results/tokens/*.safetensors \
        [--prev results/segments/ckpt/epoch001-seg0001] --vocab V --target T \
        --out results/segments/ckpt/epoch001-seg0002 [--state state/train]
    python -m draftsmith segment-train export --cfg JSON --ckpt results/segments/ckpt/<last> \
        --tokens ... --manifests ... --vocab V --target T --out results/draft \
        --metrics results/train/metrics.jsonl --offline results/train/offline_acceptance.json

`train` runs the steps of one (epoch, segment) of the plan `draftsmith.hidden.segments` makes from
the token files (the same plan offline training with train.segment_rows makes from the
shards), reading only that segment's shards: it starts from the previous segment's
checkpoint (`--prev`, exact: weights, AdamW state, RNG) or from the seeded draft for the
first, and ends by writing its own checkpoint to `--out` (atomically, with the metrics of every
step so far). In between it checkpoints into `<state>/<run key>/` like draftsmith.train.loop
(every checkpoint_every steps, every checkpoint_seconds), and a rerun after a kill resumes
there. The run key covers the config, the segment, its shards' sha256 and the previous
checkpoint. `export` turns the last checkpoint into the SGLang draft like draftsmith.train.loop.
"""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
import time
from pathlib import Path

import torch

from draftsmith import algorithms
from draftsmith.algorithms.offline import for_run as offline_estimate
from draftsmith.algorithms.spec import AlgorithmSpec
from draftsmith.config.settings import JobSettings
from draftsmith.config.settings import job as job_settings
from draftsmith.hidden.segments import plan_segmented, segment_of, step_span
from draftsmith.runtime.files import (
    atomic_dir,
    init_logging,
    merge_run,
    parse_cfg,
    remove_stale_temps,
    set_threads,
    sha256_file,
    subcommand_parser,
    versions,
)
from draftsmith.runtime.hardware import cpu_facts, resolve_precision
from draftsmith.runtime.progress import ProgressLog
from draftsmith.runtime.serverhosts import release_gpu_hosts
from draftsmith.runtime.stopping import stop_promptly
from draftsmith.train.checkpoint import check_space, load_checkpoint, reset_metrics, save_checkpoint
from draftsmith.train.data import Data, check_inputs, frozen_inputs, run_key, teacher_flags
from draftsmith.train.loop import (
    Progress,
    bound_cpu_memory,
    build_draft,
    checkpoint_due,
    finish,
    log_stop,
    pick_device,
    precision_probe,
    recorded,
    resume,
    step_helpers,
    train_step,
)

log = logging.getLogger("draftsmith.train.loop")


def token_rows(token_files: list[Path]) -> tuple[list[str], list[tuple[int, int, int]]]:
    """(range names, rows as (range index, start, end)) of every token file, in range order."""
    from safetensors import safe_open

    names, rows = [], []
    for g, path in enumerate(sorted(token_files)):
        with safe_open(str(path), "pt") as f:
            offsets = f.get_tensor("row_offsets").tolist()
        names.append(path.stem)
        rows += [(g, a, b) for a, b in zip(offsets[:-1], offsets[1:], strict=True)]
    return names, rows


def parse_segment(name: str) -> tuple[int, int]:
    """(epoch, segment) of `epochEEE-segSSSS`."""
    try:
        e, s = name.split("-")
        return int(e.removeprefix("epoch")), int(s.removeprefix("seg"))
    except ValueError:
        raise SystemExit(f"--segment {name!r}: expected epochEEE-segSSSS") from None


def segment_data(job: JobSettings, inputs, shard_paths, token_files, segment, run_dir, device):
    """(Data whose rows index this job's shards, [first, end) global steps of the segment)."""
    tcfg, seg_rows = job.train, job.train.segment_rows
    names, rows = token_rows(token_files)
    local = {p.stem: i for i, p in enumerate(shard_paths)}
    for p, sh in zip(shard_paths, inputs.shards, strict=True):
        want = [(a, b) for g, a, b in rows if names[g] == p.stem]
        have = sh.row_offsets.tolist()
        if want != list(zip(have[:-1], have[1:], strict=True)):
            raise SystemExit(f"{p}: its rows differ from the token file's of range {p.stem}")
    segs = [segment_of(names[g], seg_rows) for g, _, _ in rows]
    plans, pack_len, bounds = plan_segmented([b - a for _, a, b in rows], segs, tcfg)
    total = sum(len(p) for p in plans)
    total = min(total, tcfg.max_steps) if tcfg.max_steps else total
    span = step_span(plans, bounds, *segment, total)
    in_job = [(local.get(names[g], -1), a, b) for g, a, b in rows]
    b0, b1 = bounds[segment[0]][segment[1]]
    if any(in_job[r][0] < 0 for batch in plans[segment[0]][b0:b1] for pack in batch for r in pack):
        raise SystemExit(f"segment {segment}: its batches read rows outside --shards")
    job_names = [p.stem for p in shard_paths]
    all_positions = tcfg.loss_positions == "all"
    ok = teacher_flags(
        inputs.shards, job_names, inputs.heads, inputs.t2d, run_dir, 0, 1, device, all_positions
    )
    return Data(job_names, ok, in_job, plans, pack_len, total, all_positions, []), span


def segment_key(cfg, shard_paths, vocab, target, precision, segment: str, prev) -> str:
    """The run key of one segment job (draftsmith.train.data.run_key, the segment and the
    previous checkpoint's key and step)."""
    h = hashlib.sha256(run_key(cfg, shard_paths, vocab, target, precision).encode())
    h.update(segment.encode())
    if prev is not None:
        meta = json.loads((prev / "meta.json").read_text())
        h.update(f"{meta['key']}:{meta['step']}".encode())
    return h.hexdigest()[:16]


def start_from(run_dir: Path, key: str, draft, opt, prev: Path | None, first: int) -> Progress:
    """Resume this segment's own newest checkpoint, else load the previous segment's."""
    pos = resume(run_dir, key, draft, opt, 0)
    check_space(run_dir, draft)
    if pos.saved_step is not None:
        return pos
    if prev is not None:
        meta = load_checkpoint(prev, draft, opt)
        pos.step = meta["step"]
        shutil.copyfile(prev / "metrics.jsonl", run_dir / "metrics.jsonl")
        reset_metrics(run_dir / "metrics.jsonl", pos.step)
        log.info("starting from %s at step %d", prev, pos.step)
    if pos.step != first:
        raise SystemExit(
            f"{prev}: ends at step {pos.step}, but this segment starts at step {first} "
            "(a checkpoint of another plan)"
        )
    return pos


def train_segment(job: JobSettings, args, progress: Progress, spec: AlgorithmSpec) -> None:
    """Run one (epoch, segment) and write its checkpoint to args.out."""
    facts = cpu_facts()
    device = pick_device(args.device)
    torch.use_deterministic_algorithms(True, warn_only=True)
    precision, why = resolve_precision(
        job.train.precision, device.type, facts, precision_probe(job, args.target, facts)
    )
    shard_paths = sorted(args.shards)
    inputs = check_inputs(job, shard_paths, args.vocab, args.target, 0, spec)
    key = segment_key(
        job.given, shard_paths, args.vocab, args.target, precision, args.segment, args.prev
    )
    run_dir = args.state / key
    run_dir.mkdir(parents=True, exist_ok=True)
    remove_stale_temps(run_dir, ".tmp-step-")  # staging dirs of a killed job
    remove_stale_temps(args.out.parent, f".tmp-{args.out.name}-")
    segment = parse_segment(args.segment)
    data, (first, end) = segment_data(
        job, inputs, shard_paths, args.tokens, segment, run_dir, device
    )
    draft, opt = build_draft(job, inputs, device)
    pos = start_from(run_dir, key, draft, opt, args.prev, first)
    progress.__dict__.update(pos.__dict__)
    pos = progress
    s = step_helpers(job, inputs, draft, opt, device, precision, 1)
    before = sum(len(p) for p in data.plans[: segment[0]])
    log.info("segment %s: steps %d..%d of %d, run %s", args.segment, first, end, data.total, key)
    meta = {"key": key, "segment": args.segment, "config": job.given, "total_steps": data.total}
    meta["precision"] = {"resolved": precision, "why": why, "cpu": facts.as_dict()}
    meta["pack_len"] = data.pack_len
    progress_log = ProgressLog(log, f"segment {args.segment}", end, "steps", done=pos.step)
    while pos.step < end:
        pos.epoch, pos.batch = segment[0], pos.step - before
        record = train_step(s, job.train, inputs, data, pos, 0, 1)
        pos.step, pos.batch = pos.step + 1, pos.batch + 1
        with open(run_dir / "metrics.jsonl", "a") as f:
            f.write(json.dumps(record) + "\n")
        progress_log.update(pos.step, loss=f"{record['loss']:.3f}")
        if checkpoint_due(job.train, pos, end):
            save_checkpoint(
                run_dir, pos.step, draft, opt, {**meta, "epoch": pos.epoch, "batch": pos.batch}
            )
            pos.saved_step, pos.saved_at = pos.step, time.monotonic()
    if pos.saved_step != pos.step:
        save_checkpoint(
            run_dir, pos.step, draft, opt, {**meta, "epoch": pos.epoch, "batch": pos.batch}
        )
    with atomic_dir(args.out) as stage:
        for f in (run_dir / f"step-{pos.step:06d}").iterdir():
            shutil.copyfile(f, stage / f.name)
        shutil.copyfile(run_dir / "metrics.jsonl", stage / "metrics.jsonl")
    log.info("segment %s done at step %d -> %s", args.segment, pos.step, args.out)


def export_last(job: JobSettings, args, spec: AlgorithmSpec) -> None:
    """The draft of the last segment's checkpoint, exported as draftsmith.train.loop exports."""
    inputs = frozen_inputs(job, args.vocab, args.target, spec)
    draft, opt = build_draft(job, inputs, torch.device("cpu"))
    meta = load_checkpoint(args.ckpt, draft, opt)
    if meta["step"] != meta["total_steps"]:
        raise SystemExit(f"{args.ckpt}: step {meta['step']} of {meta['total_steps']}: not the last")
    _, rows = token_rows(args.tokens)
    manifests = {p.stem: json.loads(p.read_text()) for p in sorted(args.manifests)}
    provenance = {
        "key": meta["key"],
        "config": job.given,
        "total_steps": meta["total_steps"],
        "pack_len": meta["pack_len"],
        "precision": {"configured": job.train.precision, **meta["precision"]},
        "segments": {"segment_rows": job.train.segment_rows, "last": meta["segment"]},
        "shards": {n: m.get("tensor_sha256") for n, m in manifests.items()},
        "vocab_sha256": sha256_file(args.vocab),
        "target_fingerprint": inputs.fingerprint,
        "versions": versions(),
    }
    steps = job.train.ttt_steps
    offline_estimate(inputs.algorithm, steps, draft, inputs, [], args.offline)  # no eval_rows here
    longest = max(b - a for _, a, b in rows)
    paths = (args.target, args.out, args.ckpt, args.metrics)
    finish(draft, inputs.algorithm, provenance, (steps, longest), paths)


def parse_args(argv):
    ap, sub = subcommand_parser("segment-train", __doc__, dest="command")
    for name in ("train", "export"):
        p = sub.add_parser(name)
        p.add_argument("--cfg", required=True, help="JSON of the train, draft and capture sections")
        p.add_argument("--tokens", nargs="+", required=True, type=Path, help="every token file")
        p.add_argument("--vocab", required=True, type=Path)
        p.add_argument("--target", required=True, type=Path)
        p.add_argument("--out", required=True, type=Path)
        p.add_argument("--threads", type=int, default=0)
    t = sub.choices["train"]
    t.add_argument("--segment", required=True, help="epochEEE-segSSSS")
    t.add_argument("--shards", nargs="+", required=True, type=Path, help="the segment's shards")
    t.add_argument("--prev", type=Path, help="the previous segment's checkpoint")
    t.add_argument("--state", type=Path, default=Path("state/train"))
    t.add_argument("--device", choices=["cpu", "cuda"], help="default: cuda when available")
    x = sub.choices["export"]
    x.add_argument("--ckpt", required=True, type=Path, help="the last segment's checkpoint")
    x.add_argument("--manifests", nargs="+", required=True, type=Path, help="kept manifests")
    x.add_argument("--metrics", required=True, type=Path)
    x.add_argument("--offline", required=True, type=Path)
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    init_logging("draftsmith.train.loop")
    cfg = merge_run(parse_cfg(args.cfg), sections=("train",))
    job = recorded(job_settings(cfg, ("train", "draft", "capture")))
    if not job.train.segment_rows:
        raise SystemExit("--cfg: train.segment_rows is not set (segment mode needs it)")
    set_threads(args.threads)
    spec = algorithms.get(job.draft.algorithm)  # resolved once, here, for the command
    if args.command == "export":
        export_last(job, args, spec)
        return
    progress = Progress()
    release_gpu_hosts()  # the capture server's GPUs, held while it waits for the next segment
    with stop_promptly("draftsmith.train.loop", lambda sig: log_stop(progress)):
        bound_cpu_memory()
        train_segment(job, args, progress, spec)
