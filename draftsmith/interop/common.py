"""What the converters share (`draftsmith.interop.convert`: SpecForge and recode, and
`draftsmith.interop.speculators`), below both: the error type, legacy sample loading, the target's
final norm and lm_head, per-sample checks, the two-pass shard writer, the converted shard's
manifest and the `draftsmith.json` sidecar written beside exported samples.
"""

from __future__ import annotations

import gzip
import io
import json
import pickle
import re
from pathlib import Path

import torch
from tqdm import tqdm

from draftsmith.config.checks import aux_layer_ids
from draftsmith.hidden.shards import CONVENTION, STORAGE_DTYPES, open_shard
from draftsmith.hidden.storage import Storage
from draftsmith.hidden.writer import ShardWriter
from draftsmith.runtime.files import atomic_path, atomic_write_json, versions
from draftsmith.targets.families import effective_norm_weight

SIDECAR = "draftsmith.json"


class ConvertError(ValueError):
    """A legacy file or directory the converter cannot use; the message names it."""


def load_legacy(path: Path) -> dict:
    """torch.load(weights_only=True) (mmap unless gzipped); refuse arbitrary unpickling."""
    if not path.is_file():
        raise ConvertError(f"{path}: missing sample file")
    try:
        if path.name.endswith(".gz"):
            with gzip.open(path, "rb") as f:
                obj = torch.load(io.BytesIO(f.read()), map_location="cpu", weights_only=True)
        else:
            obj = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except pickle.UnpicklingError as e:
        m = re.search(r"Unsupported global: GLOBAL (\S+)", str(e))
        what = f"it references {m.group(1)}" if m else str(e).splitlines()[0]
        raise ConvertError(
            f"{path}: refused: {what}, which torch.load(weights_only=True) does not allow "
            "(draftsmith never unpickles arbitrary objects)"
        ) from None
    except (RuntimeError, EOFError, OSError, gzip.BadGzipFile) as e:
        raise ConvertError(f"{path}: unreadable legacy file ({str(e).splitlines()[0]})") from None
    if not isinstance(obj, dict):
        raise ConvertError(f"{path}: expected a dict of tensors, got {type(obj).__name__}")
    return obj


def final_norm(target_dir: Path) -> tuple[torch.Tensor, float]:
    """The target's final RMSNorm as a plain `x * w` weight (float32) and its eps, read from its
    safetensors files: `1 + w` for a Gemma-style target (`draftsmith.targets.families`)."""
    from safetensors import safe_open

    from draftsmith.targets.model import target_config

    config = target_config(target_dir)
    eps = float(config.get("rms_norm_eps", 1e-6))
    found = []
    for f in sorted(Path(target_dir).glob("*.safetensors")):
        with safe_open(str(f), "pt") as st:
            found += [(f, k) for k in st.keys() if re.fullmatch(r"(.*\.)?model\.norm\.weight", k)]
    if len(found) != 1:
        raise ConvertError(
            f"{target_dir}: expected one final norm weight (*model.norm.weight), "
            f"found {[k for _, k in found]}"
        )
    f, key = found[0]
    with safe_open(str(f), "pt") as st:
        return effective_norm_weight(st.get_tensor(key), config), eps


def lm_head_weight(target_dir: Path) -> torch.Tensor:
    """The target's lm_head weight [V, H] (the input embedding when the two are tied)."""
    from safetensors import safe_open

    from draftsmith.targets.model import target_config

    tied = bool(target_config(target_dir).get("tie_word_embeddings", False))
    found = {}
    for f in sorted(Path(target_dir).glob("*.safetensors")):
        with safe_open(str(f), "pt") as st:
            for k in st.keys():
                m = re.fullmatch(r"(.*\.)?(lm_head|embed_tokens)\.weight", k)
                if m and "layers." not in k:
                    found.setdefault(m.group(2), (f, k))
    name = "lm_head" if "lm_head" in found else "embed_tokens" if tied else None
    if name not in found:
        raise ConvertError(f"{target_dir}: no lm_head.weight (and the embeddings are not tied)")
    f, key = found[name]
    with safe_open(str(f), "pt") as st:
        return st.get_tensor(key)


def open_full(shard_path: Path, fmt: str):
    """Open a shard to export: `fmt` needs every token's final state (other modes refused)."""
    shard = open_shard(shard_path)
    if shard.storage.final != "states":
        mode = shard.storage.name(shard.manifest["dtype"])
        raise ConvertError(
            f"{shard_path}: storage mode {mode!r} keeps the final state only at trained positions"
            f" or as top-k log-probabilities; {fmt} needs it at every token: recapture with "
            "capture.storage.final: states"
        )
    return shard


