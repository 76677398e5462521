"""Benchmark prompts that are skipped or refused are counted in the report;
a prompt longer than the target's context is refused (not benchmarked silently); an empty
source file is a warning naming it."""

from __future__ import annotations

import json
import logging

import pytest
from test_specdec import _bench_inputs, install_oracle

from draftsmith.bench.inputs import screen_sets
from draftsmith.config import settings
from draftsmith.data.prompts import read_source

CONTEXT = 2048  # the tiny target's max_position_embeddings
BENCH_JOB = settings.stage_job(
    {"bench": {"backend": "hf", "max_new_tokens": 16}, "target": {}}, "bench"
)


def rows_file(path, prompts):
    path.write_text(
        "".join(
            json.dumps({"id": f"p{i}", "conversations": [{"role": "user", "content": p}]}) + "\n"
            for i, p in enumerate(prompts)
        )
    )
    return path


def test_an_empty_source_file_is_a_warning_naming_it(tmp_path, caplog):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n  \n")
    with caplog.at_level(logging.WARNING, logger="draftsmith.data.prompts"):
        rows, report = read_source({"format": "specforge", "path": str(empty)})
    assert rows == [] and report["empty"] is True
    assert f"{empty} is empty" in caplog.text


def test_a_prompt_past_the_context_is_refused_and_counted(tiny_target, caplog):
    long = "word " * (CONTEXT + 100)
    sets = {
        "mine": [
            {"id": "a", "conversations": [{"role": "user", "content": "hello"}]},
            {"id": "b", "conversations": [{"role": "user", "content": long}]},
        ]
    }
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_target))
    with caplog.at_level(logging.WARNING, logger="draftsmith.stages.bench"):
        kept, report = screen_sets(sets, {}, tiny_target, BENCH_JOB, tok)
    assert [r["id"] for r in kept["mine"]] == ["a"]
    r = report["mine"]
    assert r["used"] == 1 and r["refused_too_long"] == 1 and r["too_long_policy"] == "refused"
    assert r["first_too_long"][0]["id"] == "b" and r["context"] == CONTEXT
    assert "refused 1 prompt(s) longer than the target's context" in caplog.text
    with pytest.raises(SystemExit, match="bench set mine: no prompt left"):
        screen_sets({"mine": sets["mine"][1:]}, {}, tiny_target, BENCH_JOB, tok)


def test_bench_report_counts_skipped_and_refused_prompts(tiny_target, tmp_path, monkeypatch):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from draftsmith.stages import bench as bench

    model = AutoModelForCausalLM.from_pretrained(tiny_target).eval()
    tokenizer = AutoTokenizer.from_pretrained(tiny_target)
    install_oracle(monkeypatch, model, tokenizer, error_rate=0.3)
    argv, out = _bench_inputs(tmp_path, tiny_target, model)
    extra = rows_file(tmp_path / "extra.jsonl", ["What is 2+2?", "", "   ", "word " * CONTEXT])
    i = argv.index("--cfg") + 1
    cfg = json.loads(argv[i])
    cfg["bench"].update(
        humaneval_size=0,
        files=[{"name": "extra", "path": str(extra), "format": "specforge", "size": 0}],
    )
    argv[i] = json.dumps(cfg)
    bench.main(argv)
    report = json.loads((out / "report.json").read_text())
    extra_in = report["input"]["extra"]
    assert extra_in["used"] == 1 and extra_in["skipped_bad_rows"] == 2
    assert extra_in["refused_too_long"] == 1 and extra_in["first_too_long"][0]["id"] == "p3"
    assert report["sets"]["extra"]["prompts"] == 1
    assert report["input"]["heldout"]["used"] == 3
    md = (out / "report.md").read_text()
    assert "extra 1 used, 2 skipped as bad rows, 1 refused as longer than the context" in md
