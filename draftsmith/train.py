"""Train the EAGLE-3 draft with training-time test, resumable exactly, then export it.

    python -m draftsmith.train --cfg JSON --shards results/hidden/rows_*.safetensors \
        --vocab results/vocab/vocab.safetensors --target results/target \
        --out results/draft --metrics results/train/metrics.jsonl [--state state/train]
    torchrun --standalone --nproc-per-node N -m draftsmith.train ...      (DDP, gloo on CPU)

Data: every row of every shard, shuffled per epoch with a seeded generator, packed first-fit
into `batch_tokens // longest_row` packs of `longest_row` tokens (attention stays within a
row); one batch is one optimizer step, its packs split over the processes. The data position
(epoch, batch) is part of every checkpoint.

Shards: before its first use each shard's sha256 is proven against its manifest (the result is
cached in `<state>/verified/<range>.json`, keyed by the file's size, mtime and sha256, so a rerun
does not re-read unchanged shards).

State: `<state>/<run key>/` where the key hashes the train/draft/capture config, the shards'
names and sha256, the vocabulary and the target fingerprint, so a changed input never resumes a
stale run, and a shard rebuilt with identical bytes resumes where it stopped. It holds the teacher argmax flags (computed once), `metrics.jsonl` and `step-XXXXXX/`
checkpoints (model + optimizer + RNG in safetensors, `meta.json` written last; the directory is
renamed into place). A rerun resumes from the newest complete checkpoint.
"""

from __future__ import annotations

import argparse
import ctypes
import hashlib
import json
import logging
import math
import os
import re
import resource
import shutil
import tempfile
import time
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from tqdm import tqdm

from draftsmith.common import (
    atomic_path,
    atomic_write_text,
    fsync_dir,
    init_logging,
    merge_run,
    parse_cfg,
    remove_stale_temps,
    set_threads,
    sha256_file,
    versions,
)
from draftsmith.config import aux_layer_ids
from draftsmith.export import export_draft, target_embedding, verifier_ref
from draftsmith.finite import check_step
from draftsmith.model import DraftConfig, Eagle3Draft
from draftsmith.repair import discard_refused_shards, keep_last_good
from draftsmith.shards import ShardError, open_shard, verify_cached
from draftsmith.storage import StorageError, check_draft_vocab
from draftsmith.ttt import (
    TTTObjective,
    batch_teacher,
    pack_batch,
    step_masks,
    teacher_ok,
    weighted_loss,
)
from draftsmith.vocab import load_vocab

CLIP = 0.5
STEP_DIR = re.compile(r"^step-(\d{6})$")
# train keys that do not change the result (and so do not change the run key)
NON_SEMANTIC = ("role", "checkpoint_every")
log = logging.getLogger("draftsmith.train")


# ---------------------------------------------------------------------------------------------
# Inputs


def target_tensors(target_dir: Path) -> dict[str, torch.Tensor]:
    """The frozen target pieces training needs, read by name: embed, lm_head (tied ok), norm."""
    want = {"embed": "embed_tokens.weight", "lm_head": "lm_head.weight", "norm": "norm.weight"}
    found: dict[str, torch.Tensor] = {}
    files = sorted(target_dir.glob("*.safetensors"))
    if not files:
        raise SystemExit(f"{target_dir}: no *.safetensors weights")
    for path in files:
        with safe_open(str(path), framework="pt") as f:
            for key in f.keys():
                for role, suffix in want.items():
                    top = key.count(".") <= 2 and "layers." not in key
                    if key.endswith(suffix) and top and role not in found:
                        found[role] = f.get_tensor(key).float()
    if "embed" not in found or "norm" not in found:
        raise SystemExit(f"{target_dir}: no embed_tokens.weight / final norm.weight in the weights")
    found.setdefault("lm_head", found["embed"])  # tied embeddings (SmolLM2)
    return found


def run_key(cfg: dict, shard_paths: list[Path], vocab: Path, target_dir: Path) -> str:
    train = {k: v for k, v in cfg["train"].items() if k not in NON_SEMANTIC}
    h = hashlib.sha256()
    h.update(json.dumps([train, cfg["draft"], cfg["capture"]], sort_keys=True).encode())
    for p in shard_paths:  # the sha256 covers the tensors and the manifest copy in the header
        h.update(
            p.name.encode() + json.loads(p.with_suffix(".json").read_text())["sha256"].encode()
        )
    h.update(sha256_file(vocab).encode())
    meta = target_dir / "draftsmith_target.json"
    h.update(meta.read_bytes() if meta.exists() else (target_dir / "config.json").read_bytes())
    return h.hexdigest()[:16]


