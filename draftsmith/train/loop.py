"""Train the EAGLE-3 draft with training-time test, resumable exactly, then export it.

    python -m draftsmith train-rank --cfg JSON --shards results/hidden/rows_*.safetensors \
        --vocab results/vocab/vocab.safetensors --target results/target \
        --out results/draft --metrics results/train/metrics.jsonl [--state state/train]
    torchrun --standalone --nproc-per-node N -m draftsmith train-rank ...      (DDP, gloo on CPU)

The run, top to bottom: `check_inputs` (target pieces, vocabulary, shards proven against their
manifests), `prepare_run` (run key and directory, teacher flags, the data plan), `build_draft`
and `resume` (model, optimizer, newest checkpoint), the loop (`train_step`, metrics,
`checkpoint_due`), `finish` (export and metrics copy).

Data: every row of every shard, shuffled per epoch with a seeded generator, packed first-fit
into `batch_tokens // longest_row` packs of `longest_row` tokens (attention stays within a
row); one batch is one optimizer step, its packs split over the processes. The data position
(epoch, batch) is part of every checkpoint.

Shards: at every start each shard's bytes are checked against its manifest, the crc32 of the
memory map training reads (sha256 for a manifest older than crc32); never by size or mtime, so a
byte flipped with its mtime put back is refused, and the shard deleted for the rerun to rebuild.

Precision: `train.precision` auto is resolved here, per process, from the device
(draftsmith.runtime.hardware): bf16 autocast on a GPU or a CPU with native bf16, fp32 elsewhere. The
resolved precision is part of the run key (a run never resumes in another precision) and of the
draft's provenance, not of the workflow's params: a draft trained on one CPU kind is not stale
on another (docs/contracts/training.md).

State: `<state>/<run key>/` where the key hashes the train/draft/capture config, the resolved
precision, the shards' names and sha256, the vocabulary and the target fingerprint, so a changed
input never resumes a stale run, and a shard rebuilt with identical bytes resumes where it
stopped. It holds the teacher argmax flags (computed once), `metrics.jsonl` and checkpoints
(draftsmith.train.checkpoint), written every `checkpoint_every` steps, at least every
`checkpoint_seconds` seconds and at the end. A rerun resumes from the newest complete one.
SIGINT/SIGTERM end the process within seconds (draftsmith.runtime.stopping), losing at most the work
since the last checkpoint.
"""

from __future__ import annotations

import json
import logging
import math
import os
import resource
import shutil
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from draftsmith.algorithms.batches import pack_batch, weighted_loss
from draftsmith.algorithms.export import (
    ExportError,
    export_draft,
    say_family,
    serve_gate,
    target_embedding,
    target_family,
    verifier_ref,
)
from draftsmith.algorithms.offline import for_run as offline_estimate
from draftsmith.algorithms.spec import AlgorithmSpec
from draftsmith.config.checks import execution_defaults
from draftsmith.config.settings import JobSettings, TrainSettings
from draftsmith.runtime import heap
from draftsmith.runtime.files import (
    atomic_path,
    sha256_file,
    versions,
)
from draftsmith.runtime.finite import check_step
from draftsmith.runtime.hardware import cpu_facts, resolve_precision
from draftsmith.runtime.progress import ProgressLog
from draftsmith.runtime.repair import keep_last_good
from draftsmith.targets.layerids import resolve_setting
from draftsmith.targets.layout import text_config
from draftsmith.train.checkpoint import (
    append_metrics,
    check_space,
    latest_checkpoint,
    load_checkpoint,
    reset_metrics,
    save_checkpoint,
)
from draftsmith.train.data import (  # noqa: F401 (target_tensors, run_key: public here too)
    Data,
    Inputs,
    check_inputs,
    prepare_run,
    row_tensors,
    run_key,
    target_tensors,
)

CLIP = 0.5
MMAP_THRESHOLD = 16 << 20  # glibc M_MMAP_THRESHOLD of a training process (bound_cpu_memory)
log = logging.getLogger("draftsmith.train.loop")


# ---------------------------------------------------------------------------------------------
# Schedule and processes


