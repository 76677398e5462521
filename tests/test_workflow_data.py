"""The data stage in the real Snakefile: a real tiny run, then targeted rebuilds planned by -n."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from wf import planned_jobs, snakemake, tiny_config, write_config

pytestmark = pytest.mark.workflow

VOCAB = "results/vocab/vocab.safetensors"
R0, R1 = "rows_000000-000016", "rows_000016-000032"


def stale(workdir: Path, *targets: str) -> dict[str, int]:
    """Jobs `snakemake -n` plans, without the aggregate target rule `data` itself."""
    jobs = planned_jobs(workdir, *targets)
    jobs.pop("data", None)
    return jobs


@pytest.mark.slow
def test_data_stage_builds_and_rebuilds_only_what_is_stale(tmp_path: Path, tiny_target: Path):
    write_config(tmp_path, tiny_config(tiny_target))  # 40 bundled rows, 8 held out, 16 per range
    snakemake(tmp_path, "--cores", "2", "data")

    sources = json.loads((tmp_path / "results/data/sources.json").read_text())
    assert sources["train_rows"] == 32 and sources["heldout_rows"] == 8
    for rows in (R0, R1):
        lines = (tmp_path / f"results/data/{rows}.jsonl").read_text().splitlines()
        report = json.loads((tmp_path / f"results/data/{rows}.report.json").read_text())
        # rows whose prompt leaves no room within data.max_length (128 here) are dropped, counted
        assert report["tokens_per_second"] > 0 and report["rows"] == 16
        assert len(lines) == 16 - report["dropped_rows"] > 0
        assert len(report["dropped_ids"]) == report["dropped_rows"]
        assert all(json.loads(x)["conversations"][-1]["role"] == "assistant" for x in lines)
        assert "tokens/s" in (tmp_path / f"logs/regenerate/{rows}.log").read_text()
    from draftsmith.data.tokens import read_tokens
    from draftsmith.data.vocab import load_vocab

    tokens = read_tokens(tmp_path / f"results/tokens/{R0}.safetensors")
    n0 = len((tmp_path / f"results/data/{R0}.jsonl").read_text().splitlines())
    assert tokens["row_offsets"].numel() == n0 + 1 and int(tokens["loss_mask"].sum()) > 0
    d2t, t2d = load_vocab(tmp_path / VOCAB)
    assert d2t.numel() == 64 and int(t2d.sum()) == 64
    assert stale(tmp_path, "data") == {}

    # Deleting one range's regenerated rows rebuilds that range and what depends on it only
    # (`data` requests every data artifact, as `rule all` does; Snakemake does not rebuild a
    # missing intermediate nobody requests).
    kept = (tmp_path / f"results/data/{R1}.jsonl").stat().st_mtime_ns
    (tmp_path / f"results/data/{R0}.jsonl").unlink()
    assert stale(tmp_path, "data") == {"regenerate": 1, "tokenize": 1, "vocab": 1}
    # ... and naming one range's file builds exactly that range.
    (tmp_path / f"results/data/{R1}.jsonl").unlink()
    assert planned_jobs(tmp_path, f"results/data/{R1}.jsonl") == {"regenerate": 1}
    snakemake(tmp_path, "--cores", "2", f"results/data/{R0}.jsonl")
    assert not (tmp_path / f"results/data/{R1}.jsonl").exists()
    snakemake(tmp_path, "--cores", "2", "data")
    assert (tmp_path / f"results/data/{R1}.jsonl").stat().st_mtime_ns > kept
    assert stale(tmp_path, "data") == {}

    # Config changes re-run exactly the jobs that read the changed keys.
    for section, change, expected in [
        ("draft", {"vocab_size": 32}, {"vocab": 1}),
        # data.max_length also bounds prompt + reply in regeneration
        ("data", {"max_length": 64}, {"regenerate": 2, "tokenize": 2, "vocab": 1}),
        ("regenerate", {"max_new_tokens": 4}, {"regenerate": 2, "tokenize": 2, "vocab": 1}),
    ]:
        write_config(tmp_path, tiny_config(tiny_target, **{section: change}))
        assert stale(tmp_path, "data") == expected, section
    write_config(tmp_path, tiny_config(tiny_target))
    assert stale(tmp_path, "data") == {}


def test_missing_answers_with_regeneration_off_fail_naming_the_row(
    tmp_path: Path, tiny_target: Path
):
    cfg = tiny_config(tiny_target, regenerate={"enabled": False})
    write_config(tmp_path, cfg)
    proc = snakemake(tmp_path, "--cores", "1", f"results/data/{R0}.jsonl", check=False)
    assert proc.returncode != 0
    log = (tmp_path / f"logs/regenerate/{R0}.log").read_text()
    assert "regenerate.enabled is false" in log and "source 'bundled'" in log


def test_bad_rows_are_reported_and_the_ranges_follow_the_valid_count(
    tmp_path: Path, tiny_target: Path
):
    src = tmp_path / "mine.jsonl"
    good = [
        json.dumps(
            {
                "id": f"g{i}",
                "conversations": [
                    {"role": "user", "content": f"q{i}"},
                    {"role": "assistant", "content": f"a{i}"},
                ],
            }
        )
        for i in range(21)
    ]
    src.write_text("\n".join([*good[:5], "{broken", *good[5:], '{"conversations": []}']) + "\n")
    cfg = tiny_config(
        tiny_target,
        data={
            "sources": [{"format": "specforge", "path": str(src)}],
            "heldout_rows": 5,
            "rows_per_shard": 8,
        },
    )
    write_config(tmp_path, cfg)
    jobs = planned_jobs(tmp_path, VOCAB)
    assert jobs["regenerate"] == 2  # 21 valid rows - 5 held out = 16 = 2 ranges of 8
    snakemake(tmp_path, "--cores", "1", "results/data/sources.json")
    report = json.loads((tmp_path / "results/data/sources.json").read_text())
    assert report["skipped_rows"] == 2
    assert [b["line"] for b in report["sources"][0]["first_bad_rows"]] == [6, 23]
