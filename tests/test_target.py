"""The two digests of a `target.source: path` directory: the DAG-time signature (stat, headers,
small files) and the recorded content fingerprint."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

from draftsmith.targets import model as tgt


@pytest.fixture
def model(tmp_path: Path, tiny_target: Path) -> Path:
    """A user's model written an hour ago (the signature counts mtimes in whole seconds)."""
    model = shutil.copytree(tiny_target, tmp_path / "model")
    for f in model.iterdir():
        st = f.stat()
        os.utime(f, (st.st_atime - 3600, st.st_mtime - 3600))
    return model


def rewrite_weights(model: Path, keep_mtime: bool = False) -> None:
    path = model / "model.safetensors"
    st = path.stat()
    tensors = load_file(path)
    name = sorted(tensors)[0]
    tensors[name] = tensors[name] * 2 + 1
    save_file(tensors, path, metadata={"format": "pt"})
    assert path.stat().st_size == st.st_size  # same shapes: same size and header
    if keep_mtime:
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))


def test_signature_sees_rewritten_weights_edited_files_and_nothing_else(model: Path, tmp_path):
    base = tgt.source_signature(model)
    assert tgt.source_signature(model) == base
    copy = shutil.copytree(model, tmp_path / "copy")  # cp -a: same names, sizes, mtimes
    assert tgt.source_signature(copy) == base
    (model / "README.md").write_text("a model card edit")
    assert tgt.source_signature(model) == base
    rewrite_weights(model)  # new values, same shapes: only the mtime tells
    assert tgt.source_signature(model) != base
    base = tgt.source_signature(model)
    cfg = model / "config.json"
    st = cfg.stat()
    cfg.write_text(json.dumps({**json.loads(cfg.read_text()), "rope_theta": 1.0}))
    os.utime(cfg, ns=(st.st_atime_ns, st.st_mtime_ns))  # content counts, not just times
    assert tgt.source_signature(model) != base
    base = tgt.source_signature(model)
    (model / "modeling_custom.py").write_text("# remote code\n")
    assert tgt.source_signature(model) != base


def test_fingerprint_follows_bytes_not_times(model: Path, tmp_path, monkeypatch):
    base = tgt.fingerprint_files(model)
    copy = tmp_path / "copy"
    shutil.copytree(model, copy, copy_function=shutil.copyfile)  # new mtimes, same bytes
    assert tgt.fingerprint_files(copy) == base
    rewrite_weights(copy, keep_mtime=True)
    assert tgt.fingerprint_files(copy) != base  # full hash: the weights are under 4 GiB
    monkeypatch.setattr(tgt, "FULL_HASH_BYTES", 0)  # a huge target: sampled blocks only
    sampled = tgt.fingerprint_files(model)
    assert sampled != base and tgt.fingerprint_files(copy) != sampled  # first block changed


def test_bad_paths_name_the_problem(tmp_path: Path):
    with pytest.raises(tgt.TargetError, match="target.path is empty"):
        tgt.source_signature("")
    (tmp_path / "m").mkdir()
    with pytest.raises(tgt.TargetError, match="has no config.json"):
        tgt.source_signature(tmp_path / "m")


def test_relative_target_path_gets_relative_links(tmp_path: Path, tiny_target: Path, monkeypatch):
    project = tmp_path / "proj"
    shutil.copytree(tiny_target, project / "model")
    (project / "results").mkdir()
    monkeypatch.chdir(project)
    tgt.link_path_target(Path("model"), Path("results/target"))
    link = os.readlink(project / "results" / "target" / "config.json")
    assert not os.path.isabs(link)
    moved = project.rename(tmp_path / "moved")
    monkeypatch.chdir(moved)
    assert json.loads((moved / "results" / "target" / "config.json").read_text())


def test_gguf_is_parsed_once_inside_the_conversion_context(tmp_path):
    """gguf's reader and tensor-name map are memoized inside `gguf_parsed_once` (the embedded
    conversion's three transformers loads share one parse) and restored on exit."""
    import gguf

    from draftsmith.targets.model import gguf_parsed_once

    path = tmp_path / "t.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(1)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    reader, names = gguf.GGUFReader, gguf.get_tensor_name_map
    with gguf_parsed_once():
        assert gguf.GGUFReader(str(path)) is gguf.GGUFReader(str(path))
        arch = gguf.MODEL_ARCH.LLAMA
        assert gguf.get_tensor_name_map(arch, 2) is gguf.get_tensor_name_map(arch, 2)
    assert gguf.GGUFReader is reader and gguf.get_tensor_name_map is names
    assert gguf.GGUFReader(str(path)) is not gguf.GGUFReader(str(path))