def lr_at(step: int, total: int, peak: float, warmup_ratio: float) -> float:
    """Linear warmup then cosine decay to 0 (a pure function of the step: the schedule state)."""
    warmup = math.ceil(warmup_ratio * total)
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return peak * 0.5 * (1.0 + math.cos(math.pi * progress))


def dist_info() -> tuple[int, int]:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1 and not torch.distributed.is_initialized():
        torch.distributed.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    return (torch.distributed.get_rank() if world > 1 else 0), world


def all_sum(x: torch.Tensor, world: int) -> torch.Tensor:
    if world > 1:
        x = x.clone()
        torch.distributed.all_reduce(x)
    return x


# ---------------------------------------------------------------------------------------------
# The run


@dataclass
class Progress:
    """Where the run is (read by the stop watcher to say where a rerun resumes)."""

    step: int = 0
    epoch: int = 0
    batch: int = 0
    saved_step: int | None = None
    saved_at: float = field(default_factory=time.monotonic)
    run_dir: Path | None = None


def build_draft(job: JobSettings, inputs: Inputs, device):
    """The seeded draft (lm_head and norm from the target's with draft.init_from_target) and
    its optimizer."""
    torch.manual_seed(job.train.seed)
    algorithm = inputs.algorithm
    refused = {"draft.attention": job.draft.attention != "llama"}
    refused["draft.init_layer_from_target"] = job.draft.init_layer_from_target
    for key, used in refused.items():  # parse time says so too
        if used and key in algorithm.refuses:
            raise SystemExit(f"error: {key}: {algorithm.refuses[key]}")
    draft = algorithm.part("trainer").build_draft(job, inputs).to(device)
    opt = torch.optim.AdamW(draft.parameters(), lr=job.train.lr, weight_decay=0.0)
    return draft, opt


def resume(run_dir: Path, key: str, draft, opt, rank: int) -> Progress:
    """Load the newest complete checkpoint of this run key (if any); cut the metrics back."""
    pos = Progress(run_dir=run_dir)
    ckpt = latest_checkpoint(run_dir, key)
    if ckpt is not None:
        meta = load_checkpoint(ckpt, draft, opt)
        pos.step, pos.epoch, pos.batch = meta["step"], meta["epoch"], meta["batch"]
        pos.saved_step = pos.step
        log.info(
            "resuming %s at step %d (epoch %d, batch %d)", ckpt, pos.step, pos.epoch, pos.batch
        )
    if rank == 0:
        reset_metrics(run_dir / "metrics.jsonl", pos.step)
    return pos


@dataclass
class Step:
    """Everything one optimizer step uses besides the batch."""

    model: torch.nn.Module  # the TTT objective, DDP-wrapped with several processes
    draft: torch.nn.Module  # the algorithm's draft (its trainer builds it)
    opt: torch.optim.Optimizer
    embed: torch.Tensor
    draft_rows: torch.Tensor
    draft_index: torch.Tensor
    autocast: torch.autocast
    device: torch.device
    trainer: object = None  # the algorithm's trainer module (its spec's `trainer`)


def train_step(
    s: Step, tcfg: TrainSettings, inputs: Inputs, data: Data, pos: Progress, rank, world
) -> dict:
    """One optimizer step on batch `pos.batch` of epoch `pos.epoch`; its metrics record."""
    steps, hidden = tcfg.ttt_steps, s.draft.config.target_hidden_size
    t0 = time.perf_counter()
    lr = lr_at(pos.step, data.total, tcfg.lr, tcfg.warmup_ratio)
    for g in s.opt.param_groups:
        g["lr"] = lr
    packs = [
        [
            row_tensors(inputs.shards, data.names, data.ok, data.rows[r], data.all_positions)
            for r in pack
        ]
        for pack in data.plans[pos.epoch][pos.batch][rank::world]
    ]
    b = pack_batch(packs, steps, len(inputs.aux_ids) * hidden, hidden)
    aux = b.aux
    gen = torch.Generator().manual_seed(tcfg.seed * 7919 + pos.step * 104729 + rank)
    if tcfg.noise_std > 0:
        aux = aux + (torch.rand(aux.shape, generator=gen) * 2 - 1) * tcfg.noise_std * 3**0.5
    ce, correct, counts, weights = s.trainer.losses(s, b, aux, gen)  # the algorithm's
    counts = all_sum(counts, world)
    loss = weighted_loss(ce, counts, weights=weights, scale=world)
    s.opt.zero_grad(set_to_none=True)
    loss.backward()
    grad_norm = torch.nn.utils.clip_grad_norm_(s.draft.parameters(), CLIP)
    check_step(
        pos.step + 1, loss, grad_norm, pos.run_dir
    )  # before the update: checkpoints stay good
    s.opt.step()
    ce_all = all_sum(ce.detach().float(), world)
    correct_all = all_sum(correct.detach().float(), world)
    tokens = int(all_sum(torch.tensor([float(b.tokens)]), world).item())
    return {
        "step": pos.step + 1,
        "epoch": pos.epoch,
        "loss": float(weighted_loss(ce_all, counts, weights=weights)),
        "loss_per_pos": (ce_all / counts.clamp(min=1)).tolist(),
        "acc_per_pos": (correct_all / counts.clamp(min=1)).tolist(),
        "lr": lr,
        "grad_norm": float(grad_norm),
        "tokens": tokens,
        "tokens_per_s": tokens / (time.perf_counter() - t0),
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        **rss_now_mb(),
    }


