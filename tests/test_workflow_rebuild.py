"""A real tiny run of the Snakefile up to the draft, then a corrupt shard: training refuses it and
deletes it (the last good draft stays in results/draft.last-good), the next plain rerun rebuilds
exactly that shard with the same sha256, and training resumes its finished run instead of
starting again."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from wf import flip_byte, snakemake, tiny_config, write_config

pytestmark = [pytest.mark.slow, pytest.mark.workflow]

R0, R1 = "rows_000000-000016", "rows_000016-000032"
TRAINED = ("results/draft", "results/train/metrics.jsonl")


def test_corrupt_shard_is_refused_then_a_plain_rerun_rebuilds_it_and_training_resumes(
    tmp_path: Path, tiny_target: Path
):
    write_config(tmp_path, tiny_config(tiny_target))
    snakemake(tmp_path, "--cores", "2", *TRAINED)
    hidden = tmp_path / "results" / "hidden"
    sha = {r: json.loads((hidden / f"{r}.json").read_text())["sha256"] for r in (R0, R1)}
    log = tmp_path / "logs" / "train.log"
    # every start checks the bytes it reads (crc32), whatever the files' times say
    assert "2 shard(s) checked against their manifests: 2 by crc32" in log.read_text()

    flip_byte(hidden / f"{R0}.safetensors")  # its mtime moves: train is stale, capture is not
    proc = snakemake(tmp_path, "--cores", "2", *TRAINED, check=False)
    assert proc.returncode != 0
    assert f"{R0}.safetensors: checksum mismatch" in log.read_text()

    assert not (hidden / f"{R0}.safetensors").exists() and (hidden / f"{R1}.safetensors").exists()
    assert not (tmp_path / "results" / "draft").exists()  # Snakemake removes a failed job's output
    assert (tmp_path / "results" / "draft.last-good" / "model.safetensors").is_file()

    kept = (hidden / f"{R1}.safetensors").stat().st_mtime_ns
    proc = snakemake(tmp_path, "--cores", "2", *TRAINED)
    out = proc.stdout + proc.stderr
    assert out.count("rule capture:") == 1 and "wildcards: rows=" + R0 in out, out[-3000:]
    assert (hidden / f"{R1}.safetensors").stat().st_mtime_ns == kept
    assert json.loads((hidden / f"{R0}.json").read_text())["sha256"] == sha[R0]
    text = log.read_text()
    assert "resuming" in text, text[-2000:]  # same run key: the finished run is reused
    assert "2 shard(s) checked against their manifests: 2 by crc32" in text, text[-2000:]