def prove_shards(shards, stamp_dir: Path) -> None:
    """Check each shard's sha256 against its manifest, skipping files proven before unchanged."""
    hashed = 0
    for s in tqdm(shards, desc="verify shards", unit="shard", disable=None):
        hashed += verify_cached(s.path, s.manifest, stamp_dir)
    log.info(
        "sha256 of %d shard(s) proven: %d hashed now, %d unchanged since proven",
        len(shards),
        hashed,
        len(shards) - hashed,
    )


def plan_epochs(lengths: list[int], cfg: dict) -> tuple[list[list[list[list[int]]]], int]:
    """Per epoch: batches -> packs -> row indices (seeded, independent of the process count)."""
    pack_len = max(lengths)
    packs_per_batch = cfg["batch_tokens"] // pack_len
    if packs_per_batch < 1:
        raise SystemExit(
            f"train.batch_tokens {cfg['batch_tokens']} is smaller than the longest "
            f"row ({pack_len} tokens); raise it"
        )
    plans = []
    for epoch in range(cfg["epochs"]):
        gen = torch.Generator().manual_seed(cfg["seed"] * 1_000_003 + epoch)
        order = torch.randperm(len(lengths), generator=gen).tolist()
        batches, packs, fill = [], [[] for _ in range(packs_per_batch)], [0] * packs_per_batch
        for r in order:
            i = next((i for i, f in enumerate(fill) if f + lengths[r] <= pack_len), None)
            if i is None:
                batches.append([p for p in packs if p])
                packs, fill, i = [[] for _ in range(packs_per_batch)], [0] * packs_per_batch, 0
            packs[i].append(r)
            fill[i] += lengths[r]
        if any(fill):
            batches.append([p for p in packs if p])
        plans.append(batches)
    return plans, pack_len


def lr_at(step: int, total: int, peak: float, warmup_ratio: float) -> float:
    """Linear warmup then cosine decay to 0 (a pure function of the step: the schedule state)."""
    warmup = math.ceil(warmup_ratio * total)
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return peak * 0.5 * (1.0 + math.cos(math.pi * progress))


# ---------------------------------------------------------------------------------------------
# Checkpoints


def save_checkpoint(run_dir: Path, step: int, draft, opt, meta: dict) -> None:
    """`step-XXXXXX/` via a staging dir renamed into place; `meta.json` is written last."""
    final = run_dir / f"step-{step:06d}"
    stage = Path(tempfile.mkdtemp(prefix=f".tmp-step-{step:06d}-", dir=run_dir))
    try:
        save_file(
            {k: v.detach().cpu().contiguous() for k, v in draft.state_dict().items()},
            str(stage / "model.safetensors"),
        )
        tensors = {"rng.torch": torch.get_rng_state()}
        params = list(draft.parameters())
        for i, p in enumerate(params):
            for k, v in opt.state.get(p, {}).items():
                tensors[f"opt.{i}.{k}"] = v.detach().cpu().contiguous()
        save_file(tensors, str(stage / "optim.safetensors"))
        (stage / "meta.json").write_text(json.dumps({**meta, "step": step}, indent=2))
        for f in stage.iterdir():
            with open(f, "rb") as fh:
                os.fsync(fh.fileno())
        fsync_dir(stage)
        if final.exists():
            shutil.rmtree(final)
        os.replace(stage, final)
        fsync_dir(run_dir)
    except BaseException:
        shutil.rmtree(stage, ignore_errors=True)
        raise
    for old in sorted(d for d in run_dir.iterdir() if STEP_DIR.match(d.name))[:-2]:
        shutil.rmtree(old)


def latest_checkpoint(run_dir: Path, key: str) -> Path | None:
    for d in sorted((d for d in run_dir.iterdir() if STEP_DIR.match(d.name)), reverse=True):
        meta = d / "meta.json"
        if meta.is_file() and json.loads(meta.read_text()).get("key") == key:
            return d
    return None


