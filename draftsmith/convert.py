"""Converters between our shards and the per-sample formats of speculators v1 and SpecForge.

    python -m draftsmith.convert to-speculators   --shard S --target T --out DIR
    python -m draftsmith.convert from-speculators --src DIR --target T --out results/hidden/rows_<a>-<b>.safetensors
    python -m draftsmith.convert to-specforge     --shard S --out DIR
    python -m draftsmith.convert from-specforge   --src DIR --target T --out results/hidden/rows_<a>-<b>.safetensors

speculators v1 (`data_<i>.pt`): `input_ids [S]`, `hidden_states` a list of the 3 aux states and
the final state *before* the target's final norm (each [S, H]), `loss_mask [S]` (may be longer
than input_ids in the wild: truncated here). SpecForge (`rows_<g>-<g+2000>/data_<i>.ckpt`):
`input_ids`, `loss_mask`, `hidden_state [1, S, H]` post-norm, `aux_hidden_state [1, S, 3H]`.
Sample index i is the global row index (the shard's row range start + row).

Legacy files are read with `torch.load(weights_only=True)` only; a file that needs more is
refused. Going to speculators the final norm is removed (h / norm.weight: a pre-norm state whose
norm is h; the original scale is not recoverable); coming from it the norm is applied. Neither
format records SGLang-convention layer ids, so the `to-*` commands write a `draftsmith.json`
beside the samples, and `from-*` takes `--aux-layer-ids` when that file is absent.
"""

from __future__ import annotations

import argparse
import json
import pickle
import re
from pathlib import Path

import torch
from tqdm import tqdm

from draftsmith.common import atomic_path, atomic_write_json, versions
from draftsmith.config import aux_layer_ids, parse_range
from draftsmith.shards import CONVENTION, STORAGE_DTYPES, ShardError, ShardWriter, open_shard

SIDECAR = "draftsmith.json"
SPECFORGE_GROUP = 2000


class ConvertError(ValueError):
    """A legacy file or directory the converter cannot use; the message names it."""


def load_legacy(path: Path) -> dict:
    """torch.load(weights_only=True, mmap=True); refuse files that need arbitrary unpickling."""
    if not path.is_file():
        raise ConvertError(f"{path}: missing sample file")
    try:
        obj = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except pickle.UnpicklingError as e:
        m = re.search(r"Unsupported global: GLOBAL (\S+)", str(e))
        what = f"it references {m.group(1)}" if m else str(e).splitlines()[0]
        raise ConvertError(
            f"{path}: refused: {what}, which torch.load(weights_only=True) does not allow "
            "(draftsmith never unpickles arbitrary objects)"
        ) from None
    except (RuntimeError, EOFError, OSError) as e:
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


def _write_shard(out: Path, files: list[Path], read, dtype: str | None, manifest: dict) -> dict:
    """Two passes over mmap-loaded samples: tokens first (for the header), then the states."""
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


def from_speculators(src: Path, target: Path, out: Path, ids_arg, dtype) -> dict:
    from draftsmith.target import target_config

    a, b = parse_range(out.stem)
    n_layers = int(target_config(target)["num_hidden_layers"])
    ids, how = _ids_from(src, ids_arg, n_layers)
    weight, eps = final_norm(target)

    def read(f: Path, states: bool) -> dict:
        d = load_legacy(f)
        for k in ("input_ids", "hidden_states", "loss_mask"):
            if k not in d:
                raise ConvertError(f"{f}: speculators v1 sample lacks {k!r} (keys {sorted(d)})")
        hs = d["hidden_states"]
        if not isinstance(hs, (list, tuple)) or len(hs) != 4:
            raise ConvertError(
                f"{f}: hidden_states must be a list of 3 aux states + the final "
                f"pre-norm state, got {type(hs).__name__} of {len(hs)}"
            )
        input_ids, loss_mask = _check_sample(f, d["input_ids"], d["loss_mask"], list(hs))
        s = {
            "input_ids": input_ids,
            "loss_mask": loss_mask,
            "hidden_size": hs[0].shape[-1],
            "dtype": hs[0].dtype,
        }
        if states:
            s["aux"] = torch.cat(list(hs[:3]), dim=-1)
            s["last"] = apply_norm(hs[3], weight, eps)
        return s

    files = [src / f"data_{i}.pt" for i in range(a, b)]
    return _write_shard(
        out,
        files,
        read,
        dtype,
        _converted_manifest(
            (a, b),
            ids,
            target,
            n_layers,
            src,
            how,
            "speculators-v1",
            "applied: the source stores the final state pre-norm",
        ),
    )


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


