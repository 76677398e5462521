"""The bench figures, computed once for every engine from what the engine measured.

An engine's `bench_sets` (draftsmith.engines) returns, per benchmark set, raw measurements of
a speculative run and a plain run of the same prompts:

    {
      "num_steps": K,                      # draft tokens per verification pass
      "sampled": False,                    # True: both sides sampled (outputs not comparable)
      "spec_seconds": s, "base_seconds": s,  # wall time of each side, warm-up excluded
      "prompts": [                         # one per prompt, in the set's order
        {"id": row id, "prompt_tokens": n,
         "spec_ids": [...], "base_ids": [...],     # output token ids the two sides are compared by
         "spec_tokens": n, "base_tokens": n,       # tokens each side generated
         # the speculative side's counters, where the engine has them per prompt:
         "verify_passes": n, "accept_len_hist": [K + 1 counts], "emitted": n},
        ...
      ],
      "counters": {"accept_len_hist": [...], "emitted": n},  # only where counted per set
      "figures": ["accept_length"],        # optional figures the engine asks for (OPTIONAL)
      "extra": {...},                      # the engine's own figures, copied into the result
    }

A server engine run at several `bench.concurrency` levels adds `"by_concurrency"`: one raw
dict per level in the format above, plus `"concurrency": c` and, per prompt, `"spec_latency"`
and `"base_latency"` (seconds from sending the request to its last token); the set's own keys
are its first level's. `concurrency_figures` turns them into one row per level.

`emitted` counts the tokens verification passes added to the output (the prefill's token
excluded), `accept_len_hist[a]` the passes that accepted exactly a proposals. `set_figures`
turns that into the report's figures: the acceptance figures (`acceptance_figures`), tokens/s
of each side, the speedup, the pass cost, the outputs identical to the baseline's and where the
others first differ. Pure: no I/O, no torch.
"""

from __future__ import annotations

import logging

log = logging.getLogger("draftsmith.stages.bench")


def acceptance_figures(hist: list[int], emitted: int, generated: int, prompts: int) -> dict:
    """The acceptance figures from the accepted-length histogram and token counts.

    hist[a]: verification passes that accepted exactly a proposals (a = 0..K); emitted: tokens
    those passes added to the outputs; generated: all output tokens (prefill tokens included).

    - `tau`: emitted / passes, pooled over the set.
    - `tau_sglang`: generated / passes (SGLang's count, the prefill token included).
    - `accept_rate_by_pos[j]`: P(proposal j+1 accepted | proposals 1..j accepted), i.e. accepted
      at position j+1 over passes that reached it (what a per-position draft accuracy measures).
    - `reach_rate_by_pos[j]`: P(accepted length >= j+1) over all passes.
    """
    k = len(hist) - 1
    passes = sum(hist)
    reached = [sum(hist[j:]) for j in range(k + 1)]  # reached[j] = passes with length >= j
    # None where no pass reached the position: an unmeasured rate is not a zero rate
    rate = [reached[j + 1] / reached[j] if reached[j] else None for j in range(k)]
    reach = [reached[j + 1] / passes if passes else 0.0 for j in range(k)]
    return {
        "prompts": prompts,
        "generated_tokens": generated,
        "verify_passes": passes,
        "tau": emitted / passes if passes else float("nan"),
        "tau_sglang": generated / passes if passes else float("nan"),
        "mean_accepted": sum(a * n for a, n in enumerate(hist)) / passes if passes else 0.0,
        "accept_rate_by_pos": rate,
        "reached_by_pos": reached[:k],
        "reach_rate_by_pos": reach,
        "accept_len_hist": list(hist),
    }


def first_difference(a: list[int], b: list[int]) -> int | None:
    """The first position where two outputs differ (the shorter's length when one is a prefix
    of the other), or None when they are equal."""
    if a == b:
        return None
    pairs = zip(a, b, strict=False)
    return next((j for j, (x, y) in enumerate(pairs) if x != y), min(len(a), len(b)))


