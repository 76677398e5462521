"""Non-finite numbers are errors where they first appear.

- config: `nonfinite_keys(config)` names every NaN or infinite number of a config (YAML's `.inf`
  and `.nan` get past JSON-schema bounds); `draftsmith.config.checks.check_config` refuses them.
- training: `check_step(step, loss, grad_norm, run_dir)` runs before the optimizer step, so the
  weights in memory and every checkpoint on disk stay the last good ones; it stops the job naming
  the step and the checkpoint the next run resumes from.
- export: `nonfinite_tensors(path)` and `metrics_problem(path)` back `export check`: a draft with
  NaN or infinite weights, or whose training metrics end non-finite, is refused.

Nothing here imports torch at module level (the Snakefile imports `nonfinite_keys`).
"""

from __future__ import annotations

import json
import math
import os
import re
from pathlib import Path

STEP_DIR = re.compile(r"^step-(\d{6})$")


class NonFiniteError(SystemExit):
    """A non-finite loss, gradient norm, weight or metric; the message says where."""


def nonfinite_keys(value, where: str = "config") -> list[str]:
    """`key = value` of every float in `value` (nested dicts and lists) that is NaN or infinite."""
    if isinstance(value, float) and not math.isfinite(value):
        return [f"{where} = {value}"]
    if isinstance(value, dict):
        return [b for k, v in value.items() for b in nonfinite_keys(v, f"{where}.{k}")]
    if isinstance(value, (list, tuple)):
        return [b for i, v in enumerate(value) for b in nonfinite_keys(v, f"{where}[{i}]")]
    return []


def last_good_checkpoint(run_dir: str | os.PathLike) -> Path | None:
    """The newest complete checkpoint (`step-NNNNNN/` with its meta.json) under `run_dir`."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        return None
    done = [d for d in run_dir.iterdir() if STEP_DIR.match(d.name) and (d / "meta.json").is_file()]
    return max(done, default=None)


def _scalar(x) -> float:
    return float(x.detach()) if hasattr(x, "detach") else float(x)


def check_step(step: int, loss, grad_norm, run_dir: str | os.PathLike) -> None:
    """Stop training at `step` (1-based) when its loss or gradient norm is NaN or infinite.

    Called after backward and before the optimizer step: the weights have not taken the bad
    update and no checkpoint of this step exists, so the newest checkpoint is the last good one.
    """
    values = {"loss": _scalar(loss), "gradient norm": _scalar(grad_norm)}
    bad = [f"{name} {v}" for name, v in values.items() if not math.isfinite(v)]
    if not bad:
        return
    ckpt = last_good_checkpoint(run_dir)
    kept = (
        f"the last good checkpoint {ckpt} is kept and a rerun resumes from it"
        if ckpt is not None
        else f"no checkpoint was written yet (none under {run_dir})"
    )
    raise NonFiniteError(
        f"error: training step {step}: {' and '.join(bad)} is not finite; stopped before the "
        f"optimizer step, no draft exported; {kept}. Check train.lr, train.noise_std and the "
        f"shards (`python -m draftsmith shards verify`)"
    )


SLICE_ELEMENTS = 1 << 25  # values per slice read: 128 MiB in float32, whatever the tensor's size


def nonfinite_tensors(path: str | os.PathLike) -> list[str]:
    """`name: N NaN, M inf of T` for every floating tensor of a safetensors file that has any.
    A large tensor is read in slices of its first dimension (memory stays bounded), each
    slice as float32 (so float8 and bf16 tensors are read too)."""
    from safetensors import safe_open

    out = []
    with safe_open(str(path), framework="pt") as f:
        for name in f.keys():
            problem = tensor_problem(f, name)
            if problem:
                out.append(problem)
    return out


def tensor_problem(handle, name: str) -> str | None:
    """`nonfinite_tensors`' line for one tensor of an open safetensors file, None if finite."""
    import torch

    sl = handle.get_slice(name)
    dtype, shape = sl.get_dtype(), list(sl.get_shape())
    if not (dtype.startswith("F") or dtype == "BF16"):  # F64 ... F8_E5M2, BF16; not ints, bool
        return None
    total = math.prod(shape)
    if len(shape) == 0 or total <= SLICE_ELEMENTS:
        parts = [handle.get_tensor(name)]
    else:
        step = max(1, SLICE_ELEMENTS // max(1, total // shape[0]))
        parts = (sl[a : a + step] for a in range(0, shape[0], step))
    nan = inf = 0
    for part in parts:
        x = part.float()
        bad = ~torch.isfinite(x)
        if bool(bad.any()):
            n_nan = int(torch.isnan(x).sum())
            nan, inf = nan + n_nan, inf + int(bad.sum()) - n_nan
    return f"{name}: {nan} NaN, {inf} inf of {total}" if nan or inf else None


def metrics_problem(path: str | os.PathLike) -> str | None:
    """What is non-finite in the last record of a training metrics file (None: all finite)."""
    path = Path(path)
    lines = [ln for ln in path.read_text().splitlines() if ln.strip()]
    if not lines:
        return None
    try:
        last = json.loads(lines[-1])
    except json.JSONDecodeError as e:
        return f"{path}: last line is not JSON ({e})"
    bad = [
        b
        for key in ("loss", "grad_norm", "loss_per_pos")
        for b in nonfinite_keys(last.get(key), key)
    ]
    if bad:
        return f"{path}: training ended non-finite at step {last.get('step')}: {', '.join(bad)}"
    return None