def apply_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm in float32 (as transformers computes it) with a plain weight (`final_norm`'s)."""
    x = x.float()
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def remove_norm(h: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """A pre-norm state whose RMSNorm is h (up to eps): h / weight, unit RMS."""
    if bool((weight == 0).any()):
        raise ConvertError("the target's final norm weight has zeros: the norm cannot be removed")
    return h.float() / weight


def flat_tokens(t: torch.Tensor, name: str, path: Path) -> torch.Tensor:
    if t.dim() == 2 and t.shape[0] == 1:
        t = t[0]
    if t.dim() != 1:
        raise ConvertError(f"{path}: {name} has shape {list(t.shape)}, expected [S] or [1, S]")
    return t


def ids_from(src: Path, given: str | None, n_layers: int) -> tuple[list[int], str]:
    sidecar = src / SIDECAR
    if given:
        ids = [int(x) for x in given.split(",")]
        how = "--aux-layer-ids (SGLang output-of-layer numbering)"
    elif sidecar.is_file():
        meta = json.loads(sidecar.read_text())
        if meta.get("convention") != CONVENTION:
            raise ConvertError(
                f"{sidecar}: convention {meta.get('convention')!r}, expected {CONVENTION!r}"
            )
        ids, how = meta["aux_layer_ids"], f"{sidecar}"
    else:
        raise ConvertError(
            f"{src}: no {SIDECAR} records the layer ids; pass --aux-layer-ids a,b,c in SGLang's "
            "output-of-layer numbering (speculators/vLLM ids are HF indices: subtract 1)"
        )
    return aux_layer_ids(ids, n_layers), how


def write_shard(
    out: Path,
    files: list,
    read,
    dtype: str | None,
    manifest: dict,
    storage: Storage | None = None,
    target: Path | None = None,
) -> dict:
    """Two passes over mmap-loaded samples: tokens first (for the header), then the states.

    `storage` is the output's storage mode; a top-k mode reads the lm_head of `target`."""
    storage = storage or Storage()
    if storage.draft_topk:
        raise ConvertError(
            "topk_vocab draft depends on the draft vocabulary: convert to states or trained, "
            "then `python -m draftsmith convert recode --vocab results/vocab/vocab.safetensors`"
        )
    lm_head = lm_head_weight(target) if storage.final == "topk" else None
    ids, masks, lengths, hidden, src_dtype = [], [], [], None, None
    for f in tqdm(files, desc="tokens", unit="file"):
        s = read(f, states=False)
        ids.append(s["input_ids"])
        masks.append(s["loss_mask"])
        lengths.append(s["input_ids"].numel())
        hidden, src_dtype = s["hidden_size"], s["dtype"]
    dtype = dtype or str(src_dtype).removeprefix("torch.")
    if dtype not in STORAGE_DTYPES:
        raise ConvertError(
            f"storage dtype {dtype!r} is not one of {list(STORAGE_DTYPES)}; pass --dtype"
        )
    offsets = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    with ShardWriter(
        out,
        input_ids=torch.cat(ids),
        loss_mask=torch.cat(masks),
        row_offsets=offsets,
        hidden_size=hidden,
        dtype=dtype,
        manifest=manifest,
        storage=storage,
        lm_head=lm_head,
    ) as w:
        for r, f in enumerate(tqdm(files, desc="states", unit="file")):
            s = read(f, states=True)
            w.write(int(offsets[r]), s["aux"], s["last"])
    return w.manifest


def check_sample(path, input_ids, loss_mask, states: list[torch.Tensor]) -> tuple:
    input_ids = flat_tokens(input_ids, "input_ids", path).long()
    loss_mask = flat_tokens(loss_mask, "loss_mask", path)
    n = input_ids.numel()
    if loss_mask.numel() < n:
        raise ConvertError(f"{path}: loss_mask has {loss_mask.numel()} entries for {n} tokens")
    loss_mask = loss_mask[:n].to(torch.uint8)  # longer masks occur in speculators data: truncate
    if bool((loss_mask > 1).any()):
        raise ConvertError(f"{path}: loss_mask has values other than 0 and 1")
    for s in states:
        if s.shape[0] != n:
            raise ConvertError(f"{path}: hidden states have {s.shape[0]} positions for {n} tokens")
    return input_ids, loss_mask


def converted_manifest(rows, ids, target, n_layers, src, how, fmt, norm) -> dict:
    """Manifest fields of a shard converted from a legacy format, recording what was assumed."""
    from draftsmith.targets.model import fingerprint

    return {
        "row_range": list(rows),
        "aux_layer_ids": ids,
        "target_fingerprint": fingerprint(target),
        "target_layers": n_layers,
        "backend": "convert",
        "converted_from": {
            "format": fmt,
            "source": str(src),
            "aux_layer_ids_from": how,
            "final_norm": norm,
        },
        "versions": versions(),
    }


def save_sample(obj: dict, path: Path) -> None:
    with atomic_path(path) as tmp:
        torch.save(obj, tmp)


def write_sidecar(out: Path, shard, fmt: str, last: str) -> None:
    m = shard.manifest
    atomic_write_json(
        out / SIDECAR,
        {
            "format": fmt,
            "aux_layer_ids": m["aux_layer_ids"],
            "convention": CONVENTION,
            "vllm_layer_ids": [i + 1 for i in m["aux_layer_ids"]],
            "row_range": m["row_range"],
            "target_layers": m.get("target_layers"),
            "final_state": last,
            "target_fingerprint": m.get("target_fingerprint"),
            "source_shard": str(shard.path),
            "versions": versions(),
        },
    )
