"""The hidden-state shard: one safetensors file per row range plus a JSON manifest beside it.

File layout (plain safetensors, readable by `safetensors.safe_open`): tensors in this order, each
starting on an 8-byte boundary so every view is aligned:

    input_ids          [T]      int64
    row_offsets        [R+1]    int64    row r is tokens row_offsets[r]:row_offsets[r+1]
    aux_hidden_states  [T, 3H]  storage dtype (bfloat16 | float16 | float32)
    last_hidden_states [T, H]   storage dtype, post-norm (the input of the target's lm_head)
    loss_mask          [T]      uint8

That is the reference storage mode. The compact modes (draftsmith/hidden/storage.py, manifest key
`storage`) store the aux states in float8 with `aux_scales`, and the final state only at the
trained positions or as the teacher's top-k log-probabilities; the reader serves every mode
through the same calls: `shard.aux(a, b)` (float32) and `shard.teacher(a, b)`.

The writer (`ShardWriter`, `estimate_bytes`) is `draftsmith.hidden.writer`; this module is the
format's constants, the reader and the verifier. The manifest (`rows_<a>-<b>.json`) carries the row range, counts, layer ids and their convention, norm,
dtypes, target fingerprint, backend, provenance and the sha256 of the shard file; a copy without
the checksum and the volatile keys (creation time, capture seconds) sits in the safetensors
`__metadata__`, so a shard is self-describing, `open_shard` can check the `.json` against it, and
a rebuilt shard with the same tensors has the same bytes and sha256.

`verify_read` is training's check: the crc32 of the bytes of the shard's own memory map (the
bytes training then reads, from the page cache) against the manifest's `crc32`, at every start
of a run; about 3.5 GB/s on one core, where sha256 runs at 1.5 and blake2b at 0.7. A manifest
written before `crc32` existed falls back to the full sha256. Neither trusts size or mtime: a
flipped byte with its mtime put back is found.

`open_shard` memory-maps the file (copy-on-write, never read into memory) and serves rows as
views. Readers check every tensor's dtype and shape against the layout the manifest's storage
mode implies, so a compact shard can never be misread as plain states.
"""

from __future__ import annotations

import json
import os
import struct
import sys
from pathlib import Path

import numpy as np
import torch

from draftsmith.hidden.storage import StorageError, StoredStates, check_layout
from draftsmith.runtime.files import crc32_buffer, sha256_file, subcommand_parser

CONVENTION = "sglang:output_of_layer"
NORM = "post"
FORMAT = "draftsmith-hidden-v1"
# storage dtype name -> (torch dtype, safetensors dtype tag)
STORAGE_DTYPES = {
    "bfloat16": (torch.bfloat16, "BF16"),
    "float16": (torch.float16, "F16"),
    "float32": (torch.float32, "F32"),
}
ST_TORCH = {
    "I64": torch.int64,
    "I32": torch.int32,
    "U16": torch.uint16,
    "U8": torch.uint8,
    "F8_E4M3": torch.float8_e4m3fn,
    **{tag: dt for dt, tag in STORAGE_DTYPES.values()},
}
# manifest keys `expect` may check, compared for equality
EXPECT_KEYS = ("aux_layer_ids", "convention", "norm", "dtype", "hidden_size", "target_fingerprint")


class ShardError(ValueError):
    """A shard or its manifest is missing, truncated, corrupt or not what the caller expects."""


def manifest_path(shard_path: str | os.PathLike) -> Path:
    return Path(shard_path).with_suffix(".json")


def check_tokens(input_ids, loss_mask, row_offsets, where: str) -> None:
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