def checkpoint_due(tcfg: TrainSettings, pos: Progress, total: int) -> bool:
    """At the end, every `checkpoint_every` steps, and once `checkpoint_seconds` have passed
    since the last one (a stop then loses at most about that much work on any CPU)."""
    every, seconds = tcfg.checkpoint_every, tcfg.checkpoint_seconds
    if pos.step == total or (every and pos.step % every == 0):
        return True
    return bool(seconds) and time.monotonic() - pos.saved_at >= seconds


def step_helpers(job: JobSettings, inputs: Inputs, draft, opt, device, precision: str, world):
    hot = inputs.d2t + torch.arange(inputs.d2t.shape[0])
    draft_index = torch.full((inputs.t2d.shape[0],), -1, dtype=torch.long)
    draft_index[hot] = torch.arange(hot.shape[0])  # target id -> draft id (top-k teachers)
    trainer = inputs.algorithm.part("trainer")
    model = trainer.objective(draft, job, inputs, device)
    if world > 1:
        model = torch.nn.parallel.DistributedDataParallel(model, broadcast_buffers=False)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=precision == "bf16")
    return Step(
        model,
        draft,
        opt,
        inputs.heads["embed"].to(device),
        inputs.heads["lm_head"][hot].to(device),
        draft_index,
        autocast,
        device,
        trainer,
    )


def precision_probe(job: JobSettings, target_dir: Path, facts):
    """train.precision auto's probe at this run's shapes (draftsmith.runtime.precision)."""
    from draftsmith.runtime.precision import cached_probe, trainer_shapes

    def probe() -> dict:
        cfg = text_config(json.loads((Path(target_dir) / "config.json").read_text()))
        n_aux = len(layer_ids(job, target_dir))
        shapes = trainer_shapes(cfg, n_aux, job.draft.vocab_size, job.train.batch_tokens)
        return cached_probe(shapes, facts.model)

    return probe


def layer_ids(job: JobSettings, target_dir: Path) -> list[int]:
    """capture.aux_layer_ids resolved for the target (SGLang numbering)."""
    cfg = json.loads((Path(target_dir) / "config.json").read_text())
    return resolve_setting(job.capture.aux_layer_ids, cfg)


