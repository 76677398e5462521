"""draftsmith.benchfigures: every bench figure from an engine's raw measurements, the same way
for every engine (the per-engine shapes: per-prompt counters as hf and SGLang report them,
per-set counters as vLLM's)."""

from __future__ import annotations

import math

import pytest

from draftsmith.benchfigures import first_difference, set_figures


def prompt(pid, spec, base, hist=None, emitted=None, prompt_tokens=5):
    p = {
        "id": pid,
        "prompt_tokens": prompt_tokens,
        "spec_ids": spec,
        "base_ids": base,
        "spec_tokens": len(spec),
        "base_tokens": len(base),
    }
    if hist is not None:
        p.update(verify_passes=sum(hist), accept_len_hist=hist, emitted=emitted)
    return p


def raw(prompts, **more):
    return {
        "num_steps": 2,
        "sampled": False,
        "spec_seconds": 2.0,
        "base_seconds": 4.0,
        "prompts": prompts,
        **more,
    }


def test_first_difference():
    assert first_difference([1, 2, 3], [1, 2, 3]) is None
    assert first_difference([1, 2, 3], [1, 5, 3]) == 1
    assert first_difference([1, 2], [1, 2, 3]) == 2  # a prefix: the shorter's length


def test_per_prompt_counters():
    """Two prompts, K = 2: pooled histogram, tau without the prefill token, timing figures."""
    r = set_figures(
        raw(
            [
                prompt("a", [1, 2, 3, 4], [1, 2, 3, 4], hist=[0, 0, 1], emitted=3),
                prompt("b", [7, 8], [7, 9], hist=[1, 0, 0], emitted=1, prompt_tokens=9),
            ],
            extra={"load": {"x": 1}},
        )
    )
    assert r["accept_len_hist"] == [1, 0, 1] and r["verify_passes"] == 2
    assert r["tau"] == 4 / 2 and r["tau_sglang"] == 6 / 2
    assert r["accept_rate_by_pos"] == [0.5, 1.0]
    assert r["spec_tokens_per_s"] == 6 / 2.0 and r["baseline_tokens_per_s"] == 6 / 4.0
    assert r["speedup"] == 2.0
    assert r["pass_cost"] == (2.0 / 2) * (6 / 4.0)
    assert r["speedup"] == pytest.approx(r["tau_sglang"] / r["pass_cost"])
    assert r["identical_outputs"] == 1
    assert r["differing_outputs"] == [{"id": "b", "first_difference_at": 1}]
    assert r["mean_prompt_tokens"] == 7
    assert [p["verify_passes"] for p in r["per_prompt"]] == [1, 1]
    assert r["load"] == {"x": 1}


def test_sampled_outputs_are_not_compared():
    r = set_figures(raw([prompt("a", [1, 2], [3, 4], hist=[1, 0, 0], emitted=1)], sampled=True))
    assert r["identical_outputs"] is None and r["differing_outputs"] == []


def test_per_set_counters_and_no_passes():
    """vLLM's shape: counters for the set, no per-prompt figures; no pass: NaN, not a crash."""
    counters = {"accept_len_hist": [0, 0, 0], "emitted": 0}
    r = set_figures(raw([prompt("a", [1], [1])], counters=counters))
    assert "per_prompt" not in r and r["verify_passes"] == 0
    assert math.isnan(r["tau"]) and math.isnan(r["pass_cost"])
    assert r["accept_rate_by_pos"] == [None, None]


def test_histogram_must_count_the_passes():
    bad = prompt("a", [1, 2], [1, 2], hist=[1, 0, 0], emitted=1)
    bad["verify_passes"] = 2
    with pytest.raises(ValueError, match="prompt a: the accepted-length histogram"):
        set_figures(raw([bad]))


def test_optional_figures():
    r = set_figures(
        raw(
            [prompt("a", [1, 2, 3], [1, 2, 3], hist=[1, 0, 1], emitted=2)],
            figures=["accept_length"],
        )
    )
    assert r["accept_length"] == (1 * 1 + 1 * 3) / 2