class Shard(StoredStates):
    """A memory-mapped shard. Tensors are read-only-by-convention views of the mapped file.

    The same calls serve every storage mode (draftsmith/hidden/storage.py, `StoredStates`): `aux(a, b)`
    gives the aux states of tokens [a, b) in float32 (dequantized in float8 mode), `teacher(a, b)`
    what the teacher is computed from, `trained` the positions that have one. The raw stored
    tensors stay available as attributes (`aux_hidden_states`, `aux_scales`,
    `last_hidden_states`, `teacher_topk_ids`, `teacher_topk_logprobs`; None where the mode does
    not store them).
    """

    def __init__(self, path: Path, manifest: dict, tensors: dict[str, torch.Tensor]):
        super().__init__(manifest, tensors)
        self.path = path
        self._offsets = self.row_offsets.tolist()
        self.mapped = None  # the file's memory map (open_shard): what verify_read hashes

    def __len__(self) -> int:
        return len(self._offsets) - 1

    def row(self, i: int) -> dict[str, torch.Tensor]:
        """Row i's tokens, mask and states: views of the map in the reference mode.

        Keys input_ids, loss_mask, aux_hidden_states (float32 when stored in float8), plus
        last_hidden_states (states, trained) or teacher_topk_ids / teacher_topk_logprobs (topk),
        as `teacher` gives them.
        """
        if not 0 <= i < len(self):
            raise IndexError(f"{self.path}: row {i} outside [0, {len(self)})")
        a, b = self._offsets[i], self._offsets[i + 1]
        names = {"last": "last_hidden_states", "topk_ids": "teacher_topk_ids"}
        names["draft_topk_ids"] = "teacher_topk_ids"
        names["topk_logprobs"] = "teacher_topk_logprobs"
        return {
            "input_ids": self.input_ids[a:b],
            "loss_mask": self.loss_mask[a:b],
            "aux_hidden_states": (
                self.aux_hidden_states[a:b] if self.aux_scales is None else self.aux(a, b)
            ),
            **{names[k]: v for k, v in self.teacher(a, b).items()},
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
    check_embedded_manifest(path, manifest, meta["draftsmith_manifest"])
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
        if e["dtype"] not in ST_TORCH:
            raise ShardError(f"{path}: tensor {name} has unsupported dtype {e['dtype']}")
        if [e["dtype"], e["shape"]] != [want[name]["dtype"], want[name]["shape"]]:
            raise ShardError(
                f"{path}: tensor {name} is {e['dtype']}{e['shape']} in the file but "
                f"{want[name]['dtype']}{want[name]['shape']} in the manifest"
            )
        a, b = e["data_offsets"]
        raw = torch.from_numpy(mm[base + a : base + b])
        tensors[name] = raw.view(ST_TORCH[e["dtype"]]).view(e["shape"])
    check_tokens(tensors["input_ids"], tensors["loss_mask"], tensors["row_offsets"], str(path))
    try:
        check_layout(manifest, tensors)
    except StorageError as e:
        raise ShardError(f"{path}: {e}") from None
    if tensors["row_offsets"].numel() - 1 != manifest["rows"]:
        raise ShardError(
            f"{path}: {tensors['row_offsets'].numel() - 1} rows in the file, "
            f"{manifest['rows']} in the manifest"
        )
    shard = Shard(path, manifest, tensors)
    shard.mapped = mm
    return shard


def check_embedded_manifest(path: Path, manifest: dict, embedded: str) -> None:
    """The `.json` manifest must agree with the copy in the shard's header on every key the copy
    has (the .json adds only sha256, creation time and capture statistics)."""
    try:
        inside = json.loads(embedded)
    except json.JSONDecodeError as e:
        raise ShardError(f"{path}: corrupt manifest copy in the header ({e})") from None
    differ = sorted(k for k, v in inside.items() if manifest.get(k) != v)
    if differ:
        k = differ[0]
        raise ShardError(
            f"{manifest_path(path)}: manifest differs from the copy inside {path.name} on "
            f"{differ} (e.g. {k}: {manifest.get(k)!r} in the .json, {inside[k]!r} in the shard)"
        )


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


def verify_read(shard: Shard) -> str:
    """Check the bytes training reads against the manifest: the crc32 of the shard's memory map
    (every byte of the file, through the map its tensors are views of); a manifest without
    `crc32` (written before it existed) gets the full sha256 instead. Returns the check made
    ("crc32" or "sha256"); raises ShardError naming the file on a mismatch."""
    want = shard.manifest.get("crc32")
    if want is None:
        verify(shard.path, shard.manifest)
        return "sha256"
    mm = shard.mapped
    if mm is None:
        mm = np.memmap(shard.path, dtype=np.uint8, mode="r")
    have = crc32_buffer(mm)
    if have != want:
        raise ShardError(
            f"{shard.path}: checksum mismatch (crc32 of the bytes read {have}, manifest "
            f"{manifest_path(shard.path).name} {want}): the shard is corrupt"
        )
    return "crc32"


def verify_dir(directory, delete: bool = False) -> list[str]:
    """Check every `rows_*.safetensors` in `directory`: structure, sha256 and finiteness (a NaN
    or inf state, which capture never writes); return problems (deleting bad shards)."""
    from draftsmith.runtime.finite import nonfinite_tensors

    problems = []
    for path in sorted(Path(directory).glob("rows_*.safetensors")):
        try:
            open_shard(path, verify_sha=True)
            bad = nonfinite_tensors(path)
            if bad:
                raise ShardError(f"{path}: non-finite values: " + "; ".join(bad))
        except ShardError as e:
            problems.append(str(e))
            if delete:
                path.unlink()
                manifest_path(path).unlink(missing_ok=True)
    return problems


def main(argv: list[str] | None = None) -> None:
    ap, sub = subcommand_parser("shards", __doc__)
    v = sub.add_parser("verify", help="check sha256 and structure of every shard in a directory")
    v.add_argument("directory", type=Path)
    v.add_argument(
        "--delete",
        action="store_true",
        help="delete corrupt shards (and their manifests) so the next run rebuilds them; the "
        "exit status is 1 whenever a shard was bad, deleted or not",
    )
    args = ap.parse_args(argv)
    if not args.directory.is_dir():
        raise SystemExit(f"{args.directory}: not a directory")
    n = len(list(args.directory.glob("rows_*.safetensors")))
    problems = verify_dir(args.directory, delete=args.delete)
    for p in problems:
        print(("deleted: " if args.delete else "bad: ") + p, file=sys.stderr)
    print(f"{n - len(problems)} of {n} shards in {args.directory} verified")
    if problems:  # also after --delete: the directory was not sound, and scripts must know
        hint = "run snakemake to rebuild them" if args.delete else "rerun with --delete"
        raise SystemExit(f"{len(problems)} bad shard(s): {hint}")
