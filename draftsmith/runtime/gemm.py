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
- for each row count asked for, every form runs over every weight of a group once per
  repetition (so the weights come from memory as they do in a forward, not from a warm cache),
  the forms alternating, the fastest repetition of each kept;
- where another form takes under `MARGIN` of `F.linear`'s time, the fastest one computes that
  row count for the group's modules; every other row count keeps `F.linear`.

The forms: `F.linear`; `transposed`, (W @ x^T)^T; `packed`, oneDNN's linear on a copy of the
weight reordered once into its blocked layout (on a CPU with oneDNN, float32 or bfloat16 weights),
so that no call repacks the weight. Regeneration routes its decode steps with all three; on
one range of the embedded default at 32 rows and one thread, an AMD EPYC's generation was 1.07x
faster with the kernels capped at AVX2 (float32) and 1.11x on its own AVX512 kernels
(bfloat16), every conversation identical (benchmarks/bench_regen_batch.py --routes off on,
benchmarks/results/regen_routes_<kind>.md). The bench routes with the first two,
and the packed form too for the target's verification (K + 1 rows). A group keeps its
packed copies only where the packed form was chosen for some row count (one more copy of those
weights in memory; the report's table says which).

All forms compute the same products in the same dtype; they differ in rounding only. `route`
returns the table of times it decided by, for the job's log and report; `unroute` restores the
modules and drops the packed copies.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from functools import partial

import torch
import torch.nn.functional as F

MARGIN = 0.9  # another form must save 10%: a near tie keeps F.linear
REPS = 5
MAX_ROWS = 64  # row counts above this are prefills and batches: F.linear, never measured
FORMS = ("linear", "transposed", "packed")


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


def pack(weight: torch.Tensor, rows: int) -> torch.Tensor | None:
    """`weight` reordered for oneDNN's linear (a copy, in its blocked layout, for about `rows`
    rows); None where this torch, device or dtype has no such form."""
    if weight.device.type != "cpu" or weight.dtype not in (torch.float32, torch.bfloat16):
        return None
    if not torch.backends.mkldnn.is_available():
        return None
    try:
        return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), rows)
    except (RuntimeError, AttributeError):  # an op this build lacks, a dtype its CPU lacks
        return None


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None):
    """F.linear(x, weight, bias) with the weight `pack`ed."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def _form_fn(form: str, module: torch.nn.Linear):
    """fn(x) computing `module` in `form`."""
    if form == "transposed":
        return partial(transposed_linear, weight=module.weight, bias=module.bias)
    if form == "packed":
        return partial(packed_linear, packed=module.__dict__["packed_weight"], bias=module.bias)
    return partial(F.linear, weight=module.weight, bias=module.bias)


def _routed_forward(module: torch.nn.Linear, routes: dict[int, str], x: torch.Tensor):
    form = routes.get(x.numel() // max(x.shape[-1], 1), "linear")
    return _form_fn(form, module)(x)


@dataclass
class Group:
    """Linear layers of one weight shape and dtype, and the form each row count takes."""

    shape: tuple[int, int]  # (out, in)
    dtype: torch.dtype
    modules: list[torch.nn.Linear] = field(default_factory=list)
    seconds: dict[int, dict[str, float]] = field(default_factory=dict)  # rows: {form: s}

    @property
    def routes(self) -> dict[int, str]:
        """{rows: form} for the row counts another form computes (F.linear elsewhere)."""
        out = {}
        for rows, by_form in self.seconds.items():
            form = min(by_form, key=by_form.get)
            if form != "linear" and by_form[form] < MARGIN * by_form["linear"]:
                out[rows] = form
        return out


def _pass_seconds(form: str, group: Group, x: torch.Tensor) -> float:
    """One pass of `form` over every weight of the group, timed."""
    fns = [_form_fn(form, m) for m in group.modules]
    t0 = time.perf_counter()
    for fn in fns:
        fn(x)
    return time.perf_counter() - t0


def _form_seconds(group: Group, x: torch.Tensor, reps: int, forms) -> dict[str, float]:
    """The fastest of `reps` passes of each form, the forms alternating (after a warm-up of
    each), so a slow spell of the machine hits every form rather than one."""
    best = {form: float("inf") for form in forms}
    for i in range(reps + 1):
        for form in forms:
            seconds = _pass_seconds(form, group, x)
            if i:
                best[form] = min(best[form], seconds)
    return best


def groups_of(model: torch.nn.Module) -> list[Group]:
    """The model's nn.Linear modules grouped by (out, in) shape and dtype, in module order."""
    groups: dict[tuple, Group] = {}
    for m in model.modules():
        if isinstance(m, torch.nn.Linear) and m.weight.dim() == 2:
            key = (tuple(m.weight.shape), m.weight.dtype)
            groups.setdefault(key, Group(key[0], key[1])).modules.append(m)
    return list(groups.values())


