"""Prompt sources: the row formats, bad-row accounting, the held-out split, the bundled set."""

from __future__ import annotations

import gzip
import json
from collections import Counter

import pytest

from draftsmith.data.prompts import (
    BUNDLED_PATH,
    SourceError,
    heldout_indices,
    load_humaneval,
    load_sources,
    main,
    prompt_turns,
    read_source,
    rows_for_range,
    source_files,
)


def _write(path, lines):
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return str(path)


def test_specforge_rows_and_bad_rows_are_counted_with_line_numbers(tmp_path):
    good = {
        "id": "a",
        "conversations": [
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "hello"},
        ],
    }
    lines = [
        json.dumps(good),
        "{not json",
        json.dumps({"id": "b", "conversations": [{"role": "user", "content": "  "}]}),
        json.dumps({"id": "c", "conversations": [{"role": "assistant", "content": "x"}]}),
        json.dumps(
            {
                "id": "d",
                "conversations": [
                    {"role": "user", "content": "q"},
                    {"role": "user", "content": "q2"},
                ],
            }
        ),
        "",
        json.dumps(
            {
                "conversations": [
                    {"role": "system", "content": "s"},
                    {"role": "user", "content": "q"},
                ]
            }
        ),
        json.dumps([1, 2]),
    ]
    path = _write(tmp_path / "sf.jsonl", lines)
    rows, report = read_source({"format": "specforge", "path": path})
    assert [r["id"] for r in rows] == ["a", f"specforge:{path}#7"]
    assert rows[1]["conversations"][0] == {"role": "system", "content": "s"}
    assert report["valid"] == 2 and report["skipped"] == 5 and report["rows_read"] == 7
    bad = report["first_bad_rows"]
    assert [b["line"] for b in bad] == [2, 3, 4, 5, 8]
    assert "not JSON" in bad[0]["reason"]
    assert "empty content" in bad[1]["reason"]
    assert "role order" in bad[2]["reason"] and "role order" in bad[3]["reason"]
    assert "not a JSON object" in bad[4]["reason"]


def test_sharegpt_and_prompt_formats(tmp_path):
    sg = _write(
        tmp_path / "sg.jsonl",
        [
            json.dumps(
                {
                    "id": "s1",
                    "conversations": [
                        {"from": "human", "value": "hey"},
                        {"from": "gpt", "value": "hi!"},
                    ],
                }
            ),
            json.dumps({"conversations": [{"from": "robot", "value": "?"}]}),
        ],
    )
    rows, report = read_source({"format": "sharegpt", "path": sg})
    assert rows[0]["conversations"] == [
        {"role": "user", "content": "hey"},
        {"role": "assistant", "content": "hi!"},
    ]
    assert report["skipped"] == 1 and "robot" in report["first_bad_rows"][0]["reason"]

    pr = tmp_path / "p.jsonl.gz"
    with gzip.open(pr, "wt", encoding="utf-8") as f:
        f.write(json.dumps({"prompt": "Tell me a joke", "id": 7}) + "\n")
        f.write(json.dumps({"prompt": "Be short", "system": "You are terse."}) + "\n")
        f.write(json.dumps({"prompt": ""}) + "\n")
    rows, report = read_source({"format": "prompt", "path": str(pr)})
    assert [r["id"] for r in rows] == ["7", f"prompt:{pr}#2"]
    assert [t["role"] for t in rows[1]["conversations"]] == ["system", "user"]
    assert report["skipped"] == 1 and report["with_answers"] == 0


def test_missing_file_and_unknown_format_are_errors(tmp_path):
    with pytest.raises(SourceError, match="file not found"):
        read_source({"format": "prompt", "path": str(tmp_path / "nope.jsonl")})
    with pytest.raises(SourceError, match="unknown format"):
        read_source({"format": "alpaca", "path": "x"})


def test_merge_split_caps_and_ranges(tmp_path):
    p1 = _write(tmp_path / "a.jsonl", [json.dumps({"prompt": f"a{i}"}) for i in range(10)])
    p2 = _write(tmp_path / "b.jsonl", [json.dumps({"prompt": f"b{i}"}) for i in range(10)])
    cfg = {
        "data": {
            "sources": [
                {"format": "prompt", "path": p1, "max_rows": 4},
                {"format": "prompt", "path": p2},
            ],
            "heldout_rows": 3,
            "max_rows": 0,
        }
    }
    s = load_sources(cfg)
    contents = [r["conversations"][0]["content"] for r in s.train]
    # held out: 3 rows evenly spaced over the 14 merged ones (rows 2, 7, 11), not the tail
    assert contents == ["a0", "a1", "a3", "b0", "b1", "b2", "b4", "b5", "b6", "b8", "b9"]
    assert [r["conversations"][0]["content"] for r in s.heldout] == ["a2", "b3", "b7"]
    assert s.report["train_rows"] == 11 and s.report["heldout_rows"] == 3
    cfg["data"]["max_rows"] = 5
    assert len(load_sources(cfg).train) == 5
    assert [r["conversations"][0]["content"] for r in rows_for_range(s, 4, 6)] == ["b1", "b2"]
    with pytest.raises(SourceError, match="outside"):
        rows_for_range(s, 8, 16)
    cfg["data"]["heldout_rows"] = 14
    with pytest.raises(SourceError, match="no training rows"):
        load_sources(cfg)


