"""The hidden-state shard: one safetensors file per row range plus a JSON manifest beside it.

File layout (plain safetensors, readable by `safetensors.safe_open`): tensors in this order, each
starting on an 8-byte boundary so every view is aligned:

    input_ids          [T]      int64
    row_offsets        [R+1]    int64    row r is tokens row_offsets[r]:row_offsets[r+1]
    aux_hidden_states  [T, 3H]  storage dtype (bfloat16 | float16 | float32)
    last_hidden_states [T, H]   storage dtype, post-norm (the input of the target's lm_head)
    loss_mask          [T]      uint8

That is the reference storage mode. The compact modes (draftsmith/storage.py, manifest key
`storage`) store the aux states in float8 with `aux_scales`, and the final state only at the
trained positions or as the teacher's top-k log-probabilities; the reader serves every mode
through the same calls: `shard.aux(a, b)` (float32) and `shard.teacher(a, b)`.

All sizes are known from the token file before capture, so `ShardWriter` writes the header and
the token tensors first and then puts each batch of hidden states at its final offset
(`os.pwrite`): memory stays bounded by one batch however large the shard. The manifest
(`rows_<a>-<b>.json`) carries the row range, counts, layer ids and their convention, norm,
dtypes, target fingerprint, backend, provenance and the sha256 of the shard file; a copy without
the checksum and the volatile keys (creation time, capture seconds) sits in the safetensors
`__metadata__`, so a shard is self-describing, `open_shard` can check the `.json` against it, and
a rebuilt shard with the same tensors has the same bytes and sha256.

`verify_cached` proves a shard's sha256 once per file state (size, mtime, sha256 in a stamp), so
training checks every shard before its first use without re-reading terabytes on each rerun.

`open_shard` memory-maps the file (copy-on-write, never read into memory) and serves rows as
views. Readers check every tensor's dtype and shape against the layout the manifest's storage
mode implies, so a compact shard can never be misread as plain states.
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
from draftsmith.common import atomic_path, atomic_write_json, remove_stale_temps, sha256_file
from draftsmith.storage import (
    Storage,
    StorageError,
    StoredStates,
    check_layout,
    encode_draft_topk,
    encode_fp8,
    encode_topk,
    trained_mask,
)
from draftsmith.storage import layout as mode_layout
from draftsmith.storage import nbytes as tensor_bytes

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


def _layout(
    n_tokens: int,
    n_rows: int,
    hidden_size: int,
    dtype: str,
    storage: Storage | None = None,
    trained: int | None = None,
    vocab: int | None = None,
    draft_vocab: int | None = None,
) -> list[tuple]:
    """(name, safetensors dtype, shape, nbytes) in file order, for a storage mode.

    `trained` (the trained positions) defaults to every token, an upper bound.
    """
    storage = storage or Storage()
    p = n_tokens if trained is None else trained
    try:
        entries = mode_layout(storage, n_tokens, n_rows, hidden_size, dtype, p, vocab, draft_vocab)
    except StorageError as e:
        raise ShardError(str(e)) from None
    return [(name, tag, shape, tensor_bytes(tag, shape)) for name, tag, shape in entries]


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


def estimate_bytes(
    n_tokens: int,
    n_rows: int,
    hidden_size: int,
    dtype: str,
    storage: Storage | None = None,
    trained: int | None = None,
    vocab: int | None = None,
    draft_vocab: int | None = None,
) -> int:
    """Size of a shard file (headers of a few KiB included as a 4 KiB allowance).

    draft_vocab (top-k over the draft vocabulary) only sets the id width: None = uint16."""
    entries = _layout(n_tokens, n_rows, hidden_size, dtype, storage, trained, vocab, draft_vocab)
    return 4096 + sum(n + (-n) % 8 for *_, n in entries)


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
                     dtype="bfloat16", manifest={...}, storage=Storage(), lm_head=None,
                     draft_ids=None) as w:
        w.write(token_start, aux [n, 3H], last [n, H])   # any order, each token exactly once
    w.manifest  # the final manifest, also written to rows_<a>-<b>.json

    `storage` picks the mode (draftsmith/storage.py); the batches are the same in every mode and
    the writer encodes them (float8 with scales, trained positions only, or the teacher's top-k,
    which needs the target's `lm_head` weight [V, H]; its device is where the logits are
    computed; top-k over the draft vocabulary also needs `draft_ids` [K], the target id of each
    draft id, `d2t + arange(K)`). The file is written under a temp name, fsynced and renamed; on error nothing is
    left behind.
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
        storage: Storage | None = None,
        lm_head: torch.Tensor | None = None,
        draft_ids: torch.Tensor | None = None,
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
        self.storage = storage = storage or Storage()
        self.n_tokens = input_ids.numel()
        self.n_rows = row_offsets.numel() - 1
        trained = trained_mask(loss_mask, row_offsets)
        self._trained = trained.numpy()
        self._slot = (trained.long().cumsum(0) - 1).numpy()  # token -> row in [P, ...] tensors
        vocab = None
        if storage.final == "topk":
            if lm_head is None or lm_head.dim() != 2 or lm_head.shape[1] != self.hidden_size:
                raise ShardError(
                    f"{path}: storage final 'topk' needs the target's lm_head weight [V, "
                    f"{self.hidden_size}], got {None if lm_head is None else list(lm_head.shape)}"
                )
            vocab = lm_head.shape[0]
            self._lm_head = lm_head.detach()
        self._draft_ids = None
        if storage.draft_topk:
            if draft_ids is None or draft_ids.dim() != 1 or not draft_ids.numel():
                raise ShardError(
                    f"{path}: storage topk_vocab 'draft' needs the draft vocabulary (draft_ids, "
                    "the target id of each draft id)"
                )
            if int(draft_ids.min()) < 0 or int(draft_ids.max()) >= vocab:
                raise ShardError(f"{path}: draft_ids outside the target vocabulary [0, {vocab})")
            self._draft_ids = draft_ids.to(torch.int64)
        try:
            record = storage.record(
                dtype, self.hidden_size, vocab, int(trained.sum()), self._draft_ids
            )
        except StorageError as e:
            raise ShardError(f"{path}: {e}") from None
        self.manifest = {
            "format": FORMAT,
            **manifest,
            "rows": self.n_rows,
            "tokens": self.n_tokens,
            "hidden_size": self.hidden_size,
            "convention": CONVENTION,
            "norm": NORM,
            "dtype": dtype,
            "storage": record,
            "tensors": {},
            "draftsmith_version": __version__,
        }
        layout = _layout(
            self.n_tokens,
            self.n_rows,
            self.hidden_size,
            dtype,
            storage,
            int(trained.sum()),
            vocab,
            None if self._draft_ids is None else self._draft_ids.numel(),
        )
        self.manifest["tensors"] = {
            name: {"dtype": tag, "shape": shape} for name, tag, shape, _ in layout
        }
        self._shapes = {name: shape for name, _, shape, _ in layout}
        self._tags = {name: tag for name, tag, _, _ in layout}
        # the header copy is fixed here; keys added later (creation time, capture seconds,
        # sha256) are in the .json only, so they never change the shard's bytes
        header, offsets = _header(layout, {"draftsmith_manifest": json.dumps(self.manifest)})
        self.manifest["created"] = time.strftime("%Y-%m-%dT%H:%M:%S%z")
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
        # a killed earlier run of this range left its temp file: it is nobody's (one job per output)
        remove_stale_temps(self.path.parent, f".tmp-{self.path.name}-")
        remove_stale_temps(self.path.parent, f".tmp-{manifest_path(self.path).name}-")
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
        if n == 0:
            return
        if self.storage.aux == "dtype":
            self._put("aux_hidden_states", start, aux.detach().to("cpu", self.torch_dtype))
        else:
            try:
                q, scale = encode_fp8(aux.detach(), self.storage.block(h))
            except StorageError as e:
                raise ShardError(f"{self.path}: tokens [{start}, {start + n}): {e}") from None
            self._put("aux_hidden_states", start, q.cpu())
            self._put("aux_scales", start, scale.cpu())
        if self.storage.final == "states":
            self._put("last_hidden_states", start, last.detach().to("cpu", self.torch_dtype))
        else:
            sel = np.flatnonzero(self._trained[start : start + n])
            if sel.size:
                rows = last.detach()[torch.from_numpy(sel).to(last.device)]
                slot = int(self._slot[start + sel[0]])
                if self.storage.final == "trained":
                    self._put("last_hidden_states", slot, rows.to("cpu", self.torch_dtype))
                else:
                    head = self._lm_head
                    if head.device != rows.device or head.dtype != torch.float32:
                        self._lm_head = head = head.to(rows.device, torch.float32)
                    if self._draft_ids is None:
                        ids, logp = encode_topk(rows, head, self.storage.topk)
                    else:
                        ids, logp, ok = encode_draft_topk(
                            rows, head, self._draft_ids, self.storage.topk
                        )
                        self._put("teacher_in_vocab", slot, ok.to(torch.uint8))
                    tdt = _ST_TORCH[self._tags["teacher_topk_ids"]]
                    self._put("teacher_topk_ids", slot, ids.to(tdt))
                    self._put("teacher_topk_logprobs", slot, logp.to(torch.float16))
        self._written[start : start + n] = True

    def _put(self, name: str, first_row: int, x: torch.Tensor) -> None:
        """pwrite rows [first_row, first_row + len(x)) of tensor `name`."""
        x = x.contiguous()
        row_bytes = x[0].numel() * x.element_size() if x.dim() > 1 else x.element_size()
        self._pwrite(x.view(torch.uint8).numpy(), self._offsets[name] + first_row * row_bytes)

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


class Shard(StoredStates):
    """A memory-mapped shard. Tensors are read-only-by-convention views of the mapped file.

    The same calls serve every storage mode (draftsmith/storage.py, `StoredStates`): `aux(a, b)`
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
    _check_tokens(tensors["input_ids"], tensors["loss_mask"], tensors["row_offsets"], str(path))
    try:
        check_layout(manifest, tensors)
    except StorageError as e:
        raise ShardError(f"{path}: {e}") from None
    if tensors["row_offsets"].numel() - 1 != manifest["rows"]:
        raise ShardError(
            f"{path}: {tensors['row_offsets'].numel() - 1} rows in the file, "
            f"{manifest['rows']} in the manifest"
        )
    return Shard(path, manifest, tensors)


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


def verify_cached(path, manifest: dict, stamp_dir: Path) -> bool:
    """Prove the shard's sha256 unless a stamp shows it proven for this exact file state.

    The stamp `<stamp_dir>/<name>.json` holds the file's size, mtime (ns) and the sha256 it was
    proven against; any difference (a rewritten or rebuilt shard, a new manifest) re-reads the
    file. Returns True when the file was hashed. Raises ShardError on a mismatch.
    """
    path = Path(path)
    st = path.stat()
    state = {"sha256": manifest.get("sha256"), "size": st.st_size, "mtime_ns": st.st_mtime_ns}
    stamp = Path(stamp_dir) / f"{path.stem}.json"
    try:
        if json.loads(stamp.read_text()) == state:
            return False
    except (OSError, json.JSONDecodeError):
        pass
    verify(path, manifest)
    atomic_write_json(stamp, state)
    return True


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
        prog="python -m draftsmith.shards",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = ap.add_subparsers(dest="cmd", required=True)
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


if __name__ == "__main__":
    main()