def load_checkpoint(ckpt: Path, draft, opt) -> dict:
    draft.load_state_dict(load_file(str(ckpt / "model.safetensors")), strict=True)
    tensors = load_file(str(ckpt / "optim.safetensors"))
    params = list(draft.parameters())
    state: dict[int, dict] = {}
    for name, v in tensors.items():
        if name.startswith("opt."):
            _, i, k = name.split(".", 2)
            state.setdefault(int(i), {})[k] = v
    opt.load_state_dict({"state": state, "param_groups": opt.state_dict()["param_groups"]})
    if set(state) != set(range(len(params))) and state:
        raise SystemExit(f"{ckpt}: optimizer state covers {sorted(state)} of {len(params)} params")
    torch.set_rng_state(tensors["rng.torch"])
    return json.loads((ckpt / "meta.json").read_text())


# ---------------------------------------------------------------------------------------------
# Training


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


def train(
    cfg: dict,
    shard_paths: list[Path],
    vocab_path: Path,
    target_dir: Path,
    out_dir: Path,
    metrics_path: Path,
    state_root: Path,
    device: str | None = None,
) -> None:
    tcfg, steps = cfg["train"], cfg["train"]["ttt_steps"]
    rank, world = dist_info()
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(
        f"cuda:{os.environ.get('LOCAL_RANK', '0')}" if device == "cuda" else device
    )
    torch.use_deterministic_algorithms(True, warn_only=True)

    # inputs: target pieces, vocab, shards (layer ids and target checked against the manifests)
    target_cfg = json.loads((target_dir / "config.json").read_text())
    target_cfg = target_cfg.get("text_config", target_cfg)
    ids = aux_layer_ids(cfg["capture"]["aux_layer_ids"], int(target_cfg["num_hidden_layers"]))
    d2t, t2d = load_vocab(vocab_path)
    if d2t.shape[0] != cfg["draft"]["vocab_size"]:
        raise SystemExit(
            f"{vocab_path}: {d2t.shape[0]} draft tokens, draft.vocab_size is "
            f"{cfg['draft']['vocab_size']}"
        )
    heads = target_tensors(target_dir)
    expect = {"aux_layer_ids": ids, "hidden_size": int(target_cfg["hidden_size"])}
    meta_file = target_dir / "draftsmith_target.json"
    if meta_file.exists():
        expect["target_fingerprint"] = json.loads(meta_file.read_text())["fingerprint"]
    try:
        shards = [open_shard(p, expect=expect) for p in shard_paths]
        for s in shards:  # a top-k teacher over the draft vocabulary must be over this one
            try:
                check_draft_vocab(s.manifest, d2t + torch.arange(d2t.shape[0]))
            except StorageError as e:
                raise ShardError(f"{s.path}: {e}") from None
        if rank == 0:
            prove_shards(shards, state_root / "verified")
    except ShardError as e:
        raise discard_refused_shards(e, shard_paths) from None  # the next run rebuilds them
    if world > 1:
        torch.distributed.barrier()
    names = [p.stem for p in shard_paths]
    key = run_key(cfg, shard_paths, vocab_path, target_dir)
    run_dir = state_root / key
    run_dir.mkdir(parents=True, exist_ok=True)
    if rank == 0:
        remove_stale_temps(run_dir, ".tmp-step-")  # staging dirs of a killed run
    all_positions = tcfg.get("loss_positions", "assistant") == "all"
    finals = {s.storage.final for s in shards}
    if all_positions and finals != {"states"}:
        raise SystemExit(
            f"train.loss_positions all needs capture.storage.final states (the teacher at "
            f"every position); the shards hold {sorted(finals)}"
        )
    ok = teacher_flags(shards, names, heads, t2d, run_dir, rank, world, device, all_positions)
    rows = [
        (s, a, b)
        for s, sh in enumerate(shards)
        for a, b in zip(sh.row_offsets[:-1].tolist(), sh.row_offsets[1:].tolist(), strict=True)
    ]
    plans, pack_len = plan_epochs([b - a for _, a, b in rows], tcfg)
    total = sum(len(p) for p in plans)
    total = min(total, tcfg["max_steps"]) if tcfg["max_steps"] else total

    # model, optimizer, resume
    dcfg = DraftConfig.from_target_config(target_cfg, cfg["draft"]["vocab_size"], ids)
    torch.manual_seed(tcfg["seed"])
    draft = Eagle3Draft(dcfg)
    draft.set_vocab(d2t, t2d)
    hot = d2t + torch.arange(d2t.shape[0])
    if cfg["draft"]["init_from_target"]:
        with torch.no_grad():
            draft.lm_head.weight.copy_(heads["lm_head"][hot])
            draft.norm.weight.copy_(heads["norm"])
    draft.to(device)
    opt = torch.optim.AdamW(draft.parameters(), lr=tcfg["lr"], weight_decay=0.0)
    step, epoch, batch_idx = 0, 0, 0
    metrics_tmp = run_dir / "metrics.jsonl"
    ckpt = latest_checkpoint(run_dir, key)
    if ckpt is not None:
        meta = load_checkpoint(ckpt, draft, opt)
        step, epoch, batch_idx = meta["step"], meta["epoch"], meta["batch"]
        log.info("resuming %s at step %d (epoch %d, batch %d)", ckpt, step, epoch, batch_idx)
    if rank == 0:
        kept = []
        if metrics_tmp.exists():
            kept = [
                ln
                for ln in metrics_tmp.read_text().splitlines()
                if ln.strip() and json.loads(ln)["step"] <= step
            ]
        atomic_write_text(metrics_tmp, "".join(ln + "\n" for ln in kept))
    embed, draft_rows = heads["embed"].to(device), heads["lm_head"][hot].to(device)
    draft_index = torch.full((t2d.shape[0],), -1, dtype=torch.long)
    draft_index[hot] = torch.arange(hot.shape[0])  # target id -> draft id (top-k teachers)
    objective = TTTObjective(draft, steps)
    model = objective
    if world > 1:
        model = torch.nn.parallel.DistributedDataParallel(objective, broadcast_buffers=False)
    provenance = {
        "key": key,
        "config": cfg,
        "total_steps": total,
        "pack_len": pack_len,
        "shards": {
            n: json.loads(p.with_suffix(".json").read_text()).get("sha256")
            for n, p in zip(names, shard_paths, strict=True)
        },
        "vocab_sha256": sha256_file(vocab_path),
        "target_fingerprint": expect.get("target_fingerprint"),
    }

    log.info(
        "run %s: %d rows, %d steps, pack length %d, %d process(es), device %s",
        key,
        len(rows),
        total,
        pack_len,
        world,
        device,
    )
    bar = tqdm(total=total, initial=step, desc="train", disable=None if rank == 0 else True)
    precision = tcfg.get("precision", "auto")
    use_bf16 = precision == "bf16" or (precision == "auto" and device.type == "cuda")
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=use_bf16)
    while step < total:
        if batch_idx >= len(plans[epoch]):
            epoch, batch_idx = epoch + 1, 0
            continue
        t0 = time.perf_counter()
        lr = lr_at(step, total, tcfg["lr"], tcfg["warmup_ratio"])
        for g in opt.param_groups:
            g["lr"] = lr
        packs = [
            [_row(shards, names, ok, rows[r], all_positions) for r in pack]
            for pack in plans[epoch][batch_idx][rank::world]
        ]
        b = pack_batch(packs, steps, 3 * dcfg.target_hidden_size, dcfg.target_hidden_size)
        masks = step_masks(b.seg, b.loss_mask, b.ok, steps, b.length).to(device)
        counts = all_sum(masks.sum(dim=(1, 2)).float(), world)
        aux = b.aux
        if tcfg["noise_std"] > 0:
            gen = torch.Generator().manual_seed(tcfg["seed"] * 7919 + step * 104729 + rank)
            aux = aux + (torch.rand(aux.shape, generator=gen) * 2 - 1) * tcfg["noise_std"] * 3**0.5
        teacher = batch_teacher(b, draft_rows, draft_index)
        embeds = embed[b.ids[:, : b.length + steps + 1].to(device)]
        with autocast:
            ce, correct = model(
                aux.to(device),
                embeds,
                b.pos.to(device),
                b.seg[:, : b.length].to(device),
                masks,
                teacher,
            )
        loss = weighted_loss(ce, counts, scale=world)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(draft.parameters(), CLIP)
        check_step(step + 1, loss, grad_norm, run_dir)  # before the update: checkpoints stay good
        opt.step()
        ce_all = all_sum(ce.detach().float(), world)
        correct_all = all_sum(correct.detach().float(), world)
        tokens = int(all_sum(torch.tensor([float(b.tokens)]), world).item())
        step, batch_idx = step + 1, batch_idx + 1
        if rank == 0:
            per_pos = (ce_all / counts.clamp(min=1)).tolist()
            record = {
                "step": step,
                "epoch": epoch,
                "loss": float(weighted_loss(ce_all, counts)),
                "loss_per_pos": per_pos,
                "acc_per_pos": (correct_all / counts.clamp(min=1)).tolist(),
                "lr": lr,
                "grad_norm": float(grad_norm),
                "tokens": tokens,
                "tokens_per_s": tokens / (time.perf_counter() - t0),
                "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                **rss_now_mb(),
            }
            with open(metrics_tmp, "a") as f:
                f.write(json.dumps(record) + "\n")
            bar.update(1)
            bar.set_postfix(loss=f"{record['loss']:.3f}", acc0=f"{record['acc_per_pos'][0]:.2f}")
            every = tcfg["checkpoint_every"]
            if step == total or (every and step % every == 0):
                save_checkpoint(
                    run_dir,
                    step,
                    draft,
                    opt,
                    {
                        "key": key,
                        "epoch": epoch,
                        "batch": batch_idx,
                        "total_steps": total,
                        "config": cfg,
                    },
                )
    bar.close()
    if rank == 0:
        export_draft(
            draft.cpu(),
            out_dir,
            {**provenance, "versions": versions()},
            embed=target_embedding(target_dir),
            verifier=verifier_ref(target_dir),
            num_tokens=steps,
        )
        keep_last_good(out_dir)  # <out>.last-good/: outlives a failed rebuild
        with atomic_path(metrics_path) as tmp:
            shutil.copyfile(metrics_tmp, tmp)
        log.info("wrote %s and %s", out_dir, metrics_path)
    if world > 1:
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()


