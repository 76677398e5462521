"""The offline acceptance estimate's report, whatever algorithm made it: the rows held out of
training (`split_rows`), tau from per-step acceptance rates, the file training writes
(results/train/offline_acceptance.json) and its line in the benchmark report.

`for_run` is the trainer's call: the algorithm's `estimator` (its spec names the module, with
`for_run(steps, draft, inputs, rows, path)`) estimates on the held-out rows; without held-out
rows, or for an algorithm without an estimator, the file says why there is no estimate.
"""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path
from typing import TYPE_CHECKING

from draftsmith.runtime.files import atomic_write_json

if TYPE_CHECKING:
    from draftsmith.config.settings import BenchSettings

log = logging.getLogger("draftsmith.train.loop")


def split_rows(rows: list, n_eval: int) -> tuple[list, list]:
    """(training rows, held-out rows): `n_eval` evenly spaced rows of `rows` held out."""
    from draftsmith.data.prompts import heldout_indices

    if n_eval <= 0:
        return list(rows), []
    if n_eval >= len(rows):
        raise SystemExit(
            f"train.eval_rows = {n_eval} leaves no training rows: the shards hold {len(rows)} "
            "rows; lower train.eval_rows"
        )
    held = set(heldout_indices(len(rows), n_eval))
    return [r for i, r in enumerate(rows) if i not in held], [rows[i] for i in sorted(held)]


def tau_estimate(rates: list[float | None]) -> float | None:
    """1 + sum_k prod_{j<=k} a_j over the given conditional acceptance rates (None where any
    rate the sum needs was not measured: an unmeasured rate is not a zero rate)."""
    total, reach = 1.0, 1.0
    for a in rates:
        if reach == 0.0:
            break  # nothing gets this far: later rates do not matter
        if a is None:
            return None
        reach *= a
        total += reach
    return total


def rates_of(judged: list[int], accepted: list[int]) -> list[float | None]:
    return [a / n if n else None for n, a in zip(judged, accepted, strict=True)]


def not_computed(why: str) -> dict:
    return {"rows": 0, "tau_est_by_k": [], "why": why}


def write(path: Path, report: dict) -> None:
    """Atomically (temp file, fsync, rename): a reader never sees half a file."""
    atomic_write_json(path, report)
    log.info("offline acceptance estimate -> %s: tau_est %s", path, report.get("tau_est_by_k"))


def compare(offline: dict, sets: dict, num_steps: int, sampling: bool) -> dict:
    """The estimate at the benchmark's K next to every set's measured tau, with the gap."""
    by_k = offline.get("tau_est_by_k") or []
    est = by_k[num_steps - 1] if 0 < num_steps <= len(by_k) else None
    why = offline.get("why")
    if est is None and not why:
        why = f"the training run estimated K = 1..{len(by_k)} only, the benchmark runs K = {num_steps}"
    out = {
        "num_steps": num_steps,
        "tau_est": est,
        "rows": offline.get("rows", 0),
        "accept_rate_by_step": (offline.get("accept_rate_by_step") or [])[:num_steps],
        "gaps": {
            name: {
                "tau": r["tau"],
                "gap": None if est is None or not math.isfinite(r["tau"]) else r["tau"] - est,
            }
            for name, r in sets.items()
        },
    }
    if why:
        out["why"] = why
    if sampling:
        out["note"] = "the benchmark sampled (temperature > 0); the estimate is for greedy"
    return out


def text(cmp: dict | None) -> str:
    """One line for report.md and summary.html."""
    if cmp is None:
        return "Offline estimate: none (no results/train/offline_acceptance.json given)."
    if cmp["tau_est"] is None:
        return f"Offline estimate: not computed ({cmp.get('why', 'no estimate')})."
    rates = " / ".join("n/a" if a is None else f"{a:.2f}" for a in cmp["accept_rate_by_step"])
    gaps = "; ".join(
        f"{n} {g['tau']:.3f} (gap {'n/a' if g['gap'] is None else format(g['gap'], '+.3f')})"
        for n, g in cmp["gaps"].items()
    )
    note = f" ({cmp['note']})" if cmp.get("note") else ""
    return (
        f"Offline estimate from training (K = {cmp['num_steps']}, {cmp['rows']} held-out "
        f"training rows, greedy): tau_est {cmp['tau_est']:.3f}, accept rate by step {rates}; "
        f"measured tau, gap = measured - estimated: {gaps}{note}."
    )


def bench_entry(path: Path | None, sets: dict, bench: BenchSettings) -> dict | None:
    """report.json's `offline_estimate`: `compare` of the training run's file (None without)."""
    if path is None:
        return None
    try:
        offline = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise SystemExit(f"{path}: cannot read the offline acceptance estimate ({e})") from None
    return compare(offline, sets, bench.num_steps, bench.temperature > 0)


def for_run(spec, steps: int, draft, inputs, rows: list, path: Path) -> None:
    """The estimate on the held-out `rows` by the algorithm's estimator (K = train.ttt_steps),
    written to `path`; without rows or estimator, a file that says why there is none."""
    if not rows:
        write(path, not_computed("train.eval_rows is 0: no rows were held out of training"))
        return
    estimator = spec.part("estimator")
    if estimator is None:  # its spec refuses train.eval_rows at parse time
        write(path, not_computed(f"{spec.title} drafts have no offline estimate"))
        return
    estimator.for_run(steps, draft, inputs, rows, path)
