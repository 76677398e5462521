"""Linear layers at a few rows, routed by measurement.

At batch size 1 a decoder runs its linear layers on 1 to k + 1 rows: a decode step, a
verification pass of k proposals, a draft extension. The BLAS behind `F.linear` (x @ W^T) does
not handle every one of those row counts well. With MKL on an AMD EPYC, 3 rows through the
embedded target's lm_head took 35 ms against 9 ms for one row, while the same product computed
as W @ x^T (N x K times K x M, then transposed back) took 4 ms; a whole forward of 3 tokens
took 122 ms one way and 53 ms the other. Which form is faster depends on the CPU, the BLAS, the
shape and the row count. One row is the extreme case: the same MKL's matrix-vector product
read the target's weights at 11 GB/s, the matrix-matrix product of that row and a row of zeros
at 27 GB/s. So `route` measures instead of guessing:

- the model's linear layers are grouped by weight shape and dtype;
- for each row count asked for, both forms run over every weight of a group once per
  repetition (so the weights come from memory as they do in a forward, not from a warm cache),
  the two forms alternating, the fastest repetition of each kept;
- where the transposed form takes under `MARGIN` of `F.linear`'s time, the group's modules
  compute that row count that way; every other row count (a prefill, a batch) keeps `F.linear`.

Both forms compute the same products in the same dtype; they differ in rounding only. `route`
returns the table of times it decided by, for the job's log and report; `unroute` restores the
modules.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from functools import partial

import torch
import torch.nn.functional as F

MARGIN = 0.9  # the transposed form must save 10%: a near tie keeps F.linear
REPS = 5
MAX_ROWS = 64  # row counts above this are prefills and batches: F.linear, never measured


def transposed_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None):
    """F.linear(x, weight, bias) computed as (weight @ x^T)^T; one row is padded with a row of
    zeros (a matrix-matrix product, not a matrix-vector one) and the padding's column dropped."""
    flat = x.reshape(-1, x.shape[-1])
    rows = flat.shape[0]
    if rows == 1:
        flat = torch.cat([flat, flat.new_zeros(1, flat.shape[1])])
    y = (weight @ flat.t())[:, :rows].t().contiguous()
    if bias is not None:
        y = y + bias
    return y.reshape(*x.shape[:-1], weight.shape[0])


def _routed_forward(module: torch.nn.Linear, rows: frozenset[int], x: torch.Tensor):
    if x.numel() // max(x.shape[-1], 1) in rows:
        return transposed_linear(x, module.weight, module.bias)
    return F.linear(x, module.weight, module.bias)


@dataclass
class Group:
    """Linear layers of one weight shape and dtype, and the row counts routed transposed."""

    shape: tuple[int, int]  # (out, in)
    dtype: torch.dtype
    modules: list[torch.nn.Linear] = field(default_factory=list)
    seconds: dict[int, tuple[float, float]] = field(default_factory=dict)  # rows: (linear, T)

    @property
    def transposed(self) -> frozenset[int]:
        return frozenset(m for m, (lin, tr) in self.seconds.items() if tr < MARGIN * lin)


def _pass_seconds(fn, group: Group, x: torch.Tensor) -> float:
    """One pass of `fn` over every weight of the group, timed."""
    t0 = time.perf_counter()
    for m in group.modules:
        fn(x, m.weight, m.bias)
    return time.perf_counter() - t0


def _both_seconds(group: Group, x: torch.Tensor, reps: int) -> tuple[float, float]:
    """The fastest of `reps` passes of each form, the two forms alternating (after a warm-up
    of each), so a slow spell of the machine hits both rather than one."""
    best = [float("inf"), float("inf")]
    for i in range(reps + 1):
        for j, fn in enumerate((F.linear, transposed_linear)):
            seconds = _pass_seconds(fn, group, x)
            if i:
                best[j] = min(best[j], seconds)
    return best[0], best[1]


def groups_of(model: torch.nn.Module) -> list[Group]:
    """The model's nn.Linear modules grouped by (out, in) shape and dtype, in module order."""
    groups: dict[tuple, Group] = {}
    for m in model.modules():
        if isinstance(m, torch.nn.Linear) and m.weight.dim() == 2:
            key = (tuple(m.weight.shape), m.weight.dtype)
            groups.setdefault(key, Group(key[0], key[1])).modules.append(m)
    return list(groups.values())


@torch.inference_mode()
def route(model: torch.nn.Module, rows: Iterable[int], reps: int = REPS) -> list[dict]:
    """Measure both forms for each row count in `rows` (<= MAX_ROWS) on every weight group
    of `model` and install the faster one; the table of times (seconds for the whole group)."""
    counts = sorted({int(r) for r in rows if 1 <= int(r) <= MAX_ROWS})
    table = []
    for group in groups_of(model):
        device = group.modules[0].weight.device
        for r in counts:
            x = torch.randn(r, group.shape[1], dtype=group.dtype, device=device)
            group.seconds[r] = _both_seconds(group, x, reps)
        chosen = group.transposed
        for m in group.modules:
            if chosen:
                m.forward = partial(_routed_forward, m, chosen)
            else:
                m.__dict__.pop("forward", None)
        table.extend(
            {
                "shape": list(group.shape),
                "modules": len(group.modules),
                "rows": r,
                "linear_ms": round(lin * 1e3, 3),
                "transposed_ms": round(tr * 1e3, 3),
                "route": "transposed" if r in chosen else "linear",
            }
            for r, (lin, tr) in sorted(group.seconds.items())
        )
    return table


def unroute(model: torch.nn.Module) -> None:
    """Every linear layer back to F.linear."""
    for m in model.modules():
        if isinstance(m, torch.nn.Linear):
            m.__dict__.pop("forward", None)


def summary(table: list[dict]) -> str:
    """One line per row count: how many layers compute it transposed, and the time of the
    routed layers both ways (the whole model's linear layers once)."""
    out = []
    for r in sorted({t["rows"] for t in table}):
        entries = [t for t in table if t["rows"] == r]
        lin = sum(t["linear_ms"] for t in entries)
        best = sum(t[f"{t['route']}_ms"] for t in entries)
        routed = sum(t["modules"] for t in entries if t["route"] == "transposed")
        total = sum(t["modules"] for t in entries)
        out.append(f"{r} rows: {routed}/{total} layers transposed, {lin:.1f} -> {best:.1f} ms")
    return "; ".join(out)
