"""Training checkpoints: written atomically, found by run key, loaded exactly.

`<run dir>/step-XXXXXX/` holds model.safetensors (the draft), optim.safetensors (AdamW state
per parameter index and torch's RNG state) and meta.json (run key, data position, config),
written last. The directory is staged under `.tmp-step-*`, every file fsynced, and renamed into
place; a process killed at any point leaves only a staging directory that the next start
removes (train.prepare_run), never a checkpoint that loads. The newest two are kept.

The metrics log beside them (`metrics.jsonl`, one JSON line per step, appended) is cut back to
the resumed step on resume; a line torn by a kill (the last one) is dropped there too. A disk that
fills during an append (`append_metrics`) ends the job naming the file and the checkpoint the
rerun resumes from; the torn line is cut off first, so the log ends at a whole step.
"""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from draftsmith.runtime.files import atomic_write_text, fsync_dir

STEP_DIR = re.compile(r"^step-(\d{6})$")


class CheckpointSpaceError(SystemExit):
    """A checkpoint that does not fit on the disk: the path, the bytes it needs and the free."""


class MetricsSpaceError(SystemExit):
    """The disk filled while a step's metrics line was appended: the file, the free space and the
    checkpoint a rerun resumes from."""


def checkpoint_bytes(draft) -> int:
    """What one checkpoint takes: the draft's tensors and AdamW's two moments per parameter
    (float32), with a margin for the headers, the RNG state and meta.json."""
    weights = sum(t.numel() * t.element_size() for t in draft.state_dict().values())
    moments = sum(2 * p.numel() * 4 for p in draft.parameters())
    return int((weights + moments) * 1.02) + (1 << 20)


def space_error(run_dir: Path, need: int, why: str = "") -> CheckpointSpaceError:
    free = shutil.disk_usage(run_dir).free
    return CheckpointSpaceError(
        f"error: a training checkpoint needs about {need / 2**20:.1f} MiB under {run_dir}, which "
        f"has {free / 2**20:.1f} MiB free{why}; free space there (the last complete checkpoint "
        "is kept: the rerun resumes from it)"
    )


def check_space(run_dir: Path, draft) -> None:
    """Before the first checkpoint: two of them must fit (the new one is written beside the last
    before the older ones go)."""
    need = 2 * checkpoint_bytes(draft)
    if shutil.disk_usage(run_dir).free < need:
        raise space_error(run_dir, need)


def save_checkpoint(run_dir: Path, step: int, draft, opt, meta: dict) -> None:
    """`step-XXXXXX/` via a staging dir renamed into place; `meta.json` is written last. A full
    disk ends the job with the path, the bytes needed and free (the staging dir removed)."""
    try:
        write_checkpoint(run_dir, step, draft, opt, meta)
    except OSError as e:
        if e.errno != errno.ENOSPC:
            raise
        raise space_error(run_dir, checkpoint_bytes(draft), f" ({e.strerror})") from None
    except SafetensorError as e:  # safetensors reports a full disk as its own error type
        if "No space left on device" not in str(e):
            raise
        raise space_error(run_dir, checkpoint_bytes(draft), " (no space left on device)") from None
    for old in sorted(d for d in run_dir.iterdir() if STEP_DIR.match(d.name))[:-2]:
        shutil.rmtree(old)


def write_checkpoint(run_dir: Path, step: int, draft, opt, meta: dict) -> None:
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


def metrics_upto(path: Path, step: int) -> list[str]:
    """The metrics lines of steps <= `step`, in order; stops at a torn (unparsable) line."""
    kept: list[str] = []
    if not path.exists():
        return kept
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            break  # only the last line can be torn (a kill mid-append): nothing after it
        if record["step"] <= step:
            kept.append(line)
    return kept


def append_metrics(path: Path, record: dict) -> None:
    """Append one step's metrics line to `path` (in the run directory). A full disk ends the job
    with MetricsSpaceError naming the file, the free space and the newest checkpoint beside it
    (the rerun resumes there and rewrites the later lines); the part of the line that reached
    the disk is cut off first, so the log never ends in a torn line."""
    size = path.stat().st_size if path.exists() else 0
    try:
        with open(path, "a") as f:
            f.write(json.dumps(record) + "\n")
    except OSError as e:
        if e.errno != errno.ENOSPC:
            raise
        try:
            os.truncate(path, size)
        except OSError:
            pass  # the resume drops a torn last line anyway (metrics_upto)
        saved = sorted(d.name for d in path.parent.iterdir() if STEP_DIR.match(d.name))
        resume = f"its last checkpoint {saved[-1]}" if saved else "step 0 (no checkpoint yet)"
        free = shutil.disk_usage(path.parent).free
        raise MetricsSpaceError(
            f"error: disk full appending step {record.get('step')}'s metrics to {path} "
            f"({e.strerror}; {free / 2**20:.1f} MiB free): free space on that file system and "
            f"rerun; training resumes from {resume}, which is complete, and gives the same draft"
        ) from None


def reset_metrics(path: Path, step: int) -> None:
    atomic_write_text(path, "".join(ln + "\n" for ln in metrics_upto(path, step)))
