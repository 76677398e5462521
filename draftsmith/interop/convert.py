"""Converters between our shards and the offline formats of speculators and SpecForge.

    python -m draftsmith convert to-speculators   --shard S --target T --out DIR [--layout arrow|pt]
    python -m draftsmith convert from-speculators --src DIR --target T --out results/hidden/rows_<a>-<b>.safetensors
    python -m draftsmith convert to-specforge     --shard S --out DIR
    python -m draftsmith convert from-specforge   --src DIR --target T --out results/hidden/rows_<a>-<b>.safetensors
    python -m draftsmith convert recode --shard S --storage JSON [--target T --device cuda] [--vocab V] --out O

speculators (both generations): `draftsmith.interop.speculators`; what both converters share:
`draftsmith.interop.common`. SpecForge: `input_ids`,
`loss_mask`, `hidden_state [1, S, H]` post-norm, `aux_hidden_state [1, S, 3H]` in one torch.save
file per sample, `.ckpt` or gzipped `.ckpt.gz`, anywhere below the directory (SpecForge's own
readers walk the tree). `to-specforge` writes `rows_<g>-<g+2000>/data_<i>.ckpt` (i = global
row); `from-specforge` maps rows to files by that index when every file is named `data_<i>`,
otherwise in SpecForge's reader order (sorted paths).

Legacy files are read with `torch.load(weights_only=True)` only; a file that needs more is
refused. Every converted shard's manifest says what was assumed (`converted_from`: format,
layer numbering, where the SGLang-numbered ids came from, what was done to the final state,
how samples map to rows); `to-*` writes `draftsmith.json` beside the samples with the ids.

Storage modes (draftsmith/hidden/storage.py): `from-*` write any mode (`--storage '{"aux":
"float8_e4m3", "final": "topk"}'`, the `capture.storage` section as JSON; top-k needs the
target's lm_head, read from --target). `to-*` read any mode whose final state is stored at every
token (float8 aux states are dequantized to the shard's dtype); a shard that keeps the final
state only at trained positions or as top-k log-probabilities cannot give the per-token final
states both formats require, and is refused with that reason. `recode` rewrites a shard in
another mode (e.g. one captured with `final: trained` into float8 + top-k, on a GPU).
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import torch
from tqdm import tqdm

from draftsmith.config.checks import parse_range
from draftsmith.hidden.shards import STORAGE_DTYPES, ShardError, open_shard
from draftsmith.hidden.storage import Storage, StorageError
from draftsmith.hidden.writer import ShardWriter
from draftsmith.interop.common import (
    ConvertError,
    check_sample,
    converted_manifest,
    ids_from,
    lm_head_weight,
    load_legacy,
    open_full,
    save_sample,
    write_shard,
    write_sidecar,
)
from draftsmith.runtime.files import subcommand_parser

SPECFORGE_GROUP = 2000


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
    from draftsmith.targets.model import target_config

    a, b = parse_range(out.stem)
    n_layers = int(target_config(target)["num_hidden_layers"])
    ids, how = ids_from(src, ids_arg, n_layers)

    def read(f: Path, states: bool) -> dict:
        d = load_legacy(f)
        for k in ("input_ids", "loss_mask", "hidden_state", "aux_hidden_state"):
            if k not in d:
                raise ConvertError(f"{f}: SpecForge sample lacks {k!r} (keys {sorted(d)})")
        aux, last = d["aux_hidden_state"], d["hidden_state"]
        if aux.dim() != 3 or last.dim() != 3 or aux.shape[0] != 1 or last.shape[0] != 1:
            raise ConvertError(
                f"{f}: expected hidden_state [1,S,H] and aux_hidden_state [1,S,{len(ids)}H], "
                f"got {list(last.shape)} and {list(aux.shape)}"
            )
        if aux.shape[-1] != len(ids) * last.shape[-1]:
            raise ConvertError(
                f"{f}: aux_hidden_state width {aux.shape[-1]} != {len(ids)} x {last.shape[-1]} "
                f"(one state per layer id of {ids}, {how})"
            )
        input_ids, loss_mask = check_sample(f, d["input_ids"], d["loss_mask"], [aux[0], last[0]])
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
    manifest = converted_manifest(
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
    return write_shard(out, files, read, dtype, manifest, storage, target)


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
        from draftsmith.data.vocab import load_vocab

        d2t, _ = load_vocab(vocab)
        draft_ids = d2t + torch.arange(d2t.shape[0])
    m = src.manifest
    drop = ("tensors", "storage", "sha256", "crc32", "created", "capture_seconds", "batches")
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
        save_sample(
            {
                "input_ids": row["input_ids"].clone(),
                "loss_mask": row["loss_mask"].long(),
                "hidden_state": row["last_hidden_states"][None].clone(),
                "aux_hidden_state": row["aux_hidden_states"][None].to(dt).clone(),
            },
            specforge_path(out, start + r, group),
        )
    write_sidecar(out, shard, "specforge", "post-norm (unchanged)")
    return len(shard)


def main(argv: list[str] | None = None) -> None:
    from draftsmith.interop import speculators as sp

    ap, sub = subcommand_parser("convert", __doc__)
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
