"""Capture backend `sglang`: the dump format both sides agree on, and the real patched server.

The fast tests take the server's dump writer out of the capture patch itself (the new file
`sglang/srt/draftsmith_dump.py` imports only torch and the standard library) and check that
what it writes is what the client reads, and that every corruption is refused. The slow tests
(`slow` + `sglang`) start the real patched SGLang on CPU through the sglang-cpu role.
"""

from __future__ import annotations

import importlib.util
import json
import struct
from pathlib import Path

import pytest
import torch

from draftsmith.engines.sglang_capture import DumpError, ids_crc32, read_dump

ROOT = Path(__file__).resolve().parents[1]
PATCH = ROOT / "patches" / "sglang-0.5.23" / "draftsmith-capture.patch"


def new_file_from_patch(patch: Path, rel: str) -> str:
    """The content of a file the patch creates (its single `@@ -0,0` hunk)."""
    lines, out, inside = patch.read_text().splitlines(), [], False
    for line in lines:
        if line.startswith("+++ "):
            inside = line[4:].split("\t")[0].endswith(rel)
            continue
        if inside and line.startswith("diff "):
            break
        if inside and line.startswith("+"):
            out.append(line[1:])
    assert out, f"{patch} creates no {rel}"
    return "\n".join(out) + "\n"


@pytest.fixture(scope="module")
def server_dump(tmp_path_factory):
    path = tmp_path_factory.mktemp("patch") / "draftsmith_dump.py"
    path.write_text(new_file_from_patch(PATCH, "sglang/srt/draftsmith_dump.py"))
    spec = importlib.util.spec_from_file_location("draftsmith_dump_under_test", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def write(server_dump, tmp_path, ids, aux, last, **meta_overrides):
    key = "rows_000000-000004.r1.a0.abcd1234"
    meta = {
        "format": server_dump.FORMAT,
        "patch": server_dump.PATCH_ID,
        "key": key,
        "tokens": len(ids),
        "hidden_size": last.shape[1],
        "layer_inputs": [2, 4, 6],
        "dtype": "bfloat16",
        "ids_crc32": server_dump.ids_crc32(ids),
        "tp_rank": 0,
        "tp_size": 1,
        **meta_overrides,
    }
    server_dump.write_dump(str(tmp_path), key, meta, aux, last)
    expect = {
        "key": key,
        "patch": server_dump.PATCH_ID,
        "tokens": len(ids),
        "hidden_size": last.shape[1],
        "layer_inputs": [2, 4, 6],
        "ids_crc32": ids_crc32(torch.tensor(ids)),
    }
    return tmp_path / f"{key}.dump", expect


def test_server_dump_roundtrips_through_client(server_dump, tmp_path):
    ids = [5, 17, 3, 99, 1024, 7]
    aux = torch.randn(6, 3 * 8).to(torch.bfloat16)
    last = torch.randn(6, 8).to(torch.bfloat16)
    path, expect = write(server_dump, tmp_path, ids, aux, last)
    assert sorted(p.name for p in tmp_path.iterdir()) == [path.name]  # temp file renamed away
    got_aux, got_last, header = read_dump(path, expect=expect)
    assert torch.equal(got_aux, aux) and torch.equal(got_last, last)
    assert header["tp_rank"] == 0 and header["dtype"] == "bfloat16"
    assert (path.stat().st_size - aux.numel() * 2 - last.numel() * 2) % 64 == 0  # aligned data
    assert ids_crc32(torch.tensor(ids)) == server_dump.ids_crc32(ids)


@pytest.mark.parametrize(
    "case, match",
    [
        ("truncated", "bytes, expected"),
        ("padded", "bytes, expected"),
        ("other_tokens", "header tokens is 5, expected 6"),
        ("other_layers", "header layer_inputs is \\[1, 3, 5\\], expected \\[2, 4, 6\\]"),
        ("other_ids", "header ids_crc32"),
        ("other_patch", "header patch"),
        ("magic", "not a draftsmith dump"),
    ],
)
def test_client_refuses_wrong_dumps(server_dump, tmp_path, case, match):
    ids = [5, 17, 3, 99, 1024, 7]
    aux, last = torch.zeros(6, 24, dtype=torch.bfloat16), torch.zeros(6, 8, dtype=torch.bfloat16)
    overrides = {
        "other_tokens": {"tokens": 5},
        "other_layers": {"layer_inputs": [1, 3, 5]},
        "other_ids": {"ids_crc32": server_dump.ids_crc32(ids[::-1])},
        "other_patch": {"patch": "someone-else-1"},
    }.get(case, {})
    path, expect = write(server_dump, tmp_path, ids, aux, last, **overrides)
    data = path.read_bytes()
    if case == "truncated":
        path.write_bytes(data[:-2])
    elif case == "padded":
        path.write_bytes(data + b"\0\0")
    elif case == "magic":
        path.write_bytes(b"XXXXXXXX" + data[8:])
    with pytest.raises(DumpError, match=match):
        read_dump(path, expect=expect)


def test_header_is_small_json(server_dump, tmp_path):
    ids = list(range(10))
    aux, last = torch.zeros(10, 24, dtype=torch.bfloat16), torch.zeros(10, 8, dtype=torch.bfloat16)
    path, _ = write(server_dump, tmp_path, ids, aux, last)
    data = path.read_bytes()
    (n,) = struct.unpack("<Q", data[8:16])
    assert data[:8] == b"DSDUMP01" and n < 1024
    assert json.loads(data[16 : 16 + n])["tokens"] == 10
