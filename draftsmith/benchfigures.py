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

`emitted` counts the tokens verification passes added to the output (the prefill's token
excluded), `accept_len_hist[a]` the passes that accepted exactly a proposals. `set_figures`
turns that into the report's figures: the acceptance figures (`acceptance_figures`), tokens/s
of each side, the speedup, the pass cost, the outputs identical to the baseline's and where the
others first differ. Pure: no I/O, no torch.
"""

from __future__ import annotations

import logging

log = logging.getLogger("draftsmith.bench")


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
    if diffs:
        log.warning(
            "%d of %d outputs differ from the baseline's (numerics of batched vs one-token "
            "forwards): %s",
            len(diffs),
            len(prompts),
            diffs[:3],
        )
    return out


def bench_figures(raw_sets: dict) -> dict:
    """name -> figures for every set an engine measured."""
    return {name: set_figures(raw) for name, raw in raw_sets.items()}