def train(
    job: JobSettings,
    shard_paths: list[Path],
    vocab_path: Path,
    target_dir: Path,
    out_dir: Path,
    metrics_path: Path,
    state_root: Path,
    device: str | None = None,
    progress: Progress | None = None,
    offline_path: Path | None = None,
    *,
    spec: AlgorithmSpec,
) -> None:
    tcfg = job.train
    facts = cpu_facts()  # before the process group: it queries the CPU (cpuinfo, AMX)
    rank, world = dist_info()
    device = pick_device(device)
    torch.use_deterministic_algorithms(True, warn_only=True)
    precision, why = resolve_precision(
        tcfg.precision, device.type, facts, precision_probe(job, target_dir, facts)
    )
    log.info("precision %s (%s)", precision, why)
    try:
        serve_gate(target_dir, job.draft.serve_check, layer_ids(job, target_dir))
    except (ExportError, ValueError) as e:
        raise SystemExit(str(e)) from None
    inputs = check_inputs(job, shard_paths, vocab_path, target_dir, rank, spec)
    if world > 1:
        torch.distributed.barrier()
    key = run_key(job.given, shard_paths, vocab_path, target_dir, precision)
    run_dir = state_root / key
    run_dir.mkdir(parents=True, exist_ok=True)
    data = prepare_run(job, inputs, shard_paths, run_dir, rank, world, device)
    draft, opt = build_draft(job, inputs, device)
    pos = resume(run_dir, key, draft, opt, rank)
    if rank == 0:
        check_space(run_dir, draft)  # before the first step: a full disk ends no work
    if progress is not None:  # the stop watcher's view of this run
        progress.__dict__.update(pos.__dict__)
        pos = progress
    s = step_helpers(job, inputs, draft, opt, device, precision, world)
    log.info(
        "run %s: %d rows, %d steps, pack length %d, %d process(es), device %s, precision %s",
        key, len(data.rows), data.total, data.pack_len, world, device, precision,
    )  # fmt: skip
    progress_log = ProgressLog(log, "train", data.total, "steps", done=pos.step)
    while pos.step < data.total:
        if pos.batch >= len(data.plans[pos.epoch]):
            pos.epoch, pos.batch = pos.epoch + 1, 0
            continue
        record = train_step(s, tcfg, inputs, data, pos, rank, world)
        pos.step, pos.batch = pos.step + 1, pos.batch + 1
        if rank == 0:
            append_metrics(run_dir / "metrics.jsonl", record)
            progress_log.update(
                pos.step, loss=f"{record['loss']:.3f}", acc0=f"{record['acc_per_pos'][0]:.2f}",
                tokens_per_s=f"{record['tokens_per_s']:.0f}",
            )  # fmt: skip
            if checkpoint_due(tcfg, pos, data.total):
                meta = {"key": key, "epoch": pos.epoch, "batch": pos.batch, "config": job.given}
                save_checkpoint(run_dir, pos.step, draft, opt, {**meta, "total_steps": data.total})
                pos.saved_step, pos.saved_at = pos.step, time.monotonic()
    if rank == 0:
        provenance = run_provenance(
            job, key, data, (precision, why, facts), inputs, (shard_paths, vocab_path)
        )
        longest = max((end - start for _, start, end in data.rows), default=0)
        if offline_path is not None:  # on the train.eval_rows rows (the algorithm's estimator)
            offline_estimate(
                inputs.algorithm, tcfg.ttt_steps, draft, inputs, data.eval_rows, offline_path
            )
        paths = (target_dir, out_dir, run_dir, metrics_path)
        finish(draft, inputs.algorithm, provenance, (tcfg.ttt_steps, longest), paths)
    if world > 1:
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()


def run_provenance(job: JobSettings, key, data, precision, inputs, paths) -> dict:
    """What the exported draft records of its run: config, steps, the precision as resolved
    (`precision`: resolved, why, CPU facts), the sha256 of each shard and of the vocabulary
    (`paths`: shard paths, vocabulary path) and the target's fingerprint."""
    (resolved, why, facts), (shard_paths, vocab_path) = precision, paths
    return {
        "key": key,
        "config": job.given,
        "total_steps": data.total,
        "pack_len": data.pack_len,
        "precision": {
            "configured": job.train.precision,
            "resolved": resolved,
            "why": why,
            "cpu": facts.as_dict(),
        },
        "shards": {
            n: json.loads(p.with_suffix(".json").read_text()).get("sha256")
            for n, p in zip(data.names, shard_paths, strict=True)
        },
        "vocab_sha256": sha256_file(vocab_path),
        "target_fingerprint": inputs.fingerprint,
    }


