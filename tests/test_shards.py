"""Shard format: writer/reader round trip, zero copy, refusals, and the writer's memory bound."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from draftsmith.hidden.shards import (
    STORAGE_DTYPES,
    ShardError,
    main,
    manifest_path,
    open_shard,
    verify,
    verify_dir,
)
from draftsmith.hidden.writer import ShardWriter, estimate_bytes

ROOT = Path(__file__).resolve().parents[1]


def make_shard(path, lengths=(5, 9, 3, 12), hidden=16, dtype="bfloat16", ids=(1, 2, 3), seed=0):
    g = torch.Generator().manual_seed(seed)
    t = sum(lengths)
    data = {
        "input_ids": torch.randint(0, 1000, (t,), generator=g),
        "loss_mask": (torch.rand(t, generator=g) > 0.5).to(torch.uint8),
        "row_offsets": torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()]),
        "aux": torch.randn(t, 3 * hidden, generator=g),
        "last": torch.randn(t, hidden, generator=g),
    }
    with ShardWriter(
        path,
        input_ids=data["input_ids"],
        loss_mask=data["loss_mask"],
        row_offsets=data["row_offsets"],
        hidden_size=hidden,
        dtype=dtype,
        manifest={
            "row_range": [0, len(lengths)],
            "aux_layer_ids": list(ids),
            "target_fingerprint": "abc",
            "backend": "test",
        },
    ) as w:
        offs = data["row_offsets"].tolist()
        for r in reversed(range(len(lengths))):  # out of order on purpose
            a, b = offs[r], offs[r + 1]
            w.write(a, data["aux"][a:b], data["last"][a:b])
    return data


@pytest.mark.parametrize("dtype", list(STORAGE_DTYPES))
def test_round_trip(tmp_path, dtype):
    path = tmp_path / "rows_000000-000004.safetensors"
    data = make_shard(path, dtype=dtype)
    shard = open_shard(
        path,
        expect={
            "aux_layer_ids": [1, 2, 3],
            "dtype": dtype,
            "hidden_size": 16,
            "target_fingerprint": "abc",
        },
        verify_sha=True,
    )
    store = STORAGE_DTYPES[dtype][0]
    assert len(shard) == 4 and shard.n_tokens == 29
    assert torch.equal(shard.input_ids, data["input_ids"])
    assert torch.equal(shard.loss_mask, data["loss_mask"])
    assert torch.equal(shard.row_offsets, data["row_offsets"])
    assert torch.equal(shard.aux_hidden_states, data["aux"].to(store))
    assert torch.equal(shard.last_hidden_states, data["last"].to(store))
    row = shard.row(1)
    assert torch.equal(row["aux_hidden_states"], data["aux"][5:14].to(store))
    # zero copy: a row is a view into the one mapped buffer
    assert (
        row["aux_hidden_states"].untyped_storage().data_ptr()
        == shard.aux_hidden_states.untyped_storage().data_ptr()
    )
    m = json.loads(manifest_path(path).read_text())
    assert m["convention"] == "sglang:output_of_layer" and m["norm"] == "post"
    assert m["tokens"] == 29 and m["rows"] == 4 and m["dtype"] == dtype and len(m["sha256"]) == 64
    # the file is plain safetensors
    with safe_open(str(path), "pt") as f:
        assert torch.equal(f.get_tensor("last_hidden_states"), data["last"].to(store))
        assert json.loads(f.metadata()["draftsmith_manifest"])["aux_layer_ids"] == [1, 2, 3]
    assert path.stat().st_size <= estimate_bytes(29, 4, 16, dtype)
    assert not list(tmp_path.glob(".tmp-*"))


def test_truncated_shard_refused(tmp_path):
    path = tmp_path / "rows_000000-000004.safetensors"
    make_shard(path)
    size = path.stat().st_size
    with open(path, "r+b") as f:
        f.truncate(size - 10)
    with pytest.raises(ShardError, match=r"rows_000000-000004.safetensors: truncated"):
        open_shard(path)
    with open(path, "r+b") as f:
        f.truncate(5)
    with pytest.raises(ShardError, match=r"rows_000000-000004.safetensors: truncated"):
        open_shard(path)


def test_wrong_layer_ids_refused(tmp_path):
    path = tmp_path / "rows_000000-000004.safetensors"
    make_shard(path, ids=(2, 16, 29))
    with pytest.raises(
        ShardError,
        match=r"rows_000000-000004.safetensors: manifest aux_layer_ids "
        r"is \[2, 16, 29\], expected \[1, 15, 28\]",
    ):
        open_shard(path, expect={"aux_layer_ids": [1, 15, 28]})
    with pytest.raises(ShardError, match="manifest dtype is 'bfloat16', expected 'float16'"):
        open_shard(path, expect={"dtype": "float16"})
    with pytest.raises(ShardError, match="target_fingerprint"):
        open_shard(path, expect={"target_fingerprint": "other"})
    m = json.loads(manifest_path(path).read_text())
    m["convention"] = "vllm:hf_index"
    manifest_path(path).write_text(json.dumps(m))
    with pytest.raises(ShardError, match="manifest convention is 'vllm:hf_index'"):
        open_shard(path)


def test_corrupt_shard_detected_and_deleted_alone(tmp_path):
    good = tmp_path / "rows_000000-000004.safetensors"
    bad = tmp_path / "rows_000004-000008.safetensors"
    make_shard(good)
    make_shard(bad, seed=1)
    with open(bad, "r+b") as f:  # flip one byte inside the hidden states
        f.seek(bad.stat().st_size // 2)
        byte = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([byte[0] ^ 0xFF]))
    open_shard(bad)  # structure is intact: only the checksum can tell
    with pytest.raises(ShardError, match="rows_000004-000008.safetensors: checksum mismatch"):
        verify(bad)
    with pytest.raises(SystemExit):
        main(["verify", str(tmp_path)])
    assert bad.exists()
    with pytest.raises(SystemExit, match="1 bad shard.*rebuild") as exit_:
        main(["verify", str(tmp_path), "--delete"])  # bad shards found: nonzero even when deleted
    assert exit_.value.code not in (0, None)
    assert good.exists() and not bad.exists() and not manifest_path(bad).exists()
    assert verify_dir(tmp_path) == []
    main(["verify", str(tmp_path)])  # a sound directory exits 0


def test_manifest_is_checked_against_the_copy_inside_the_shard(tmp_path):
    path = tmp_path / "rows_000000-000004.safetensors"
    make_shard(path)
    manifest = json.loads(manifest_path(path).read_text())
    manifest["aux_layer_ids"] = [4, 5, 6]  # e.g. the manifest of another capture copied over
    manifest_path(path).write_text(json.dumps(manifest))
    with pytest.raises(ShardError, match=r"differs from the copy inside .*\['aux_layer_ids'\]"):
        open_shard(path)
    assert len(verify_dir(tmp_path)) == 1
    with pytest.raises(SystemExit):
        main(["verify", str(tmp_path)])


def test_rebuilt_shard_with_the_same_tensors_has_the_same_sha256(tmp_path, monkeypatch):
    import draftsmith.hidden.writer as shard_writer

    clock = iter(f"2026-01-0{i}T00:00:00+0000" for i in range(1, 9))
    monkeypatch.setattr(shard_writer.time, "strftime", lambda *_: next(clock))
    first, second = tmp_path / "a" / "rows_000000-000004.safetensors", tmp_path / "b"
    second = second / first.name
    first.parent.mkdir()
    second.parent.mkdir()
    make_shard(first)
    make_shard(second)  # a rebuild: same tensors, later creation time
    m1, m2 = (json.loads(manifest_path(p).read_text()) for p in (first, second))
    assert m1["created"] != m2["created"]
    assert m1["sha256"] == m2["sha256"] and first.read_bytes() == second.read_bytes()


def test_verify_read_checks_the_bytes_not_the_mtime(tmp_path):
    """crc32 of the mapped bytes against the manifest: a flipped byte with its mtime put back is
    found; a manifest without crc32 (older) is checked by sha256 instead."""
    import os
    import zlib

    from draftsmith.hidden.shards import verify_read

    path = tmp_path / "rows_000000-000004.safetensors"
    make_shard(path)
    manifest = json.loads(manifest_path(path).read_text())
    assert manifest["crc32"] == f"{zlib.crc32(path.read_bytes()):08x}"
    assert verify_read(open_shard(path)) == "crc32"
    old = {k: v for k, v in manifest.items() if k != "crc32"}
    manifest_path(path).write_text(json.dumps(old))
    assert verify_read(open_shard(path)) == "sha256"
    st = path.stat()
    with open(path, "r+b") as f:  # a flipped byte inside the states, the mtime then put back
        f.seek(st.st_size // 2)
        byte = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([byte[0] ^ 0xFF]))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    with pytest.raises(ShardError, match=f"{path}: checksum mismatch .*sha256"):
        verify_read(open_shard(path))
    manifest_path(path).write_text(json.dumps(manifest))
    with pytest.raises(ShardError, match=f"{path}: checksum mismatch .*crc32"):
        verify_read(open_shard(path))


def test_killed_writer_leaves_no_temp_after_the_next_start(tmp_path):
    path = tmp_path / "rows_000000-000004.safetensors"
    other = tmp_path / ".tmp-rows_000004-000008.safetensors-abc"  # another range's: kept
    other.write_bytes(b"x")
    code = textwrap.dedent(
        f"""
        import os, signal, sys, torch
        sys.path.insert(0, {str(ROOT)!r})
        from draftsmith.hidden.writer import ShardWriter
        with ShardWriter({str(path)!r}, input_ids=torch.arange(4), loss_mask=torch.ones(4),
                         row_offsets=torch.tensor([0, 4]), hidden_size=8, dtype="float32",
                         manifest={{}}):
            os.kill(os.getpid(), signal.SIGKILL)
        """
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True)
    assert proc.returncode == -9
    left = list(tmp_path.glob(".tmp-rows_000000-000004.safetensors-*"))
    assert len(left) == 1 and not path.exists()
    make_shard(path)  # the next start of this range
    assert not left[0].exists() and other.exists()
    open_shard(path, verify_sha=True)


def test_writer_refuses_incomplete_and_double_writes(tmp_path):
    path = tmp_path / "rows_000000-000002.safetensors"
    kw = dict(
        input_ids=torch.arange(6),
        loss_mask=torch.ones(6, dtype=torch.uint8),
        row_offsets=torch.tensor([0, 2, 6]),
        hidden_size=4,
        dtype="float32",
        manifest={"aux_layer_ids": [0, 1, 2]},
    )
    with pytest.raises(ShardError, match="4 of 6 tokens never written"):
        with ShardWriter(path, **kw) as w:
            w.write(0, torch.zeros(2, 12), torch.zeros(2, 4))
    with pytest.raises(ShardError, match="written twice"):
        with ShardWriter(path, **kw) as w:
            w.write(0, torch.zeros(2, 12), torch.zeros(2, 4))
            w.write(1, torch.zeros(2, 12), torch.zeros(2, 4))
    assert not path.exists() and not manifest_path(path).exists()
    assert not list(tmp_path.glob(".tmp-*"))


RSS_SCRIPT = textwrap.dedent(
    """
    import resource, sys, torch
    from draftsmith.hidden.writer import ShardWriter
    rows, row_len, hidden = int(sys.argv[2]), 512, 1024
    t = rows * row_len
    offs = torch.arange(0, t + 1, row_len)
    aux, last = torch.randn(row_len, 3 * hidden), torch.randn(row_len, hidden)
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    with ShardWriter(sys.argv[1], input_ids=torch.zeros(t, dtype=torch.long),
                     loss_mask=torch.ones(t, dtype=torch.uint8), row_offsets=offs,
                     hidden_size=hidden, dtype="bfloat16", manifest={}) as w:
        for r in range(rows):
            w.write(r * row_len, aux, last)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print((peak - base) * 1024)
    """
)


def test_writer_memory_is_flat(tmp_path):
    """Peak RSS growth while writing a 16 MiB and a 128 MiB shard differs by far less."""
    growth = []
    for rows in (4, 32):  # 8 KiB of states per token: 16 MiB and 128 MiB shards
        out = tmp_path / f"rows_000000-{rows:06d}.safetensors"
        res = subprocess.run(
            [sys.executable, "-c", RSS_SCRIPT, str(out), str(rows)],
            capture_output=True,
            text=True,
            cwd=ROOT,
            check=True,
        )
        growth.append(int(res.stdout.strip()))
        assert out.stat().st_size > rows * 512 * 4096 * 2
        out.unlink()
    small, large = growth
    assert large - small < 32 << 20, f"RSS growth {small} -> {large} bytes"


def test_plan_estimate(tiny_target, tmp_path, capsys, monkeypatch):
    import shutil
    from collections import namedtuple

    from safetensors.torch import save_file

    from draftsmith.hidden import plan
    from draftsmith.targets.model import write_meta

    target = shutil.copytree(tiny_target, tmp_path / "target")
    write_meta(target, source="path", origin=str(tiny_target))
    tokens = []
    for name, lengths in (("rows_000000-000002", [5, 9]), ("rows_000002-000003", [12])):
        t = sum(lengths)
        f = tmp_path / "tokens" / f"{name}.safetensors"
        f.parent.mkdir(exist_ok=True)
        save_file(
            {
                "input_ids": torch.zeros(t, dtype=torch.long),
                "loss_mask": torch.ones(t, dtype=torch.uint8),
                "row_offsets": torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()]),
            },
            str(f),
        )
        tokens.append(str(f))
    out = tmp_path / "hidden" / "plan.json"
    cfg = json.dumps({"capture": {"aux_layer_ids": "auto", "dtype": "float16"}})
    plan.main(["--cfg", cfg, "--target", str(target), "--out", str(out), *tokens])
    p = json.loads(out.read_text())
    assert p["tokens"] == 26 and p["rows"] == 3 and p["hidden_size"] == 64
    assert p["bytes_per_token"] == 4 * 64 * 2 + 9 and p["aux_layer_ids"] == [0, 2, 4]
    assert p["total_bytes"] == estimate_bytes(14, 2, 64, "float16") + estimate_bytes(
        12, 1, 64, "float16"
    )
    assert "free in" in capsys.readouterr().out
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(plan.shutil, "disk_usage", lambda p: usage(10, 10, 100))
    with pytest.raises(SystemExit, match="the shards still to build need .* but .* has 100 B free"):
        plan.main(["--cfg", cfg, "--target", str(target), "--out", str(out), *tokens])


def test_a_non_finite_state_is_refused_naming_row_token_and_layer(tmp_path):
    """Capture never stores NaN or inf: the writer names the row, the token and the aux layer
    id (or the final state), and no shard is left behind."""
    hidden, ids = 4, [1, 3, 5]
    path = tmp_path / "rows_000000-000002.safetensors"
    kw = dict(input_ids=torch.arange(6), loss_mask=torch.ones(6), row_offsets=torch.tensor([0, 2, 6]),
              hidden_size=hidden, dtype="float32", manifest={"aux_layer_ids": ids})  # fmt: skip
    aux, last = torch.zeros(6, 3 * hidden), torch.zeros(6, hidden)
    aux[3, 2 * hidden + 1] = float("nan")  # row 1, its token 1, the third aux layer (id 5)
    with pytest.raises(ShardError, match=r"row 1 \(token 1\): 1 non-finite values in 1 tokens, "
                                         r"first at aux layer 5"):  # fmt: skip
        with ShardWriter(path, **kw) as w:
            w.write(0, aux, last)
    assert not path.exists() and not list(tmp_path.glob(".tmp-*"))
    aux[3, 2 * hidden + 1] = 0.0
    last[0, 0] = float("inf")
    with pytest.raises(ShardError, match=r"row 0 \(token 0\).*first at the final state"):
        with ShardWriter(path, **kw) as w:
            w.write(0, aux, last)


def test_verify_finds_non_finite_states_a_shard_of_an_older_capture_holds(tmp_path, monkeypatch):
    """A shard written before capture refused NaN (its sha256 intact): `shards verify` names it."""
    path = tmp_path / "rows_000000-000004.safetensors"
    monkeypatch.setattr(ShardWriter, "refuse_nonfinite", lambda self, *a: None)
    real_write = ShardWriter.write

    def write(self, start, aux, last):
        aux = aux.clone()
        aux[0, 0] = float("nan")
        return real_write(self, start, aux, last)

    monkeypatch.setattr(ShardWriter, "write", write)
    make_shard(path)
    monkeypatch.undo()
    open_shard(path, verify_sha=True)  # the file is as its manifest says
    (problem,) = verify_dir(tmp_path)
    assert "non-finite values" in problem and "aux_hidden_states: 4 NaN" in problem