def pooled_counters(prompts: list[dict], k: int) -> dict:
    """The set's histogram and emitted tokens, summed over its prompts' counters; each prompt's
    histogram must have K + 1 bins and count exactly its verification passes."""
    hist, emitted = [0] * (k + 1), 0
    for p in prompts:
        mine = p["accept_len_hist"]
        if len(mine) != k + 1 or sum(mine) != p["verify_passes"]:
            raise ValueError(
                f"prompt {p['id']}: the accepted-length histogram {mine} does not count its "
                f"{p['verify_passes']} verification passes in {k + 1} bins (num_steps {k})"
            )
        hist = [x + y for x, y in zip(hist, mine, strict=True)]
        emitted += p["emitted"]
    return {"accept_len_hist": hist, "emitted": emitted}


def compare_outputs(prompts: list[dict]) -> tuple[int, list[dict]]:
    """(outputs identical to the baseline's, [{"id", "first_difference_at"}] of the others)."""
    diffs = []
    for p in prompts:
        at = first_difference(p["spec_ids"], p["base_ids"])
        if at is not None:
            diffs.append({"id": p["id"], "first_difference_at": at})
    return len(prompts) - len(diffs), diffs


def accept_length(hist: list[int]) -> float:
    """SGLang's accept length: tokens per verification pass, the bonus token included."""
    passes = sum(hist)
    return sum((a + 1) * n for a, n in enumerate(hist)) / passes if passes else float("nan")


OPTIONAL = {"accept_length": lambda counters: accept_length(counters["accept_len_hist"])}


def set_figures(raw: dict) -> dict:
    """The report's figures of one set from the engine's raw measurements (module doc)."""
    prompts, k = raw["prompts"], raw["num_steps"]
    per_prompt = "counters" not in raw
    counters = pooled_counters(prompts, k) if per_prompt else raw["counters"]
    generated = sum(p["spec_tokens"] for p in prompts)
    base_tokens = sum(p["base_tokens"] for p in prompts)
    out = acceptance_figures(
        counters["accept_len_hist"], counters["emitted"], generated, len(prompts)
    )
    spec_s, base_s = raw["spec_seconds"], raw["base_seconds"]
    spec_tps, base_tps = generated / spec_s, base_tokens / base_s
    passes = out["verify_passes"]
    identical, diffs = (None, []) if raw["sampled"] else compare_outputs(prompts)
    out.update(
        spec_seconds=spec_s,
        baseline_seconds=base_s,
        baseline_tokens=base_tokens,
        spec_tokens_per_s=spec_tps,
        baseline_tokens_per_s=base_tps,
        speedup=spec_tps / base_tps,
        # one speculative pass (chain + verify), in plain steps: speedup = tau_sglang / this
        pass_cost=(spec_s / passes) * base_tps if passes else float("nan"),
        identical_outputs=identical,  # None: sampled, equal in distribution only
        differing_outputs=diffs,
        mean_prompt_tokens=sum(p["prompt_tokens"] for p in prompts) / len(prompts),
    )
    for name in raw.get("figures", ()):
        out[name] = OPTIONAL[name](counters)
    if per_prompt:
        out["per_prompt"] = [
            {
                "id": p["id"],
                "output_ids": p["spec_ids"],
                "verify_passes": p["verify_passes"],
                "accept_len_hist": p["accept_len_hist"],
            }
            for p in prompts
        ]
    out.update(raw.get("extra", {}))
    if raw.get("by_concurrency"):
        out["by_concurrency"] = concurrency_figures(raw["by_concurrency"])
    if diffs:
        log.warning(
            "%d of %d outputs differ from the baseline's (numerics of batched vs one-token "
            "forwards): %s",
            len(diffs),
            len(prompts),
            diffs[:3],
        )
    return out


# tau at a concurrency level "equals" the first level's within float near-ties: verification
# passes within 1% (at least 1), as two engines' kernels differ (tests/trained.py)
NEAR_TIE = 0.01


