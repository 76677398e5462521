"""Converters between our shards and the offline formats of speculators and SpecForge.

    python -m draftsmith.convert to-speculators   --shard S --target T --out DIR [--layout arrow|pt]
    python -m draftsmith.convert from-speculators --src DIR --target T --out results/hidden/rows_<a>-<b>.safetensors
    python -m draftsmith.convert to-specforge     --shard S --out DIR
    python -m draftsmith.convert from-specforge   --src DIR --target T --out results/hidden/rows_<a>-<b>.safetensors
    python -m draftsmith.convert recode --shard S --storage JSON [--target T --device cuda] [--vocab V] --out O

speculators (both generations): `draftsmith.convert_speculators`. SpecForge: `input_ids`,
`loss_mask`, `hidden_state [1, S, H]` post-norm, `aux_hidden_state [1, S, 3H]` in one torch.save
file per sample, `.ckpt` or gzipped `.ckpt.gz`, anywhere below the directory (SpecForge's own
readers walk the tree). `to-specforge` writes `rows_<g>-<g+2000>/data_<i>.ckpt` (i = global
row); `from-specforge` maps rows to files by that index when every file is named `data_<i>`,
otherwise in SpecForge's reader order (sorted paths).

Legacy files are read with `torch.load(weights_only=True)` only; a file that needs more is
refused. Every converted shard's manifest says what was assumed (`converted_from`: format,
layer numbering, where the SGLang-numbered ids came from, what was done to the final state,
how samples map to rows); `to-*` writes `draftsmith.json` beside the samples with the ids.

Storage modes (draftsmith/storage.py): `from-*` write any mode (`--storage '{"aux":
"float8_e4m3", "final": "topk"}'`, the `capture.storage` section as JSON; top-k needs the
target's lm_head, read from --target). `to-*` read any mode whose final state is stored at every
token (float8 aux states are dequantized to the shard's dtype); a shard that keeps the final
state only at trained positions or as top-k log-probabilities cannot give the per-token final
states both formats require, and is refused with that reason. `recode` rewrites a shard in
another mode (e.g. one captured with `final: trained` into float8 + top-k, on a GPU).
"""

from __future__ import annotations

import argparse
import gzip
import io
import json
import os
import pickle
import re
from pathlib import Path

import torch
from tqdm import tqdm

from draftsmith.common import atomic_path, atomic_write_json, versions
from draftsmith.config import aux_layer_ids, parse_range
from draftsmith.shards import CONVENTION, STORAGE_DTYPES, ShardError, ShardWriter, open_shard
from draftsmith.storage import Storage, StorageError

SIDECAR = "draftsmith.json"
SPECFORGE_GROUP = 2000


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
    """The target's final RMSNorm weight (float32) and eps, read from its safetensors files."""
    from safetensors import safe_open

    from draftsmith.target import target_config

    eps = float(target_config(target_dir).get("rms_norm_eps", 1e-6))
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
        return st.get_tensor(key).float(), eps


