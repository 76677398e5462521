"""The hidden-state shard: one safetensors file per row range plus a JSON manifest beside it.

File layout (plain safetensors, readable by `safetensors.safe_open`): tensors in this order, each
starting on an 8-byte boundary so every view is aligned:

    input_ids          [T]      int64
    row_offsets        [R+1]    int64    row r is tokens row_offsets[r]:row_offsets[r+1]
    aux_hidden_states  [T, 3H]  storage dtype (bfloat16 | float16 | float32)
    last_hidden_states [T, H]   storage dtype, post-norm (the input of the target's lm_head)
    loss_mask          [T]      uint8

All sizes are known from the token file before capture, so `ShardWriter` writes the header and
the token tensors first and then puts each batch of hidden states at its final offset
(`os.pwrite`): memory stays bounded by one batch however large the shard. The manifest
(`rows_<a>-<b>.json`) carries the row range, counts, layer ids and their convention, norm,
dtypes, target fingerprint, backend, provenance and the sha256 of the shard file; a copy without
the checksum sits in the safetensors `__metadata__` so a shard is self-describing.

`open_shard` memory-maps the file (copy-on-write, never read into memory) and serves rows as
views. An 8-bit float mode with per-token scales would add `aux_scales [T]` and
`last_scales [T]` float32 tensors and a `scales` manifest key; readers refuse dtypes they do not
know, so such shards cannot be misread as plain states.
"""

from __future__ import annotations

import argparse
import json
import os
import struct
import sys
import time
from pathlib import Path

import numpy as np
import torch

from draftsmith import __version__
from draftsmith.common import atomic_path, atomic_write_json, sha256_file

CONVENTION = "sglang:output_of_layer"
NORM = "post"
FORMAT = "draftsmith-hidden-v1"
# storage dtype name -> (torch dtype, safetensors dtype tag)
STORAGE_DTYPES = {
    "bfloat16": (torch.bfloat16, "BF16"),
    "float16": (torch.float16, "F16"),
    "float32": (torch.float32, "F32"),
}
_ST_TORCH = {
    "I64": torch.int64,
    "U8": torch.uint8,
    **{tag: dt for dt, tag in STORAGE_DTYPES.values()},
}
# manifest keys `expect` may check, compared for equality
EXPECT_KEYS = ("aux_layer_ids", "convention", "norm", "dtype", "hidden_size", "target_fingerprint")


class ShardError(ValueError):
    """A shard or its manifest is missing, truncated, corrupt or not what the caller expects."""


def manifest_path(shard_path: str | os.PathLike) -> Path:
    return Path(shard_path).with_suffix(".json")


def _layout(n_tokens: int, n_rows: int, hidden_size: int, dtype: str) -> list[tuple]:
    """(name, safetensors dtype, shape, nbytes) in file order."""
    tdt, tag = STORAGE_DTYPES[dtype]
    item = torch.empty((), dtype=tdt).element_size()
    t, h = n_tokens, hidden_size
    return [
        ("input_ids", "I64", [t], 8 * t),
        ("row_offsets", "I64", [n_rows + 1], 8 * (n_rows + 1)),
        ("aux_hidden_states", tag, [t, 3 * h], item * t * 3 * h),
        ("last_hidden_states", tag, [t, h], item * t * h),
        ("loss_mask", "U8", [t], t),
    ]


def _header(layout: list[tuple], metadata: dict) -> tuple[bytes, dict]:
    """Serialized safetensors header (8-byte length + JSON, space-padded to 8) and byte offsets."""
    entries, offsets, pos = {"__metadata__": metadata}, {}, 0
    for name, tag, shape, nbytes in layout:
        entries[name] = {"dtype": tag, "shape": shape, "data_offsets": [pos, pos + nbytes]}
        offsets[name] = pos
        pos += nbytes + (-nbytes) % 8  # keep the next tensor 8-byte aligned
    text = json.dumps(entries, separators=(",", ":")).encode()
    text += b" " * ((-len(text)) % 8)
    return struct.pack("<Q", len(text)) + text, offsets


def estimate_bytes(n_tokens: int, n_rows: int, hidden_size: int, dtype: str) -> int:
    """Size of a shard file (headers of a few KiB included as a 4 KiB allowance)."""
    return 4096 + sum(n + (-n) % 8 for *_, n in _layout(n_tokens, n_rows, hidden_size, dtype))


