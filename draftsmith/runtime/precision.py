"""`train.precision: auto` and `regenerate.dtype: auto` on a CPU, decided by measurement: a
short timed probe of the trainer's own matmul shapes (forward and backward) in fp32 and under
bf16 autocast, or of one decode step of the target at the regeneration batch in float32 and in
bfloat16, the faster one used.

CPU flags do not say which is faster: with AMX a bf16 step ran 1.75x faster than fp32, with
AVX512-BF16 and no AMX 0.57x as fast, with AVX2 only about 27x slower. The probe takes about a
second (bf16 is abandoned as soon as one of its steps takes far longer than fp32's), and its
result is cached per machine, torch version, thread count and shapes under
~/.cache/draftsmith/precision (DRAFTSMITH_CACHE moves it), outside the results: every run on
this machine decides the same way, and the figures go into the draft's provenance.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import time
from collections.abc import Callable
from pathlib import Path

import torch

PROBE_VERSION = 1
MARGIN = 0.95  # bf16 must take under 95% of fp32's time: a tie keeps the exact precision
GIVE_UP = 3.0  # a bf16 step over 3x fp32's is not worth timing further
BUDGET_S = 2.0


def trainer_shapes(target_cfg: dict, n_aux: int, draft_vocab: int, batch_tokens: int) -> dict:
    """The matmuls of one draft step at the run's sizes: fc over the aux states, the layer's
    projections and MLP, the lm_head over the draft vocabulary."""
    hidden = int(target_cfg["hidden_size"])
    inter = int(target_cfg.get("intermediate_size") or 4 * hidden)
    tokens = max(64, min(int(batch_tokens), 1024))
    return {
        "tokens": tokens,
        "linears": [[n_aux * hidden, hidden], [2 * hidden, hidden], [hidden, inter],
                    [inter, hidden], [hidden, int(draft_vocab)]],
    }  # fmt: skip


def fastest(run: Callable[[], None], reps: int, limit_s: float = float("inf")) -> float:
    """The fastest of `reps` timed calls of `run` (after a warm-up call); stops early, returning
    that call's time, when one takes longer than `limit_s`."""
    times = []
    for _ in range(reps + 1):  # the first is a warm-up
        t0 = time.perf_counter()
        run()
        times.append(time.perf_counter() - t0)
        if times[-1] > limit_s:
            return times[-1]
    return min(times[1:])


def step_seconds(precision: str, shapes: dict, reps: int = 2, limit_s: float = float("inf")):
    """The fastest of `reps` timed forward + backward passes through the shapes' linears
    (`fastest`)."""
    gen = torch.Generator().manual_seed(0)
    weights = [torch.randn(o, i, generator=gen, requires_grad=True) for i, o in shapes["linears"]]
    inputs = [torch.randn(shapes["tokens"], i, generator=gen) for i, _ in shapes["linears"]]

    def step() -> None:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16"):
            loss = sum(torch.nn.functional.linear(x, w).float().square().mean()
                       for x, w in zip(inputs, weights, strict=True))  # fmt: skip
        loss.backward()

    return fastest(step, reps, limit_s)


def decode_shapes(target_cfg: dict, batch: int) -> dict:
    """The matmuls of one batched decode step of the target (regenerate.dtype auto): one
    layer's attention projections and MLP, and the lm_head over the full vocabulary, at
    `batch` rows."""
    hidden = int(target_cfg["hidden_size"])
    inter = int(target_cfg.get("intermediate_size") or 4 * hidden)
    heads = int(target_cfg.get("num_attention_heads") or 1)
    kv = int(target_cfg.get("num_key_value_heads") or heads)
    head_dim = int(target_cfg.get("head_dim") or hidden // heads)
    return {
        "decode_rows": max(1, int(batch)),
        "linears": [[hidden, heads * head_dim], [hidden, 2 * kv * head_dim],
                    [heads * head_dim, hidden], [hidden, 2 * inter], [inter, hidden],
                    [hidden, int(target_cfg["vocab_size"])]],
    }  # fmt: skip


def decode_seconds(precision: str, shapes: dict, reps: int = 3, limit_s: float = float("inf")):
    """The fastest of `reps` timed passes through the shapes' linears at the decode rows, the
    weights and inputs in float32 or bfloat16 (a bf16 copy, not autocast; `fastest`)."""
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    gen = torch.Generator().manual_seed(0)
    weights = [torch.randn(o, i, generator=gen).to(dtype) for i, o in shapes["linears"]]
    inputs = [torch.randn(shapes["decode_rows"], i, generator=gen).to(dtype)
              for i, _ in shapes["linears"]]  # fmt: skip

    @torch.inference_mode()
    def step() -> None:
        for x, w in zip(inputs, weights, strict=True):
            torch.nn.functional.linear(x, w)

    return fastest(step, reps, limit_s)


def decide(fp32_s: float, bf16_s: float) -> str:
    return "bf16" if bf16_s < MARGIN * fp32_s else "fp32"


def measure(shapes: dict, timer: Callable = step_seconds) -> dict:
    """Both precisions timed at `shapes` (bf16 given up past GIVE_UP x fp32's time)."""
    fp32 = timer("fp32", shapes)
    bf16 = timer("bf16", shapes, limit_s=GIVE_UP * fp32)
    return {"fp32_ms": round(fp32 * 1e3, 3), "bf16_ms": round(bf16 * 1e3, 3),
            "chosen": decide(fp32, bf16), "shapes": shapes, "version": PROBE_VERSION}  # fmt: skip


def cache_root() -> Path:
    base = os.environ.get("DRAFTSMITH_CACHE") or Path.home() / ".cache" / "draftsmith"
    return Path(base) / "precision"


def probe_key(shapes: dict, cpu_model: str) -> str:
    facts = [
        cpu_model,
        torch.__version__,
        torch.get_num_threads(),
        shapes,
        PROBE_VERSION,
        os.environ.get("ONEDNN_MAX_CPU_ISA", ""),
        os.environ.get("ATEN_CPU_CAPABILITY", ""),
    ]
    return hashlib.sha256(json.dumps(facts, sort_keys=True).encode()).hexdigest()[:16]  # fmt: skip


def cached_probe(shapes: dict, cpu_model: str, root: Path | None = None, timer=step_seconds):
    """The probe's result for this machine and shapes: read from the cache, else measured (under
    a lock, so processes starting together measure once and agree) and written there. The lock
    is one for the whole cache, not one per entry, on purpose: two probes of different shapes
    timed side by side would slow each other down and could choose wrongly."""
    root = cache_root() if root is None else root
    root.mkdir(parents=True, exist_ok=True)
    path = root / f"{probe_key(shapes, cpu_model)}.json"
    with open(root / ".lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            found = json.loads(path.read_text())
            if found.get("version") == PROBE_VERSION and found.get("chosen") in ("fp32", "bf16"):
                return {**found, "cached": True}
        except (OSError, ValueError):
            pass  # absent or unreadable: measure anew
        result = {**measure(shapes, timer), "cpu": cpu_model, "torch": torch.__version__}
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(result, indent=1) + "\n")
        os.replace(tmp, path)
        return {**result, "cached": False}