def bound_cpu_memory(primitive_cache: int = 64, mmap_threshold: int = 4 << 20) -> None:
    """Keep the trainer's heap from growing with the number of distinct batch shapes.

    Measured (docs/tuning.md): without this, RSS grows with every new shape (the packs' length
    and the compact TTT layout change every step) and is not a leak: oneDNN caches one primitive
    (with its bf16 weight copies) per matmul shape, 1024 by default, and glibc's dynamic mmap
    threshold moves freed large tensors onto the fragmented heap. A small primitive cache
    (unless ONEDNN_PRIMITIVE_CACHE_CAPACITY is set; read at oneDNN's first use) and a fixed mmap
    threshold (tensors of 4 MiB and more go back to the system when freed; glibc only) bound
    both. The threshold is a trade: at 128 KiB every activation was a fresh mapping and a step
    took 1.34x as long (page faults); at 4 MiB only the large ones are.
    """
    os.environ.setdefault("ONEDNN_PRIMITIVE_CACHE_CAPACITY", str(primitive_cache))
    try:
        ctypes.CDLL(None).mallopt(-3, mmap_threshold)  # M_MMAP_THRESHOLD
    except (OSError, AttributeError):
        pass  # not glibc


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


def _row(shards, names, ok, row, all_positions: bool = False) -> dict:
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


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(
        prog="python -m draftsmith.train",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--cfg", required=True, help="JSON of the train, draft and capture sections")
    ap.add_argument("--shards", nargs="+", required=True, type=Path)
    ap.add_argument("--vocab", required=True, type=Path)
    ap.add_argument("--target", required=True, type=Path)
    ap.add_argument("--out", required=True, type=Path, help="the exported draft directory")
    ap.add_argument("--metrics", required=True, type=Path)
    ap.add_argument("--state", type=Path, default=Path("state/train"))
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--device", choices=["cpu", "cuda"], help="default: cuda when available")
    args = ap.parse_args(argv)
    init_logging("draftsmith.train")
    cfg = merge_run(parse_cfg(args.cfg), sections=("train",))  # train.checkpoint_every
    for section in ("train", "draft", "capture"):
        if section not in cfg:
            raise SystemExit(f"--cfg has no {section!r} section")
    set_threads(args.threads)
    bound_cpu_memory()
    train(
        cfg,
        sorted(args.shards),
        args.vocab,
        args.target,
        args.out,
        args.metrics,
        args.state,
        args.device,
    )


if __name__ == "__main__":
    main()
