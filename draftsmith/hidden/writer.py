"""The shard writer: the hidden-state shard format of `draftsmith.hidden.shards`, written in one pass.

All sizes are known from the token file before capture, so `ShardWriter` writes the header and
the token tensors first and then puts each batch of hidden states at its final offset
(`os.pwrite`): memory stays bounded by one batch however large the shard. On success it writes
the manifest (with the file's sha256 and crc32, computed in one read) beside the shard; its copy without the checksum and the
volatile keys goes into the safetensors `__metadata__`. `estimate_bytes` is the size of a shard
before it exists (the storage mode's layout, `draftsmith/hidden/storage.py`).

The reader and verifier (`open_shard`, `verify`, `python -m draftsmith shards verify`) are in
`draftsmith.hidden.shards`.
"""

from __future__ import annotations

import json
import os
import struct
import time
from pathlib import Path

import numpy as np
import torch

from draftsmith import __version__
from draftsmith.hidden.shards import (
    CONVENTION,
    FORMAT,
    NORM,
    ST_TORCH,
    STORAGE_DTYPES,
    ShardError,
    check_tokens,
    manifest_path,
)
from draftsmith.hidden.storage import (
    Storage,
    StorageError,
    aux_count,
    encode_draft_topk,
    encode_fp8,
    encode_topk,
    trained_mask,
)
from draftsmith.hidden.storage import layout as mode_layout
from draftsmith.hidden.storage import nbytes as tensor_bytes
from draftsmith.runtime.files import (
    atomic_path,
    atomic_write_json,
    file_digests,
    remove_stale_temps,
)


def shard_layout(
    n_tokens: int,
    n_rows: int,
    hidden_size: int,
    dtype: str,
    storage: Storage | None = None,
    trained: int | None = None,
    vocab: int | None = None,
    draft_vocab: int | None = None,
    n_aux: int = 3,
) -> list[tuple]:
    """(name, safetensors dtype, shape, nbytes) in file order, for a storage mode.

    `trained` (the trained positions) defaults to every token, an upper bound.
    """
    storage = storage or Storage()
    p = n_tokens if trained is None else trained
    try:
        entries = mode_layout(
            storage, n_tokens, n_rows, hidden_size, dtype, p, vocab, draft_vocab, n_aux
        )
    except StorageError as e:
        raise ShardError(str(e)) from None
    return [(name, tag, shape, tensor_bytes(tag, shape)) for name, tag, shape in entries]


def shard_header(layout: list[tuple], metadata: dict) -> tuple[bytes, dict]:
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
    n_aux: int = 3,
) -> int:
    """Size of a shard file (headers of a few KiB included as a 4 KiB allowance).

    draft_vocab (top-k over the draft vocabulary) only sets the id width: None = uint16."""
    entries = shard_layout(
        n_tokens, n_rows, hidden_size, dtype, storage, trained, vocab, draft_vocab, n_aux
    )
    return 4096 + sum(n + (-n) % 8 for *_, n in entries)


def _topk_inputs(path, storage: Storage, hidden: int, lm_head, draft_ids):
    """(target vocabulary size, lm_head, draft ids) for a storage that keeps top-k logits;
    (None, None, None) for one that does not. Refuses missing or misshaped inputs."""
    vocab = head = ids = None
    if storage.final == "topk":
        if lm_head is None or lm_head.dim() != 2 or lm_head.shape[1] != hidden:
            raise ShardError(
                f"{path}: storage final 'topk' needs the target's lm_head weight [V, "
                f"{hidden}], got {None if lm_head is None else list(lm_head.shape)}"
            )
        vocab, head = lm_head.shape[0], lm_head.detach()
    if storage.draft_topk:
        if draft_ids is None or draft_ids.dim() != 1 or not draft_ids.numel():
            raise ShardError(
                f"{path}: storage topk_vocab 'draft' needs the draft vocabulary (draft_ids, "
                "the target id of each draft id)"
            )
        if int(draft_ids.min()) < 0 or int(draft_ids.max()) >= vocab:
            raise ShardError(f"{path}: draft_ids outside the target vocabulary [0, {vocab})")
        ids = draft_ids.to(torch.int64)
    return vocab, head, ids