def test_cli_writes_report(tmp_path):
    p = _write(
        tmp_path / "a.jsonl", [json.dumps({"prompt": "x"}), "oops", json.dumps({"prompt": "y"})]
    )
    out = tmp_path / "sources.json"
    cfg = {"data": {"sources": [{"format": "prompt", "path": p}], "heldout_rows": 1}}
    main(["--cfg", json.dumps(cfg), "--out", str(out)])
    rep = json.loads(out.read_text())
    assert rep["train_rows"] == 1 and rep["skipped_rows"] == 1
    assert rep["sources"][0]["first_bad_rows"][0]["line"] == 2


def test_bundled_set_is_varied_and_valid():
    rows, report = read_source({"format": "bundled"})
    assert report["skipped"] == 0 and 400 <= len(rows) <= 600
    ids = [r["id"] for r in rows]
    assert len(set(ids)) == len(ids)
    firsts = [
        r["conversations"][0]["content"]
        if r["conversations"][0]["role"] == "user"
        else r["conversations"][1]["content"]
        for r in rows
    ]
    assert len(set(firsts)) == len(firsts)  # no duplicated prompts
    # ~15% multi-turn (user, assistant, user) rows, every one ending with a user turn
    assert 0.10 <= report["multi_turn"] / len(rows) <= 0.20
    assert all(r["conversations"][-1]["role"] == "user" for r in rows)
    # varied: many different first words, a wide spread of lengths, categories mixed in the tail
    assert len(Counter(f.split()[0].lower() for f in firsts)) >= 80
    lengths = sorted(len(f) for f in firsts)
    assert lengths[len(lengths) // 10] < 40 and lengths[-len(lengths) // 10] > 120
    assert lengths[-1] > 400
    tail = Counter(
        json.loads(line)["category"] for line in BUNDLED_PATH.read_text().splitlines()[-40:]
    )
    assert len(tail) >= 6


@pytest.mark.parametrize("n, h", [(14, 3), (10, 9), (296, 40), (7, 1), (5, 0)])
def test_heldout_rows_are_distinct_sorted_and_spread(n, h):
    """Held-out rows are evenly spaced, not the file's tail nor a seeded shuffle: a user's tail
    is often unlike the rest (multi-turn rows or one source appended last), and a shuffle needs a
    seed and moves every row when one is added. Even spacing depends only on the row count,
    represents every part of every source, and keeps the training rows in file order."""
    idx = heldout_indices(n, h)
    assert len(idx) == h and idx == sorted(set(idx)) and all(0 <= i < n for i in idx)
    if h > 1:  # spread: no gap more than twice the even spacing, and not all in the tail
        assert max(b - a for a, b in zip(idx, idx[1:], strict=False)) <= 2 * n / h
        assert idx[0] < n // 2


def test_multi_turn_rows_at_the_end_are_not_all_held_out(tmp_path):
    """A user's file with its multi-turn rows last: the held-out set mixes both kinds."""
    one = [json.dumps({"conversations": [{"from": "human", "value": f"q{i}"}]}) for i in range(30)]
    multi = [
        json.dumps(
            {
                "conversations": [
                    {"from": "human", "value": f"m{i}"},
                    {"from": "gpt", "value": "a"},
                    {"from": "human", "value": "more"},
                ]
            }
        )
        for i in range(10)
    ]
    p = _write(tmp_path / "s.jsonl", one + multi)
    s = load_sources({"data": {"sources": [{"format": "sharegpt", "path": p}], "heldout_rows": 8}})
    turns = [len(r["conversations"]) for r in s.heldout]
    assert 1 in turns and 3 in turns, turns
    assert sum(len(r["conversations"]) == 3 for r in s.train) == 8


def test_invalid_utf8_names_file_and_line(tmp_path, caplog):
    p = tmp_path / "latin1.jsonl"
    good = json.dumps({"prompt": "fine"}).encode()
    bad = json.dumps({"prompt": "caf\u00e9"}).encode().replace(b"\\u00e9", "é".encode("latin-1"))
    p.write_bytes(good + b"\n" + bad + b"\n" + good + b"\n")
    with caplog.at_level("WARNING"):
        rows, report = read_source({"format": "prompt", "path": str(p)})
    assert len(rows) == 2 and report["skipped"] == 1
    assert report["first_bad_rows"][0]["line"] == 2
    assert "not UTF-8" in report["first_bad_rows"][0]["reason"]
    assert str(p) in caplog.text and "line 2: not UTF-8" in caplog.text
    gz = tmp_path / "latin1.jsonl.gz"
    gz.write_bytes(gzip.compress(p.read_bytes()))
    assert read_source({"format": "prompt", "path": str(gz)})[1]["first_bad_rows"][0]["line"] == 2


def test_lone_surrogate_is_a_bad_row_naming_the_line(tmp_path):
    rows = [
        json.dumps({"prompt": "ok"}),
        '{"prompt": "broken \\ud800 text"}',
        json.dumps({"conversations": [{"from": "human", "value": "x\udfff"}]}),
    ]
    p = _write(tmp_path / "s.jsonl", rows[:2])
    got, report = read_source({"format": "prompt", "path": p})
    assert len(got) == 1 and report["first_bad_rows"][0]["line"] == 2
    assert "lone surrogate \\ud800" in report["first_bad_rows"][0]["reason"]
    p2 = _write(
        tmp_path / "g.jsonl",
        [json.dumps({"conversations": [{"from": "human", "value": "ok"}]}), rows[2]],
    )
    _, report = read_source({"format": "sharegpt", "path": p2})
    assert "lone surrogate \\udfff" in report["first_bad_rows"][0]["reason"]


def test_prompt_turns_and_humaneval():
    conv = {
        "conversations": [
            {"role": "user", "content": "a"},
            {"role": "assistant", "content": "b"},
            {"role": "user", "content": "c"},
            {"role": "assistant", "content": "d"},
        ]
    }
    assert [t["content"] for t in prompt_turns(conv)] == ["a", "b", "c"]
    he = load_humaneval(3)
    assert [r["id"] for r in he] == ["HumanEval/0", "HumanEval/1", "HumanEval/2"]
    assert "def has_close_elements" in he[0]["conversations"][0]["content"]


def test_source_files_lists_every_input_file():
    cfg = {"data": {"sources": [{"format": "bundled"}, {"format": "prompt", "path": "x.jsonl"}]}}
    assert source_files(cfg) == [str(BUNDLED_PATH), "x.jsonl"]


def test_openai_messages_rows_are_read(tmp_path):
    rows = [
        json.dumps({"messages": [{"role": "developer", "content": "Be brief."},
                                 {"role": "user", "content": [{"type": "text", "text": "Hi "},
                                                              {"type": "text", "text": "there"}]},
                                 {"role": "assistant", "content": "Hello."}]}),
        json.dumps({"messages": [{"role": "user", "content": "x"},
                                 {"role": "assistant", "tool_calls": [{"id": "1"}], "content": ""}]}),
        json.dumps({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}),
    ]  # fmt: skip
    got, report = read_source({"format": "messages", "path": _write(tmp_path / "m.jsonl", rows)})
    assert got[0]["conversations"] == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi there"},
        {"role": "assistant", "content": "Hello."},
    ]
    reasons = [b["reason"] for b in report["first_bad_rows"]]
    assert "tool turns are not read" in reasons[0] and "image_url part" in reasons[1]


def test_a_source_in_another_format_is_an_error_naming_the_format(tmp_path):
    rows = [json.dumps({"prompt": "hi"})] * 3
    path = _write(tmp_path / "plain.jsonl", rows)
    with pytest.raises(SourceError) as e:
        read_source({"format": "sharegpt", "path": path})
    msg = str(e.value)
    assert "none of the 3 rows" in msg and "are format prompt" in msg
    assert "line 1: key 'conversations': missing or not a list" in msg
    assert "specforge, sharegpt, messages, prompt, auto" in msg


def test_openai_messages_rows_are_read_whatever_format_names_them(tmp_path):
    rows = [json.dumps({"messages": [{"role": "user", "content": f"hi {i}"}]}) for i in range(3)]
    path = _write(tmp_path / "openai.jsonl", rows)
    for fmt in ("sharegpt", "specforge", "prompt", "messages"):
        got, report = read_source({"format": fmt, "path": path})
        assert [r["conversations"][0]["content"] for r in got] == ["hi 0", "hi 1", "hi 2"]
        assert report["shapes"] == {"messages": 3} and report["skipped"] == 0
