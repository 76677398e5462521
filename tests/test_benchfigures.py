"""draftsmith.bench.figures: every bench figure from an engine's raw measurements, the same way
for every engine (the per-engine shapes: per-prompt counters as hf and SGLang report them,
per-set counters as vLLM's)."""

from __future__ import annotations

import math

import pytest

from draftsmith.bench.figures import first_difference, set_figures


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


def level(c, prompts, **more):
    return raw(prompts, concurrency=c, **more)


def timed(pid, spec, base, hist, emitted, spec_latency, base_latency):
    return {
        **prompt(pid, spec, base, hist=hist, emitted=emitted),
        "spec_latency": spec_latency,
        "base_latency": base_latency,
    }


def test_concurrency_levels_figures():
    """Per level: acceptance, tokens/s, time per output token (median, p90), outputs against
    the first level's plain outputs; batch_invariant fails where a level's outputs moved."""
    from draftsmith.bench.figures import percentile

    first = level(
        1,
        [
            timed("a", [1, 2, 3, 4], [1, 2, 3, 4], [0, 0, 1], 3, 0.4, 0.8),
            timed("b", [7, 8], [7, 8], [1, 0, 0], 1, 0.2, 0.2),
        ],
    )
    same = level(
        4,
        [
            timed("a", [1, 2, 3, 4], [1, 2, 3, 4], [0, 0, 1], 3, 0.8, 1.6),
            timed("b", [7, 8], [7, 8], [1, 0, 0], 1, 0.4, 0.4),
        ],
        spec_seconds=1.0,
    )
    moved = level(
        8,
        [
            timed("a", [1, 2, 5, 6], [1, 2, 3, 4], [1, 1, 0], 3, 0.8, 1.6),
            timed("b", [7, 8], [7, 9], [1, 0, 0], 1, 0.4, 0.4),
        ],
    )
    r = set_figures({**first, "by_concurrency": [first, same, moved]})
    rows = r["by_concurrency"]
    assert [x["concurrency"] for x in rows] == [1, 4, 8]
    assert r["tau"] == rows[0]["tau"] == 2.0
    assert rows[1]["spec_tokens_per_s"] == 6.0 and rows[1]["speedup"] == 4.0
    # seconds per output token: a 0.1, b 0.1 (spec, level 1); median and p90 interpolated
    assert rows[0]["spec_tpot"] == {"median": 0.1, "p90": 0.1}
    assert rows[1]["baseline_tpot"]["median"] == pytest.approx(0.3)
    assert rows[1]["baseline_tpot"]["p90"] == pytest.approx(0.2 + 0.9 * 0.2)
    assert rows[0]["batch_invariant"] and rows[1]["batch_invariant"]
    assert rows[1]["identical_to_plain"] == 2 and rows[1]["tau_change"] == 0.0
    assert rows[2]["batch_invariant"] is False
    assert rows[2]["identical_to_plain"] == 1 and rows[2]["plain_identical_to_first"] == 1
    assert {(d["id"], d["side"]) for d in rows[2]["differing"]} == {("a", "spec"), ("b", "base")}
    assert rows[2]["tau_change"] == pytest.approx(4 / 3 - 2.0)
    assert percentile([], 0.5) != percentile([], 0.5)  # nan
    assert percentile([3.0, 1.0, 2.0], 0.5) == 2.0


def test_concurrency_levels_sampled_and_passes_moved():
    """Sampled levels compare no outputs (None); greedy levels with equal outputs but passes
    beyond the near-tie slack are not batch invariant."""
    a = [timed("a", [1] * 40, [1] * 40, [38, 1, 0], 39, 1.0, 1.0)]
    b = [timed("a", [1] * 40, [1] * 40, [30, 3, 1], 39, 1.0, 1.0)]
    r = set_figures({**level(1, a), "by_concurrency": [level(1, a), level(4, b)]})
    assert r["by_concurrency"][1]["identical_to_plain"] == 1
    assert r["by_concurrency"][1]["batch_invariant"] is False  # 34 passes against 39
    s = set_figures({**level(1, a, sampled=True), "by_concurrency": [level(1, a, sampled=True)]})
    assert s["by_concurrency"][0]["identical_to_plain"] is None
    assert s["by_concurrency"][0]["batch_invariant"] is None


def test_concurrency_report_section(tmp_path):
    """report.md and summary.html get the table, the findings and (html) the plot."""
    from draftsmith.bench import levels as benchlevels

    first = level(1, [timed("a", [1, 2, 3, 4], [1, 2, 3, 4], [0, 0, 1], 3, 0.4, 0.8)])
    moved = level(4, [timed("a", [1, 2, 5], [1, 2, 3, 4], [1, 1, 0], 2, 0.4, 0.8)])
    sets = {"s": set_figures({**first, "by_concurrency": [first, moved]})}
    report = {"sets": sets, "engine_notes": ["an engine note"]}
    md = "\n".join(benchlevels.markdown(report))
    assert "| s | 4 |" in md and "an engine note" in md
    assert "s at concurrency 4: acceptance moved with the batch" in md
    png = benchlevels.plot(report)
    assert png[:4] == b"\x89PNG"
    page = benchlevels.html(report, png)
    assert "<h2>Concurrency</h2>" in page and "data:image/png;base64," in page
    single = {"sets": {"s": set_figures({**first, "by_concurrency": [first]})}}
    assert benchlevels.markdown(single) == [] and benchlevels.html(single, None) == ""
    # the bench report: the section under the main table of report.md and summary.html
    from draftsmith.stages.bench import render_html, render_md

    full = {
        **report,
        "method": "Method.",
        "training": {"steps": 1, "final_loss": 1.0, "final_acc_per_pos": [0.5]},
        "target_fingerprint": "0" * 64,
        "draft_fingerprint": {},
        "aux_layer_ids": [0, 1, 2],
        "draft_vocab_size": 64,
        "versions": {},
    }
    text = render_md(full)
    assert text.index("| tau (SGLang count) |") < text.index("## Concurrency")
    assert text.index("## Concurrency") < text.index("| s | 4 | 1.000 | -2.000 |")
    page = render_html(full, levels_png=png)
    assert page.count("data:image/png;base64,") == 1 and "<h2>Concurrency</h2>" in page