def finish(draft, spec, provenance: dict, lengths: tuple[int, int], paths) -> None:
    """Export the draft by its algorithm's exporter (`spec`, resolved when the inputs were
    read; atomically) and copy the run's metrics out (`lengths`: train.ttt_steps, the longest
    row trained; `paths`: target, out and run directories, metrics file); say what the target
    family means for it (RoPE not carried, engines that cannot serve it)."""
    target_dir, out_dir, run_dir, metrics_path = paths
    num_tokens, longest = lengths
    family = target_family(target_dir, draft.config, longest, spec)
    say_family(out_dir, family)
    export_draft(
        draft.cpu(),
        out_dir,
        {**provenance, "versions": versions()},
        spec=spec,
        embed=target_embedding(target_dir),
        verifier=verifier_ref(target_dir),
        num_tokens=num_tokens,
        family=family,
    )
    keep_last_good(out_dir)  # <out>.last-good/: outlives a failed rebuild
    with atomic_path(metrics_path) as tmp:
        shutil.copyfile(run_dir / "metrics.jsonl", tmp)
    log.info("wrote %s and %s", out_dir, metrics_path)


def pick_device(device: str | None) -> torch.device:
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda":
        return torch.device(f"cuda:{os.environ.get('LOCAL_RANK', '0')}")
    return torch.device(device)


def bound_cpu_memory(primitive_cache: int = 64) -> None:
    """Keep the trainer's heap from growing with the number of distinct batch shapes.

    Why (docs/default-run.md, "Training and capture memory on a CPU"): without this, RSS grows
    with every new shape (the packs' length and the compact TTT layout change every step) and
    is not a leak: oneDNN caches one primitive (with its bf16 weight copies) per matmul shape,
    1024 by default, and glibc's dynamic mmap threshold moves freed large tensors onto the
    fragmented heap. A small primitive cache (unless ONEDNN_PRIMITIVE_CACHE_CAPACITY is set;
    read at oneDNN's first use) and a fixed mmap threshold (`MMAP_THRESHOLD`: tensors of 16 MiB
    and more go back to the system when freed; glibc only) bound both. The threshold is a trade
    between page faults and heap: at 128 KiB every activation was a fresh mapping and a step
    took 1.34x as long; at 4 MiB a step of the embedded default still took 1.18x as long as at
    16 MiB, which holds 116 MB more at peak, and 64 or 256 MiB were no faster
    (benchmarks/bench_train_heap.py, benchmarks/results/train_heap_<kind>.md).
    """
    os.environ.setdefault("ONEDNN_PRIMITIVE_CACHE_CAPACITY", str(primitive_cache))
    heap.settle(MMAP_THRESHOLD)


def rss_now_mb() -> dict:
    """Current (not peak) resident memory in MB: all of it, and the anonymous part (the heap;
    RSS also counts the memory-mapped shard pages read so far, which the kernel may drop).
    Empty where /proc is absent."""
    try:
        fields = dict(ln.split(":", 1) for ln in Path("/proc/self/status").read_text().splitlines())
    except OSError:
        return {}
    kb = {k: int(v.split()[0]) for k, v in fields.items() if k in ("VmRSS", "RssAnon")}
    return {
        "rss_mb": kb.get("VmRSS", 0) / 1024,
        "rss_anon_mb": kb.get("RssAnon", 0) / 1024,
    }


def log_stop(pos: Progress) -> None:
    """Said by the stop watcher: where a rerun resumes and what the stop cost."""
    if pos.run_dir is None:
        log.warning("stopped before training started; a rerun starts from the beginning")
        return
    # what a rerun loads is on disk: a checkpoint renamed into place just before the stop counts,
    # though this run had not yet recorded it in `pos` (the stop can land between the two)
    try:
        ckpt = latest_checkpoint(pos.run_dir, pos.run_dir.name)
        saved = "no checkpoint yet" if ckpt is None else f"checkpoint step {int(ckpt.name[5:])}"
    except (OSError, ValueError):  # the directory changing under the listing: say what is known
        saved = (
            "no checkpoint yet" if pos.saved_step is None else f"checkpoint step {pos.saved_step}"
        )
    log.warning(
        "stopped at step %d: a rerun resumes from %s in %s (%.0f s of work since)",
        pos.step,
        saved,
        pos.run_dir,
        time.monotonic() - pos.saved_at,
    )


def recorded(job: JobSettings) -> JobSettings:
    """`job` whose `given` train section (what provenance and checkpoints record) carries the
    x-execution train keys a hand run's --cfg and DRAFTSMITH_RUN lack, at the schema's
    defaults: the record the trainer wrote before the typed settings."""
    train = {**execution_defaults("train"), **job.given["train"]}
    return replace(job, given={**job.given, "train": train})