def _check_tokens(input_ids, loss_mask, row_offsets, where: str) -> None:
    t = input_ids.numel()
    if input_ids.dim() != 1 or loss_mask.shape != input_ids.shape:
        raise ShardError(
            f"{where}: input_ids {list(input_ids.shape)} and loss_mask "
            f"{list(loss_mask.shape)} must be equal 1-d shapes"
        )
    ro = row_offsets
    if ro.dim() != 1 or ro.numel() < 2 or int(ro[0]) != 0 or int(ro[-1]) != t:
        raise ShardError(f"{where}: row_offsets must run from 0 to the token count {t}")
    if bool((ro[1:] <= ro[:-1]).any()):
        raise ShardError(f"{where}: row_offsets are not strictly increasing (empty row?)")


class ShardWriter:
    """Streaming writer: header and token tensors first, then hidden states batch by batch.

    with ShardWriter(path, input_ids=..., loss_mask=..., row_offsets=..., hidden_size=H,
                     dtype="bfloat16", manifest={...}) as w:
        w.write(token_start, aux [n, 3H], last [n, H])   # any order, each token exactly once
    w.manifest  # the final manifest, also written to rows_<a>-<b>.json

    The file is written under a temp name, fsynced and renamed; on error nothing is left behind.
    """

    def __init__(
        self,
        path,
        *,
        input_ids,
        loss_mask,
        row_offsets,
        hidden_size: int,
        dtype: str,
        manifest: dict,
    ):
        if dtype not in STORAGE_DTYPES:
            raise ShardError(
                f"{path}: storage dtype {dtype!r} is not one of {list(STORAGE_DTYPES)}"
            )
        _check_tokens(input_ids, loss_mask, row_offsets, str(path))
        self.path = Path(path)
        self.hidden_size = int(hidden_size)
        self.dtype = dtype
        self.torch_dtype = STORAGE_DTYPES[dtype][0]
        self.n_tokens = input_ids.numel()
        self.n_rows = row_offsets.numel() - 1
        self.manifest = {
            "format": FORMAT,
            **manifest,
            "rows": self.n_rows,
            "tokens": self.n_tokens,
            "hidden_size": self.hidden_size,
            "convention": CONVENTION,
            "norm": NORM,
            "dtype": dtype,
            "tensors": {},
            "draftsmith_version": __version__,
            "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        }
        layout = _layout(self.n_tokens, self.n_rows, self.hidden_size, dtype)
        self.manifest["tensors"] = {
            name: {"dtype": tag, "shape": shape} for name, tag, shape, _ in layout
        }
        header, offsets = _header(layout, {"draftsmith_manifest": json.dumps(self.manifest)})
        self._base = len(header)
        self._offsets = offsets
        self._total = self._base + offsets["loss_mask"] + self.n_tokens
        self._written = np.zeros(self.n_tokens, dtype=bool)
        self._inputs = {
            "input_ids": input_ids.to(torch.int64).contiguous(),
            "row_offsets": row_offsets.to(torch.int64).contiguous(),
            "loss_mask": loss_mask.to(torch.uint8).contiguous(),
        }
        self._header = header
        self._ctx = None
        self._fd = None

    def __enter__(self) -> ShardWriter:
        self._ctx = atomic_path(self.path)
        tmp = self._ctx.__enter__()
        self._tmp = tmp
        try:
            self._fd = os.open(tmp, os.O_RDWR)
            os.ftruncate(self._fd, self._total)  # sparse until written: no memory, no zero-fill
            os.pwrite(self._fd, self._header, 0)
            for name, t in self._inputs.items():
                self._pwrite(t.numpy().tobytes(), self._offsets[name])
        except BaseException as e:
            if self._fd is not None:
                os.close(self._fd)
            self._ctx.__exit__(type(e), e, e.__traceback__)
            raise
        return self

    def _pwrite(self, data, offset: int) -> None:
        view = memoryview(data).cast("B")
        pos = self._base + offset
        while view:
            n = os.pwrite(self._fd, view, pos)
            view, pos = view[n:], pos + n

    def write(self, start: int, aux: torch.Tensor, last: torch.Tensor) -> None:
        """Store hidden states of tokens [start, start + n): aux [n, 3H], last [n, H]."""
        n, h = last.shape[0], self.hidden_size
        if tuple(aux.shape) != (n, 3 * h) or tuple(last.shape) != (n, h):
            raise ShardError(
                f"{self.path}: batch shapes aux {list(aux.shape)} last "
                f"{list(last.shape)} do not match [n, {3 * h}] and [n, {h}]"
            )
        if start < 0 or start + n > self.n_tokens:
            raise ShardError(
                f"{self.path}: tokens [{start}, {start + n}) outside [0, {self.n_tokens})"
            )
        if self._written[start : start + n].any():
            raise ShardError(f"{self.path}: tokens [{start}, {start + n}) written twice")
        item = torch.empty((), dtype=self.torch_dtype).element_size()
        for name, x, width in (("aux_hidden_states", aux, 3 * h), ("last_hidden_states", last, h)):
            x = x.detach().to("cpu", self.torch_dtype).contiguous()
            raw = x.view(torch.uint8) if x.dtype != torch.uint8 else x
            self._pwrite(raw.numpy(), self._offsets[name] + start * width * item)
        self._written[start : start + n] = True

    def __exit__(self, exc_type, exc, tb) -> bool:
        os.close(self._fd)
        self._fd = None
        if exc_type is not None:
            self._ctx.__exit__(exc_type, exc, tb)  # removes the temp file
            return False
        try:
            if not self._written.all():
                missing = int((~self._written).sum())
                raise ShardError(f"{self.path}: {missing} of {self.n_tokens} tokens never written")
            self.manifest["sha256"] = sha256_file(self._tmp)
        except BaseException as e:
            self._ctx.__exit__(type(e), e, e.__traceback__)
            raise
        self._ctx.__exit__(None, None, None)
        atomic_write_json(manifest_path(self.path), self.manifest)
        return False


class Shard:
    """A memory-mapped shard. Tensors are read-only-by-convention views of the mapped file."""

    def __init__(self, path: Path, manifest: dict, tensors: dict[str, torch.Tensor]):
        self.path = path
        self.manifest = manifest
        self.input_ids = tensors["input_ids"]
        self.loss_mask = tensors["loss_mask"]
        self.row_offsets = tensors["row_offsets"]
        self.aux_hidden_states = tensors["aux_hidden_states"]
        self.last_hidden_states = tensors["last_hidden_states"]
        self._offsets = self.row_offsets.tolist()

    def __len__(self) -> int:
        return len(self._offsets) - 1

    @property
    def n_tokens(self) -> int:
        return self.input_ids.numel()

    def row(self, i: int) -> dict[str, torch.Tensor]:
        """Views (no copy) of row i's tokens, mask and states."""
        if not 0 <= i < len(self):
            raise IndexError(f"{self.path}: row {i} outside [0, {len(self)})")
        a, b = self._offsets[i], self._offsets[i + 1]
        return {
            "input_ids": self.input_ids[a:b],
            "loss_mask": self.loss_mask[a:b],
            "aux_hidden_states": self.aux_hidden_states[a:b],
            "last_hidden_states": self.last_hidden_states[a:b],
        }


def _read_header(path: Path) -> tuple[int, dict]:
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise ShardError(f"{path}: truncated shard ({size} bytes, no safetensors header)")
        (n,) = struct.unpack("<Q", head)
        if n > size - 8 or n > 100_000_000:
            raise ShardError(
                f"{path}: truncated or corrupt shard (header length {n}, file {size} B)"
            )
        try:
            header = json.loads(f.read(n))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ShardError(f"{path}: corrupt safetensors header ({e})") from None
    return 8 + n, header


def _load_manifest(path: Path) -> dict:
    mpath = manifest_path(path)
    if not mpath.exists():
        raise ShardError(f"{path}: manifest {mpath} is missing")
    try:
        return json.loads(mpath.read_text())
    except json.JSONDecodeError as e:
        raise ShardError(f"{mpath}: manifest is not valid JSON ({e})") from None


def check_manifest(manifest: dict, expect: dict | None, where: str) -> None:
    """Raise ShardError naming `where` when the manifest's convention or any expected key differs."""
    if manifest.get("format") != FORMAT:
        raise ShardError(
            f"{where}: manifest format {manifest.get('format')!r}, expected {FORMAT!r}"
        )
    fixed = {"convention": CONVENTION, "norm": NORM}
    for key, want in {**fixed, **(expect or {})}.items():
        if key not in EXPECT_KEYS:
            raise ShardError(f"{where}: cannot check unknown manifest key {key!r}")
        have = manifest.get(key)
        if key == "aux_layer_ids" and have is not None:
            have, want = list(have), list(want)
        if have != want:
            raise ShardError(f"{where}: manifest {key} is {have!r}, expected {want!r}")


def open_shard(path, expect: dict | None = None, verify_sha: bool = False) -> Shard:
    """Memory-map a shard after validating its manifest, header and size.

    `expect` may hold aux_layer_ids, dtype, hidden_size, target_fingerprint (and convention,
    norm); any difference raises ShardError naming the file. `verify_sha` also checks the
    file's sha256 against the manifest (reads the whole file).
    """
    path = Path(path)
    if not path.exists():
        raise ShardError(f"{path}: shard file is missing")
    manifest = _load_manifest(path)
    check_manifest(manifest, expect, str(path))
    base, header = _read_header(path)
    size = path.stat().st_size
    meta = header.pop("__metadata__", {})
    if "draftsmith_manifest" not in meta:
        raise ShardError(f"{path}: not a draftsmith shard (no draftsmith_manifest in the header)")
    end = max((e["data_offsets"][1] for e in header.values()), default=0)
    if base + end != size:
        raise ShardError(
            f"{path}: truncated or padded shard: header says {base + end} bytes, file has {size}"
        )
    if verify_sha:
        verify(path, manifest)
    want = manifest.get("tensors", {})
    if set(header) != set(want):
        raise ShardError(f"{path}: tensors {sorted(header)} differ from manifest {sorted(want)}")
    mm = np.memmap(path, dtype=np.uint8, mode="c")  # copy-on-write: writes never reach the file
    tensors = {}
    for name, e in header.items():
        if e["dtype"] not in _ST_TORCH:
            raise ShardError(f"{path}: tensor {name} has unsupported dtype {e['dtype']}")
        if [e["dtype"], e["shape"]] != [want[name]["dtype"], want[name]["shape"]]:
            raise ShardError(
                f"{path}: tensor {name} is {e['dtype']}{e['shape']} in the file but "
                f"{want[name]['dtype']}{want[name]['shape']} in the manifest"
            )
        a, b = e["data_offsets"]
        raw = torch.from_numpy(mm[base + a : base + b])
        tensors[name] = raw.view(_ST_TORCH[e["dtype"]]).view(e["shape"])
    t, h = manifest["tokens"], manifest["hidden_size"]
    if list(tensors["aux_hidden_states"].shape) != [t, 3 * h]:
        raise ShardError(f"{path}: aux_hidden_states is not [{t}, {3 * h}]")
    _check_tokens(tensors["input_ids"], tensors["loss_mask"], tensors["row_offsets"], str(path))
    if tensors["row_offsets"].numel() - 1 != manifest["rows"]:
        raise ShardError(
            f"{path}: {tensors['row_offsets'].numel() - 1} rows in the file, "
            f"{manifest['rows']} in the manifest"
        )
    return Shard(path, manifest, tensors)


def verify(path, manifest: dict | None = None) -> None:
    """Raise ShardError when the shard's sha256 differs from its manifest's."""
    path = Path(path)
    manifest = manifest if manifest is not None else _load_manifest(path)
    if "sha256" not in manifest:
        raise ShardError(f"{manifest_path(path)}: manifest has no sha256")
    have = sha256_file(path)
    if have != manifest["sha256"]:
        raise ShardError(
            f"{path}: checksum mismatch (file sha256 {have[:16]}..., manifest "
            f"{manifest['sha256'][:16]}...): the shard is corrupt"
        )


def verify_dir(directory, delete: bool = False) -> list[str]:
    """Check every `rows_*.safetensors` in `directory`; return problems (deleting bad shards)."""
    problems = []
    for path in sorted(Path(directory).glob("rows_*.safetensors")):
        try:
            open_shard(path, verify_sha=True)
        except ShardError as e:
            problems.append(str(e))
            if delete:
                path.unlink()
                manifest_path(path).unlink(missing_ok=True)
    return problems


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(
        prog="python -m draftsmith.shards", description=__doc__.split("\n")[0]
    )
    sub = ap.add_subparsers(dest="cmd", required=True)
    v = sub.add_parser("verify", help="check sha256 and structure of every shard in a directory")
    v.add_argument("directory", type=Path)
    v.add_argument(
        "--delete",
        action="store_true",
        help="delete corrupt shards (and their manifests) so the next run rebuilds them",
    )
    args = ap.parse_args(argv)
    if not args.directory.is_dir():
        raise SystemExit(f"{args.directory}: not a directory")
    n = len(list(args.directory.glob("rows_*.safetensors")))
    problems = verify_dir(args.directory, delete=args.delete)
    for p in problems:
        print(("deleted: " if args.delete else "bad: ") + p, file=sys.stderr)
    print(f"{n - len(problems)} of {n} shards in {args.directory} verified")
    if problems and not args.delete:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