def lm_head_weight(target_dir: Path) -> torch.Tensor:
    """The target's lm_head weight [V, H] (the input embedding when the two are tied)."""
    from safetensors import safe_open

    from draftsmith.target import target_config

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
    """Llama/DeepSeek RMSNorm in float32 (as transformers computes it)."""
    x = x.float()
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def remove_norm(h: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """A pre-norm state whose RMSNorm is h (up to eps): h / weight, unit RMS."""
    if bool((weight == 0).any()):
        raise ConvertError("the target's final norm weight has zeros: the norm cannot be removed")
    return h.float() / weight


def _flat(t: torch.Tensor, name: str, path: Path) -> torch.Tensor:
    if t.dim() == 2 and t.shape[0] == 1:
        t = t[0]
    if t.dim() != 1:
        raise ConvertError(f"{path}: {name} has shape {list(t.shape)}, expected [S] or [1, S]")
    return t


def _ids_from(src: Path, given: str | None, n_layers: int) -> tuple[list[int], str]:
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


def _write_shard(
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
            "then `python -m draftsmith.convert recode --vocab results/vocab/vocab.safetensors`"
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


def _check_sample(path, input_ids, loss_mask, states: list[torch.Tensor]) -> tuple:
    input_ids = _flat(input_ids, "input_ids", path).long()
    loss_mask = _flat(loss_mask, "loss_mask", path)
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


def _converted_manifest(rows, ids, target, n_layers, src, how, fmt, norm) -> dict:
    """Manifest fields of a shard converted from a legacy format, recording what was assumed."""
    from draftsmith.target import fingerprint

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


def specforge_path(src: Path, i: int, group: int) -> Path:
    g = (i // group) * group
    return src / f"rows_{g}-{g + group}" / f"data_{i}.ckpt"


SPECFORGE_SUFFIXES = (".ckpt", ".ckpt.gz")
SPECFORGE_INDEXED = re.compile(r"^data_(\d+)\.ckpt(\.gz)?$")


def specforge_files(src: Path, a: int, b: int) -> tuple[list[Path], str]:
    """The sample files of rows a..b-1 and how they were matched to rows.

    SpecForge's readers take every `*.ckpt` / `*.ckpt.gz` below `src` in sorted-path order;
    `prepare_hidden_states.py` (and `to-specforge`) name them `data_<i>` by sample index."""
    found = sorted(
        Path(root) / n
        for root, _dirs, names in os.walk(src)
        for n in names
        if n.endswith(SPECFORGE_SUFFIXES)
    )
    if not found:
        raise ConvertError(f"{src}: no SpecForge sample files (*.ckpt, *.ckpt.gz) below it")
    indexed = {}
    for f in found:
        m = SPECFORGE_INDEXED.match(f.name)
        if not m:
            break
        if int(m.group(1)) in indexed:
            raise ConvertError(f"{src}: sample {m.group(1)} twice: {indexed[int(m.group(1))]}, {f}")
        indexed[int(m.group(1))] = f
    else:
        missing = [i for i in range(a, b) if i not in indexed]
        if missing:
            raise ConvertError(
                f"{specforge_path(src, missing[0], SPECFORGE_GROUP)}: missing sample file "
                f"(no data_{missing[0]}.ckpt[.gz] below {src})"
            )
        return [indexed[i] for i in range(a, b)], "data_<i>.ckpt[.gz], i = global row"
    if b > len(found):
        raise ConvertError(
            f"{src}: rows {a}..{b - 1} need {b} sample files in SpecForge's order, found {len(found)}"
        )
    return found[a:b], "row r = r-th file in sorted path order (SpecForge's reader order)"


def from_specforge(src: Path, target: Path, out: Path, ids_arg, dtype, storage=None) -> dict:
    from draftsmith.target import target_config

    a, b = parse_range(out.stem)
    n_layers = int(target_config(target)["num_hidden_layers"])
    ids, how = _ids_from(src, ids_arg, n_layers)

    def read(f: Path, states: bool) -> dict:
        d = load_legacy(f)
        for k in ("input_ids", "loss_mask", "hidden_state", "aux_hidden_state"):
            if k not in d:
                raise ConvertError(f"{f}: SpecForge sample lacks {k!r} (keys {sorted(d)})")
        aux, last = d["aux_hidden_state"], d["hidden_state"]
        if aux.dim() != 3 or last.dim() != 3 or aux.shape[0] != 1 or last.shape[0] != 1:
            raise ConvertError(
                f"{f}: expected hidden_state [1,S,H] and aux_hidden_state [1,S,3H], "
                f"got {list(last.shape)} and {list(aux.shape)}"
            )
        if aux.shape[-1] != 3 * last.shape[-1]:
            raise ConvertError(
                f"{f}: aux_hidden_state width {aux.shape[-1]} != 3 x {last.shape[-1]}"
            )
        input_ids, loss_mask = _check_sample(f, d["input_ids"], d["loss_mask"], [aux[0], last[0]])
        s = {
            "input_ids": input_ids,
            "loss_mask": loss_mask,
            "hidden_size": last.shape[-1],
            "dtype": last.dtype,
        }
        if states:
            s["aux"], s["last"] = aux[0], last[0]
        return s

    files, index = specforge_files(src, a, b)
    manifest = _converted_manifest(
        (a, b),
        ids,
        target,
        n_layers,
        src,
        how,
        "specforge",
        "none: the source stores the final state post-norm (SGLang's LogitsProcessor input)",
    )
    manifest["converted_from"]["layer_numbering"] = (
        "source and shard: SGLang output-of-layer ids (SpecForge captures through SGLang)"
    )
    manifest["converted_from"]["sample_index"] = index
    manifest["converted_from"]["files"] = [str(files[0]), str(files[-1])]
    return _write_shard(out, files, read, dtype, manifest, storage, target)


def _save(obj: dict, path: Path) -> None:
    with atomic_path(path) as tmp:
        torch.save(obj, tmp)


def _sidecar(out: Path, shard, fmt: str, last: str) -> None:
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


def recode(
    shard_path: Path,
    out: Path,
    storage: Storage,
    target: Path | None,
    device: str,
    vocab: Path | None = None,
) -> dict:
    """Rewrite a shard in another storage mode (e.g. a `trained` capture into float8 + top-k).

    The source must hold final states at every trained position (`states` or `trained`; a top-k
    shard is refused). Top-k output runs the target's lm_head on `device` (a GPU for Kimi-sized
    vocabularies: 2 x V x H flops per trained position); a top-k over the draft vocabulary
    (`topk_vocab: draft`) also needs the vocab file.
    """
    src = open_shard(shard_path)
    if out.resolve() == Path(shard_path).resolve():
        raise ConvertError(f"{out}: recode writes a new shard; pick another --out")
    if src.storage.final == "topk":
        raise ConvertError(
            f"{shard_path}: a top-k shard has no final states to recode from; recapture instead"
        )
    lm_head = None
    if storage.final == "topk":
        if target is None:
            raise ConvertError("recode to a top-k mode needs --target (the target's lm_head)")
        lm_head = lm_head_weight(target).to(device)
    draft_ids = None
    if storage.draft_topk:
        if vocab is None:
            raise ConvertError("recode to topk_vocab draft needs --vocab (the draft vocabulary)")
        from draftsmith.vocab import load_vocab

        d2t, _ = load_vocab(vocab)
        draft_ids = d2t + torch.arange(d2t.shape[0])
    m = src.manifest
    drop = ("tensors", "storage", "sha256", "created", "capture_seconds", "batches")
    keep = {k: v for k, v in m.items() if k not in drop}
    keep["recoded_from"] = {
        "shard": str(shard_path),
        "storage": m.get("storage"),
        "sha256": m.get("sha256"),
    }
    offs = src.row_offsets.tolist()
    with ShardWriter(
        out,
        input_ids=src.input_ids,
        loss_mask=src.loss_mask,
        row_offsets=src.row_offsets,
        hidden_size=m["hidden_size"],
        dtype=m["dtype"],
        manifest=keep,
        storage=storage,
        lm_head=lm_head,
        draft_ids=draft_ids,
    ) as w:
        for a, b in tqdm(list(zip(offs, offs[1:], strict=False)), desc="recode", unit="row"):
            w.write(a, src.aux(a, b), src.teacher(a, b)["last"].to(device))
    return w.manifest


def to_specforge(shard_path: Path, out: Path, group: int) -> int:
    shard = open_full(shard_path, "SpecForge")
    start = shard.manifest["row_range"][0]
    dt = STORAGE_DTYPES[shard.manifest["dtype"]][0]  # float8 aux states: dequantized to it
    for r in tqdm(range(len(shard)), desc="to-specforge", unit="row"):
        row = shard.row(r)
        _save(
            {
                "input_ids": row["input_ids"].clone(),
                "loss_mask": row["loss_mask"].long(),
                "hidden_state": row["last_hidden_states"][None].clone(),
                "aux_hidden_state": row["aux_hidden_states"][None].to(dt).clone(),
            },
            specforge_path(out, start + r, group),
        )
    _sidecar(out, shard, "specforge", "post-norm (unchanged)")
    return len(shard)


def main(argv: list[str] | None = None) -> None:
    from draftsmith import convert_speculators as sp

    ap = argparse.ArgumentParser(
        prog="python -m draftsmith.convert",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = ap.add_subparsers(dest="cmd", required=True)
    for name in ("to-speculators", "to-specforge"):
        p = sub.add_parser(name, help=f"write a draftsmith shard in {name[3:]}'s layout")
        p.add_argument(
            "--shard", type=Path, required=True, help="results/hidden/rows_*.safetensors"
        )
        p.add_argument("--out", type=Path, required=True, help="output directory")
        if name == "to-speculators":
            p.add_argument("--target", type=Path, required=True, help="target HF dir (final norm)")
            p.add_argument(
                "--layout",
                choices=["arrow", "pt"],
                default="arrow",
                help="arrow: speculators >= 0.5 dataset + hs_<i>.safetensors (default); "
                "pt: legacy data_<i>.pt (speculators <= 0.4)",
            )
        else:
            p.add_argument("--group-size", type=int, default=SPECFORGE_GROUP)
    for name in ("from-speculators", "from-specforge"):
        p = sub.add_parser(name, help=f"read {name[5:]} samples into a draftsmith shard")
        p.add_argument("--src", type=Path, required=True, help="directory of legacy samples")
        p.add_argument("--target", type=Path, required=True, help="target HF dir")
        p.add_argument("--out", type=Path, required=True, help=".../rows_<a>-<b>.safetensors")
        p.add_argument("--aux-layer-ids", help="a,b,c in SGLang numbering (if no draftsmith.json)")
        p.add_argument("--dtype", choices=list(STORAGE_DTYPES), help="default: the source dtype")
        p.add_argument(
            "--storage",
            default="{}",
            help='storage mode as JSON, like capture.storage: {"aux": "float8_e4m3", '
            '"final": "topk", "topk": 32} (default: the reference layout)',
        )
    p = sub.add_parser("recode", help="rewrite a shard in another storage mode")
    p.add_argument("--shard", type=Path, required=True)
    p.add_argument("--out", type=Path, required=True, help=".../rows_<a>-<b>.safetensors")
    p.add_argument("--storage", required=True, help="the output's storage mode as JSON")
    p.add_argument("--target", type=Path, help="target HF dir (its lm_head, for top-k)")
    p.add_argument("--device", default="cpu", help="where top-k logits are computed (cuda)")
    p.add_argument("--vocab", type=Path, help="vocab.safetensors (top-k over the draft vocabulary)")
    args = ap.parse_args(argv)
    try:
        storage = None
        if args.cmd.startswith("from-") or args.cmd == "recode":
            try:
                storage = Storage.from_config(json.loads(args.storage))
            except (json.JSONDecodeError, TypeError) as e:
                raise ConvertError(f"--storage {args.storage!r}: not a JSON object ({e})") from None
        if args.cmd == "to-speculators":
            n = sp.to_speculators(args.shard, args.target, args.out, args.layout)
        elif args.cmd == "to-specforge":
            n = to_specforge(args.shard, args.out, args.group_size)
        elif args.cmd == "recode":
            n = recode(args.shard, args.out, storage, args.target, args.device, args.vocab)
            n = n["rows"]
        elif args.cmd == "from-speculators":
            m = sp.from_speculators(
                args.src, args.target, args.out, args.aux_layer_ids, args.dtype, storage
            )
            n = m["rows"]
        else:
            m = from_specforge(
                args.src, args.target, args.out, args.aux_layer_ids, args.dtype, storage
            )
            n = m["rows"]
    except (ConvertError, ShardError, StorageError, ValueError) as e:
        raise SystemExit(f"error: {e}") from None
    print(f"{args.cmd}: {n} rows -> {args.out}")


if __name__ == "__main__":
    main()