def _measure(group: Group, counts: list[int], reps: int, forms: tuple[str, ...]) -> None:
    """Time each of `forms` the group's weights allow at each of `counts` rows; the packed
    copies (made here, or kept from an earlier call) stay on the modules until `_install`."""
    if not counts:
        return
    if "packed" in forms:
        hint = max([*counts, *group.seconds])
        kept = [m.__dict__.get("packed_weight") for m in group.modules]
        packed = [
            pack(m.weight, hint) if p is None else p
            for m, p in zip(group.modules, kept, strict=True)
        ]
        if all(p is not None for p in packed):
            for m, p in zip(group.modules, packed, strict=True):
                m.__dict__["packed_weight"] = p
        else:
            forms = tuple(f for f in forms if f != "packed")
    device = group.modules[0].weight.device
    for r in counts:
        x = torch.randn(r, group.shape[1], dtype=group.dtype, device=device)
        group.seconds[r] = _form_seconds(group, x, reps, forms)


def _install(group: Group) -> None:
    """Route the group's modules as measured; packed copies kept only where used."""
    routes = group.routes
    for m in group.modules:
        if "packed" not in routes.values():
            m.__dict__.pop("packed_weight", None)
        if routes:
            m.forward = partial(_routed_forward, m, routes)
        else:
            m.__dict__.pop("forward", None)


@torch.inference_mode()
def route(
    model: torch.nn.Module,
    rows: Iterable[int],
    reps: int = REPS,
    known: list[dict] = (),
    forms: tuple[str, ...] = FORMS,
) -> list[dict]:
    """Measure each of `forms` (F.linear always) for each row count in `rows` (<= MAX_ROWS)
    on every weight group of `model` and install the fastest; the table of times (seconds for
    the whole group). `known`: the table of an earlier call on the same model, whose row counts
    are not measured again (a job that meets a new row count routes it and keeps the others)."""
    forms = ("linear", *(f for f in forms if f != "linear"))
    counts = sorted({int(r) for r in rows if 1 <= int(r) <= MAX_ROWS})
    table = []
    for group in groups_of(model):
        for t in known:
            if t["shape"] == list(group.shape) and t["dtype"] == str(group.dtype):
                group.seconds[t["rows"]] = {f: t[f"{f}_ms"] / 1e3 for f in FORMS if f"{f}_ms" in t}
        _measure(group, [r for r in counts if r not in group.seconds], reps, forms)
        _install(group)
        routes = group.routes
        table.extend(
            {
                "shape": list(group.shape),
                "dtype": str(group.dtype),
                "modules": len(group.modules),
                "rows": r,
                **{f"{form}_ms": round(s * 1e3, 3) for form, s in by_form.items()},
                "route": routes.get(r, "linear"),
            }
            for r, by_form in sorted(group.seconds.items())
        )
    return table


def unroute(model: torch.nn.Module) -> None:
    """Every linear layer back to F.linear, its packed copy dropped."""
    for m in model.modules():
        if isinstance(m, torch.nn.Linear):
            m.__dict__.pop("forward", None)
            m.__dict__.pop("packed_weight", None)


def summary(table: list[dict]) -> str:
    """One line per row count: how many layers take each other form, and the time of the
    routed layers both ways (the whole model's linear layers once)."""
    out = []
    for r in sorted({t["rows"] for t in table}):
        entries = [t for t in table if t["rows"] == r]
        lin = sum(t["linear_ms"] for t in entries)
        best = sum(t[f"{t['route']}_ms"] for t in entries)
        total = sum(t["modules"] for t in entries)
        moved = [
            f"{sum(t['modules'] for t in entries if t['route'] == form)}/{total} {form}"
            for form in FORMS[1:]
            if any(t["route"] == form for t in entries)
        ]
        out.append(f"{r} rows: {', '.join(moved) or 'all linear'}, {lin:.1f} -> {best:.1f} ms")
    return "; ".join(out)