class ShardWriter:
    """Streaming writer: header and token tensors first, then hidden states batch by batch.

    with ShardWriter(path, input_ids=..., loss_mask=..., row_offsets=..., hidden_size=H,
                     dtype="bfloat16", manifest={...}, storage=Storage(), lm_head=None,
                     draft_ids=None) as w:
        w.write(token_start, aux [n, K*H], last [n, H])  # any order, each token exactly once
    w.manifest  # the final manifest, also written to rows_<a>-<b>.json

    `storage` picks the mode (draftsmith/hidden/storage.py); the batches are the same in every mode and
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
        check_tokens(input_ids, loss_mask, row_offsets, str(path))
        self.path = Path(path)
        self.hidden_size = int(hidden_size)
        self.dtype = dtype
        self.torch_dtype = STORAGE_DTYPES[dtype][0]
        self.storage = storage = storage or Storage()
        self.n_tokens = input_ids.numel()
        self.n_rows = row_offsets.numel() - 1
        self.n_aux = aux_count(manifest)  # one aux state per manifest aux_layer_ids entry
        self._row_offsets = row_offsets.numpy().copy()
        self._aux_ids = list(manifest.get("aux_layer_ids") or range(self.n_aux))
        trained = trained_mask(loss_mask, row_offsets)
        self._trained = trained.numpy()
        self._slot = (trained.long().cumsum(0) - 1).numpy()  # token -> row in [P, ...] tensors
        vocab, self._lm_head, self._draft_ids = _topk_inputs(
            path, storage, self.hidden_size, lm_head, draft_ids
        )
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
        layout = shard_layout(
            self.n_tokens,
            self.n_rows,
            self.hidden_size,
            dtype,
            storage,
            int(trained.sum()),
            vocab,
            None if self._draft_ids is None else self._draft_ids.numel(),
            self.n_aux,
        )
        self._fix_layout(layout)
        self._written = np.zeros(self.n_tokens, dtype=bool)
        self._inputs = {
            "input_ids": input_ids.to(torch.int64).contiguous(),
            "row_offsets": row_offsets.to(torch.int64).contiguous(),
            "loss_mask": loss_mask.to(torch.uint8).contiguous(),
        }
        self._ctx = None
        self._fd = None

    def _fix_layout(self, layout) -> None:
        """The manifest's tensor table, the header and each tensor's byte offset, from `layout`."""
        self.manifest["tensors"] = {
            name: {"dtype": tag, "shape": shape} for name, tag, shape, _ in layout
        }
        self._shapes = {name: shape for name, _, shape, _ in layout}
        self._tags = {name: tag for name, tag, _, _ in layout}
        # the header copy is fixed here; keys added later (creation time, capture seconds,
        # sha256, crc32) are in the .json only, so they never change the shard's bytes
        header, offsets = shard_header(layout, {"draftsmith_manifest": json.dumps(self.manifest)})
        self.manifest["created"] = time.strftime("%Y-%m-%dT%H:%M:%S%z")
        self._base = len(header)
        self._offsets = offsets
        self._total = self._base + offsets["loss_mask"] + self.n_tokens
        self._header = header

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

    def refuse_nonfinite(self, start: int, aux: torch.Tensor, last: torch.Tensor) -> None:
        """A NaN or infinite state is never stored: the error names the row, the token and
        the layer (aux: the layer id; final: the final state), as the target computed them."""
        for what, x in (("aux", aux), ("final", last)):
            bad = ~torch.isfinite(x)
            if not bool(bad.any()):
                continue
            tok, col = (int(i) for i in bad.nonzero()[0])
            row = int(np.searchsorted(self._row_offsets, start + tok, side="right")) - 1
            where = (
                f"aux layer {self._aux_ids[col // self.hidden_size]}"
                if what == "aux"
                else "the final state"
            )
            raise ShardError(
                f"{self.path}: row {row} (token {start + tok - int(self._row_offsets[row])}): "
                f"{int(bad.sum())} non-finite values in {n_of(bad)} tokens, first at {where}: "
                "the target computes NaN or inf here (check its weights: rule target_model "
                "refuses non-finite ones, a wrong dtype can overflow)"
            )

    def write(self, start: int, aux: torch.Tensor, last: torch.Tensor) -> None:
        """Store hidden states of tokens [start, start + n): aux [n, K*H] (K = n_aux), last
        [n, H]."""
        n, h, k = last.shape[0], self.hidden_size, self.n_aux
        if tuple(aux.shape) != (n, k * h) or tuple(last.shape) != (n, h):
            raise ShardError(
                f"{self.path}: batch shapes aux {list(aux.shape)} last "
                f"{list(last.shape)} do not match [n, {k * h}] ({k} aux layers) and [n, {h}]"
            )
        if start < 0 or start + n > self.n_tokens:
            raise ShardError(
                f"{self.path}: tokens [{start}, {start + n}) outside [0, {self.n_tokens})"
            )
        if self._written[start : start + n].any():
            raise ShardError(f"{self.path}: tokens [{start}, {start + n}) written twice")
        if n == 0:
            return
        self.refuse_nonfinite(start, aux, last)
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
                    tdt = ST_TORCH[self._tags["teacher_topk_ids"]]
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
            self.manifest["sha256"], self.manifest["crc32"] = file_digests(self._tmp)
        except BaseException as e:
            self._ctx.__exit__(type(e), e, e.__traceback__)
            raise
        self._ctx.__exit__(None, None, None)
        atomic_write_json(manifest_path(self.path), self.manifest)
        return False


def n_of(bad: torch.Tensor) -> int:
    """Tokens with any non-finite value ([n, width] mask)."""
    return int(bad.any(dim=1).sum())
