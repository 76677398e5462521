"""Training checkpoints: written atomically, found by run key, loaded exactly.

`<run dir>/step-XXXXXX/` holds model.safetensors (the draft), optim.safetensors (AdamW state
per parameter index and torch's RNG state) and meta.json (run key, data position, config),
written last. The directory is staged under `.tmp-step-*`, every file fsynced, and renamed into
place; a process killed at any point leaves only a staging directory that the next start
removes (train.prepare_run), never a checkpoint that loads. The newest two are kept.

The metrics log beside them (`metrics.jsonl`, one JSON line per step, appended) is cut back to
the resumed step on resume; a line torn by a kill (the last one) is dropped there too.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from draftsmith.runtime.files import atomic_write_text, fsync_dir

STEP_DIR = re.compile(r"^step-(\d{6})$")


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


def reset_metrics(path: Path, step: int) -> None:
    atomic_write_text(path, "".join(ln + "\n" for ln in metrics_upto(path, step)))