def from_specforge(src: Path, target: Path, out: Path, ids_arg, dtype, group: int) -> dict:
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

    files = [specforge_path(src, i, group) for i in range(a, b)]
    return _write_shard(
        out,
        files,
        read,
        dtype,
        _converted_manifest(
            (a, b),
            ids,
            target,
            n_layers,
            src,
            how,
            "specforge",
            "none: the source stores the final state post-norm",
        ),
    )


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
            "final_state": last,
            "target_fingerprint": m.get("target_fingerprint"),
            "source_shard": str(shard.path),
            "versions": versions(),
        },
    )


def to_speculators(shard_path: Path, target: Path, out: Path) -> int:
    shard = open_shard(shard_path)
    weight, eps = final_norm(target)
    h, start = shard.manifest["hidden_size"], shard.manifest["row_range"][0]
    for r in tqdm(range(len(shard)), desc="to-speculators", unit="row"):
        row = shard.row(r)
        aux = row["aux_hidden_states"]
        dt = aux.dtype
        hs = [aux[:, k * h : (k + 1) * h].clone() for k in range(3)]  # clone: never save the mmap
        hs.append(remove_norm(row["last_hidden_states"], weight).to(dt))
        _save(
            {
                "input_ids": row["input_ids"].clone(),
                "hidden_states": hs,
                "loss_mask": row["loss_mask"].long(),
            },
            out / f"data_{start + r}.pt",
        )
    n = shard.manifest["target_layers"] if "target_layers" in shard.manifest else None
    ids = shard.manifest["aux_layer_ids"]
    atomic_write_json(
        out / "data_config.json",
        {
            "version": "2.0",
            "hidden_states": {
                "layer_ids": [i + 1 for i in ids] + ([n] if n else []),
                "numbering": "HF output_hidden_states index; last entry pre-norm",
            },
            "format": {"file_pattern": "data_{idx}.pt", "data_format_version": 1},
        },
    )
    _sidecar(
        out,
        shard,
        "speculators-v1",
        f"pre-norm: h / norm.weight (eps {eps}); applying the target's norm gives h back",
    )
    return len(shard)


def to_specforge(shard_path: Path, out: Path, group: int) -> int:
    shard = open_shard(shard_path)
    start = shard.manifest["row_range"][0]
    for r in tqdm(range(len(shard)), desc="to-specforge", unit="row"):
        row = shard.row(r)
        _save(
            {
                "input_ids": row["input_ids"].clone(),
                "loss_mask": row["loss_mask"].long(),
                "hidden_state": row["last_hidden_states"][None].clone(),
                "aux_hidden_state": row["aux_hidden_states"][None].clone(),
            },
            specforge_path(out, start + r, group),
        )
    _sidecar(out, shard, "specforge", "post-norm (unchanged)")
    return len(shard)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(
        prog="python -m draftsmith.convert",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = ap.add_subparsers(dest="cmd", required=True)
    for name in ("to-speculators", "to-specforge"):
        p = sub.add_parser(name)
        p.add_argument("--shard", type=Path, required=True)
        p.add_argument("--out", type=Path, required=True, help="output directory")
        p.add_argument(
            "--target",
            type=Path,
            required=name == "to-speculators",
            help="target HF dir (its final norm weight)",
        )
        p.add_argument("--group-size", type=int, default=SPECFORGE_GROUP)
    for name in ("from-speculators", "from-specforge"):
        p = sub.add_parser(name)
        p.add_argument("--src", type=Path, required=True, help="directory of legacy samples")
        p.add_argument("--target", type=Path, required=True, help="target HF dir")
        p.add_argument("--out", type=Path, required=True, help=".../rows_<a>-<b>.safetensors")
        p.add_argument("--aux-layer-ids", help="a,b,c in SGLang numbering (if no draftsmith.json)")
        p.add_argument("--dtype", choices=list(STORAGE_DTYPES), help="default: the source dtype")
        p.add_argument("--group-size", type=int, default=SPECFORGE_GROUP)
    args = ap.parse_args(argv)
    try:
        if args.cmd == "to-speculators":
            n = to_speculators(args.shard, args.target, args.out)
        elif args.cmd == "to-specforge":
            n = to_specforge(args.shard, args.out, args.group_size)
        elif args.cmd == "from-speculators":
            n = from_speculators(args.src, args.target, args.out, args.aux_layer_ids, args.dtype)[
                "rows"
            ]
        else:
            n = from_specforge(
                args.src, args.target, args.out, args.aux_layer_ids, args.dtype, args.group_size
            )["rows"]
    except (ConvertError, ShardError, ValueError) as e:
        raise SystemExit(f"error: {e}") from None
    print(f"{args.cmd}: {n} rows -> {args.out}")


if __name__ == "__main__":
    main()
