"""Chat templates that refuse a role: rows skipped, counted and named; data.system_prompt."""

from __future__ import annotations

import json
import shutil

import pytest
from wf import with_defaults

from draftsmith.data.prompts import SourceError, load_sources, system_turn
from draftsmith.data.tokens import tokenize_rows
from draftsmith.targets.tinymodel import CHATML_TEMPLATE, make_tokenizer

# Gemma-2's refusal of a system turn, in front of the tiny tokenizer's ChatML template
NO_SYSTEM = (
    "{% if messages[0]['role'] == 'system' %}"
    "{{ raise_exception('System role not supported') }}{% endif %}" + CHATML_TEMPLATE
)


def _row(rid, *turns):
    return {
        "id": rid,
        "source": "sharegpt:chats.jsonl",
        "conversations": [{"role": r, "content": c} for r, c in turns],
    }


def test_system_turn_keep_drop_merge():
    turns = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Why?"},
        {"role": "assistant", "content": "Because."},
    ]
    assert system_turn(turns, "keep") is turns
    assert system_turn(turns, "drop") == turns[1:]
    merged = system_turn(turns, "merge")
    assert merged[0] == {"role": "user", "content": "Be brief.\n\nWhy?"} and merged[1:] == turns[2:]
    assert turns[1]["content"] == "Why?"  # the source row is not changed
    assert system_turn(turns[1:], "merge") == turns[1:]
    with pytest.raises(SourceError, match="data.system_prompt"):
        system_turn(turns, "first")


def test_load_sources_applies_system_prompt(tmp_path):
    src = tmp_path / "chats.jsonl"
    lines = [
        {"conversations": [{"from": "system", "value": "S"}, {"from": "human", "value": f"q{i}"}]}
        for i in range(4)
    ]
    src.write_text("".join(json.dumps(x) + "\n" for x in lines))
    data = {"sources": [{"format": "sharegpt", "path": str(src)}], "heldout_rows": 1}
    kept = load_sources({"data": data})
    assert kept.train[0]["conversations"][0]["role"] == "system"
    assert "system_prompt" not in kept.report  # the default's report is as before the key
    dropped = load_sources({"data": {**data, "system_prompt": "drop"}})
    assert all(r["conversations"][0]["role"] == "user" for r in dropped.train + dropped.heldout)
    assert dropped.report["system_prompt"] == {"mode": "drop", "rows_changed": 4}


def test_tokenize_skips_and_names_rows_the_template_refuses():
    tok = make_tokenizer()
    tok.chat_template = NO_SYSTEM
    rows = [
        _row("a", ("user", "Hi"), ("assistant", "Hello there")),
        _row("b", ("system", "Be brief."), ("user", "Hi"), ("assistant", "Hello")),
        _row("c", ("user", "Name a colour"), ("assistant", "Blue")),
    ]
    tensors, stats = tokenize_rows(tok, rows, 256)
    assert stats["kept"] == 2 and stats["kept_rows"] == [0, 2]
    assert stats["refused"] == [
        {
            "id": "b",
            "source": "sharegpt:chats.jsonl",
            "reason": "the chat template refuses it: System role not supported",
        }
    ]
    assert tensors["row_offsets"].size == 3
    tok.chat_template = CHATML_TEMPLATE  # a template that renders every row refuses none
    assert "refused" not in tokenize_rows(tok, rows, 256)[1]


def _run_regenerate(cfg, target, tmp_path):
    from draftsmith.stages.regenerate import main

    out, rep = tmp_path / "rows.jsonl", tmp_path / "rows.report.json"
    args = ["--cfg", json.dumps(cfg), "--range", "rows_000000-000004", "--target", str(target)]
    main([*args, "--out", str(out), "--report", str(rep), "--threads", "1"])
    return [json.loads(x) for x in out.read_text().splitlines()], json.loads(rep.read_text())


def test_regenerate_skips_counts_and_names_refused_rows(tiny_target, tmp_path, caplog):
    from transformers import AutoTokenizer

    from draftsmith.targets.model import write_meta

    target = tmp_path / "target"
    shutil.copytree(tiny_target, target)
    tok = AutoTokenizer.from_pretrained(target)
    tok.chat_template = NO_SYSTEM
    tok.save_pretrained(target)
    write_meta(target, "path", str(tiny_target))
    src = tmp_path / "chats.jsonl"
    convs = [
        [{"from": "system", "value": "Be brief."}, {"from": "human", "value": "Why?"}]
        if i in (1, 3)
        else [{"from": "human", "value": f"Question {i}?"}]
        for i in range(5)
    ]
    src.write_text("".join(json.dumps({"conversations": c}) + "\n" for c in convs))
    cfg = with_defaults(
        {
            "data": {"sources": [{"format": "sharegpt", "path": str(src)}], "heldout_rows": 1},
            "regenerate": {"max_new_tokens": 3, "batch_size": 4},
        }
    )
    rows, report = _run_regenerate(cfg, target, tmp_path)
    name = f"sharegpt:{src}"
    assert report["rows"] == 4 and report["refused_rows"] == 2 and len(rows) == 2
    assert [r["id"] for r in report["refused"]] == [f"{name}#2", f"{name}#4"]
    assert all(r["source"] == name and "System role" in r["reason"] for r in report["refused"])
    assert "skipped 2 rows the chat template refuses" in caplog.text and f"{name}#4" in caplog.text

    cfg["data"]["system_prompt"] = "merge"
    rows, report = _run_regenerate(cfg, target, tmp_path)
    assert "refused_rows" not in report and len(rows) == 4
    assert rows[1]["conversations"][0] == {"role": "user", "content": "Be brief.\n\nWhy?"}
