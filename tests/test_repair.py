"""Training deletes a shard it refuses (so the next plain run rebuilds just
that range), and a failed rebuild of the draft leaves the last good one beside it.
(The real Snakefile run of the same is tests/test_workflow_rebuild.py, slow.)"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from test_train import cfg_json, make_inputs, run_train
from wf import flip_byte

from draftsmith.runtime.repair import keep_last_good


def tree(d: Path) -> dict[str, bytes]:
    return {str(p.relative_to(d)): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}


@pytest.fixture
def trained(tmp_path):
    inputs = make_inputs(tmp_path / "in", rows=4)
    out = tmp_path / "results"
    run_train(inputs, out, cfg_json(max_steps=1))
    return inputs, out


def test_a_corrupt_shard_is_deleted_and_the_last_good_draft_kept(trained):
    inputs, out = trained
    good = tree(out / "draft")
    assert tree(out / "draft.last-good") == good  # hard links of the export
    bad, other = inputs["shards"]
    flip_byte(bad)
    shutil.rmtree(out / "draft")  # what Snakemake does before (and after) a failed train job
    with pytest.raises(SystemExit, match=rf"{bad.name}: checksum mismatch[\s\S]*deleted the"):
        run_train(inputs, out, cfg_json(max_steps=1))
    assert not bad.exists() and not bad.with_suffix(".json").exists()  # missing: rebuilt next
    assert other.exists() and other.with_suffix(".json").exists()  # untouched
    assert tree(out / "draft.last-good") == good


def test_a_manifest_with_edited_layer_ids_is_deleted_with_its_shard(trained):
    inputs, out = trained
    bad = inputs["shards"][0]
    manifest = bad.with_suffix(".json")
    m = json.loads(manifest.read_text())
    m["aux_layer_ids"] = [0, 1, 2]
    manifest.write_text(json.dumps(m))
    with pytest.raises(SystemExit, match=rf"{bad.stem}[\s\S]*aux_layer_ids[\s\S]*deleted the"):
        run_train(inputs, out, cfg_json(max_steps=1))
    assert not bad.exists() and not manifest.exists()
    assert inputs["shards"][1].exists()


def test_keep_last_good_replaces_the_previous_copy(tmp_path):
    draft = tmp_path / "draft"
    (draft / "sub").mkdir(parents=True)
    (draft / "a").write_text("one")
    (draft / "sub" / "b").write_text("two")
    beside = keep_last_good(draft)
    assert tree(beside) == {"a": b"one", "sub/b": b"two"}
    (draft / "a").unlink()  # the export writes new files, never over the old ones
    (draft / "a").write_text("three")
    assert tree(beside)["a"] == b"one"
    keep_last_good(draft)
    assert tree(beside) == {"a": b"three", "sub/b": b"two"}
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".tmp")] == []