def percentile(values: list[float], q: float) -> float:
    """The q-quantile (0..1) with linear interpolation; nan for no values."""
    if not values:
        return float("nan")
    v = sorted(values)
    x = q * (len(v) - 1)
    lo = int(x)
    hi = min(lo + 1, len(v) - 1)
    return v[lo] + (v[hi] - v[lo]) * (x - lo)


def time_per_token(prompts: list[dict], side: str) -> dict:
    """Median and p90 over requests of one side's seconds per output token (the request's
    whole latency, queueing and prefill included, over the tokens it generated)."""
    tpot = [p[f"{side}_latency"] / p[f"{side}_tokens"] for p in prompts if p[f"{side}_tokens"]]
    return {"median": percentile(tpot, 0.5), "p90": percentile(tpot, 0.9)}


def level_figures(raw: dict, reference: list[dict]) -> dict:
    """One concurrency level's row: acceptance, throughput, latency, speedup, and (greedy) the
    outputs of both sides compared with the first level's plain outputs (`reference`)."""
    f = set_figures({k: v for k, v in raw.items() if k != "by_concurrency"})
    out = {"concurrency": int(raw["concurrency"])}
    for key in (
        "prompts", "tau", "tau_sglang", "verify_passes", "accept_rate_by_pos",
        "accept_len_hist", "spec_tokens_per_s", "baseline_tokens_per_s", "speedup",
    ):  # fmt: skip
        out[key] = f[key]
    out["spec_tpot"] = time_per_token(raw["prompts"], "spec")
    out["baseline_tpot"] = time_per_token(raw["prompts"], "base")
    if raw["sampled"]:
        out.update(identical_to_plain=None, plain_identical_to_first=None, differing=[])
        return out
    ref = {p["id"]: p["base_ids"] for p in reference}
    diffs = [
        {"id": p["id"], "side": side, "first_difference_at": at}
        for p in raw["prompts"]
        for side in ("spec", "base")
        if (at := first_difference(p[f"{side}_ids"], ref[p["id"]])) is not None
    ]
    out["identical_to_plain"] = sum(p["spec_ids"] == ref[p["id"]] for p in raw["prompts"])
    out["plain_identical_to_first"] = sum(p["base_ids"] == ref[p["id"]] for p in raw["prompts"])
    out["differing"] = diffs
    return out


def concurrency_figures(levels: list[dict]) -> list[dict]:
    """One row per level (level_figures), each with its tau's change from the first level's and
    `batch_invariant`: greedy outputs all equal to the first level's plain ones and passes
    within NEAR_TIE of the first level's (None when sampled: outputs are not comparable)."""
    reference = levels[0]["prompts"]
    rows = [level_figures(raw, reference) for raw in levels]
    first = rows[0]
    for row in rows:
        row["tau_change"] = row["tau"] - first["tau"]
        if row["identical_to_plain"] is None:
            row["batch_invariant"] = None
            continue
        slack = max(1, int(NEAR_TIE * first["verify_passes"]))
        row["batch_invariant"] = (
            not row["differing"] and abs(row["verify_passes"] - first["verify_passes"]) <= slack
        )
    return rows


def bench_figures(raw_sets: dict) -> dict:
    """name -> figures for every set an engine measured."""
    return {name: set_figures(raw) for name, raw in raw_sets.items()}


def pass_floor_text(floor: dict | None) -> str:
    """The report's line on what a pass could cost (the hf engine's `pass_floor`), "" without."""
    if not floor:
        return ""
    return (
        f"Pass cost floor: {floor['floor']:.2f} greedy steps = 1 + {floor['draft_forwards']} "
        f"draft forward(s) x {floor['draft_share']:.3f} (the draft's linear-layer bytes over the "
        "target's), where a forward costs the bytes it reads and the target verifies the "
        "proposals in the time of one greedy step; the table's pass cost is measured."
    )
