"""Report captions describe the run (report.json's config), not the config of `snakemake --report`."""

from __future__ import annotations

import json

from wf import with_defaults

from draftsmith.bench.captions import CAPTIONS, render, write_captions


def run_config(**bench) -> dict:
    cfg = with_defaults({"bench": bench})
    return {k: cfg[k] for k in ("bench", "data", "target", "train", "draft", "capture")}


def test_captions_use_the_runs_config(tmp_path):
    report = {"config": run_config(num_steps=3, heldout_size=5)}
    paths = write_captions(report, tmp_path / "captions")
    assert [p.stem for p in paths] == list(CAPTIONS)
    text = {p.stem: p.read_text() for p in paths}
    assert "Chain of 3 draft tokens" in text["acceptance"]
    assert "Chain of 1 draft token," in render("acceptance", run_config(num_steps=1))
    assert "held-out rows never trained on:\n5," in text["summary"]
    assert "(4 steps, 5 epochs, peak lr 0.001)," in text["training"]
    assert "{{" not in "".join(text.values())  # plain reStructuredText for Snakemake
    smoke = render("summary", run_config(smoke=True))
    assert "**Smoke run**" in smoke and "**Smoke run**" not in text["summary"]


def test_a_draft_without_training_provenance_still_gets_captions(tmp_path):
    cfg = run_config()
    del cfg["train"]
    assert "step j,\nsmoothed" in render("training", cfg)


def test_bench_rule_points_its_captions_at_the_rendered_files():
    from wf import ROOT

    rule = (ROOT / "rules" / "bench.smk").read_text()
    assert "../report/" not in rule and rule.count("caption=run_caption(") == len(CAPTIONS)
    assert "--captions {output.captions}" in rule
    json.dumps(run_config())  # the config is JSON, as report.json holds it
