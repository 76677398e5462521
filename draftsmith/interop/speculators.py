"""speculators' offline training data, both generations, to and from our shards.

Current (speculators >= 0.5; 0.9 is the one checked): `DIR` is a Hugging Face `datasets`
dataset saved with `save_to_disk` (columns `input_ids`, `loss_mask`, `seq_len`), and
`DIR/hidden_states/hs_<i>.safetensors` holds, for dataset row i, `hidden_states [S, K+1, H]`
(the K aux states, three by default, then the target's final state *before* its final norm) and `token_ids [S]`
(equal to the row's `input_ids`). The states are captured by vLLM, whose layer id k is the input
of layer k (SGLang's output of layer k - 1); speculators' default is [2, N//2, N-3] plus N.

Legacy (speculators <= 0.4): one `data_<i>.pt` per sample with `input_ids`, `hidden_states`
(a list of the 3 aux states and the pre-norm final state) and `loss_mask` (sometimes one longer
than input_ids: truncated). Read only (`torch.load(weights_only=True)`); `--layout pt` still
writes it for old trainers.

Reading the current layout needs the `datasets` package (role `peers` has it). Neither layout
records SGLang-numbered ids: `to-speculators` writes `draftsmith.json` beside the data, and
`from-speculators` reads it or takes `--aux-layer-ids`. The sample index is the global row index
for legacy files and `global row - draftsmith.json row_range[0]` (0 without the file) for the
dataset.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

import torch
from tqdm import tqdm

from draftsmith.config.checks import parse_range
from draftsmith.hidden.shards import STORAGE_DTYPES
from draftsmith.interop.common import (
    SIDECAR,
    ConvertError,
    apply_norm,
    check_sample,
    converted_manifest,
    final_norm,
    ids_from,
    load_legacy,
    open_full,
    remove_norm,
    save_sample,
    write_shard,
    write_sidecar,
)
from draftsmith.runtime.files import atomic_write_json
from draftsmith.targets.families import norm_convention

HS_DIR = "hidden_states"
ST_DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32}


def _datasets():
    try:
        import datasets
    except ImportError:
        raise ConvertError(
            "speculators >= 0.5 data is a `datasets` Arrow dataset: this interpreter lacks the "
            "`datasets` package (run the converter with the `peers` role's python, or "
            "`pip install datasets==5.1.0`)"
        ) from None
    return datasets


def layout_of(src: Path) -> str:
    """ "arrow" (speculators >= 0.5) or "pt" (<= 0.4), from the files in `src`."""
    if (src / "dataset_info.json").is_file() or (src / "state.json").is_file():
        return "arrow"
    if any(src.glob("data_*.pt")):
        return "pt"
    raise ConvertError(
        f"{src}: neither a speculators dataset (dataset_info.json, state.json, "
        f"{HS_DIR}/hs_<i>.safetensors) nor legacy data_<i>.pt samples"
    )


def _vllm_hint(n_layers: int) -> str:
    d = [2, n_layers // 2, n_layers - 3]
    return (
        f"speculators' default capture is vLLM ids {d} + {n_layers}, which is "
        f"--aux-layer-ids {','.join(str(i - 1) for i in d)} in SGLang numbering"
    )


def from_speculators(src: Path, target: Path, out: Path, ids_arg, dtype, storage=None) -> dict:
    from draftsmith.targets.model import target_config

    a, b = parse_range(out.stem)
    n_layers = int(target_config(target)["num_hidden_layers"])
    layout = layout_of(src)
    try:
        ids, how = ids_from(src, ids_arg, n_layers)
    except ConvertError as e:
        raise ConvertError(f"{e}. {_vllm_hint(n_layers)}") from None
    weight, eps = final_norm(target)
    if layout == "pt":
        read, items = _pt_reader(weight, eps, len(ids)), [src / f"data_{i}.pt" for i in range(a, b)]
        index = "data_<i>.pt, i = global row"
    else:
        read, items, offset = _arrow_reader(src, weight, eps, a, b, len(ids))
        index = f"dataset row (hs_<row>.safetensors) = global row - {offset}"
    manifest = converted_manifest(
        (a, b),
        ids,
        target,
        n_layers,
        src,
        how,
        "speculators-v1" if layout == "pt" else "speculators-arrow",
        "applied: the source stores the final state pre-norm (target's final RMSNorm, "
        f"eps {eps}, weight applied as {norm_convention(target_config(target))}, float32)",
    )
    manifest["converted_from"]["layer_numbering"] = (
        "source: speculators/vLLM input-of-layer ids (SGLang id + 1); shard: SGLang output-of-layer"
    )
    manifest["converted_from"]["sample_index"] = index
    return write_shard(out, items, read, dtype, manifest, storage, target)


def _pt_reader(weight, eps, n_aux: int):
    """Reader of v1 samples: hidden_states a list of the n_aux aux states and the final state."""

    def read(f: Path, states: bool) -> dict:
        d = load_legacy(f)
        for k in ("input_ids", "hidden_states", "loss_mask"):
            if k not in d:
                raise ConvertError(f"{f}: speculators v1 sample lacks {k!r} (keys {sorted(d)})")
        hs = d["hidden_states"]
        if not isinstance(hs, (list, tuple)) or len(hs) != n_aux + 1:
            raise ConvertError(
                f"{f}: hidden_states must be a list of {n_aux} aux states + the final "
                f"pre-norm state, got {type(hs).__name__} of {len(hs)}"
            )
        input_ids, loss_mask = check_sample(f, d["input_ids"], d["loss_mask"], list(hs))
        s = {
            "input_ids": input_ids,
            "loss_mask": loss_mask,
            "hidden_size": hs[0].shape[-1],
            "dtype": hs[0].dtype,
        }
        if states:
            s["aux"] = torch.cat(list(hs[:n_aux]), dim=-1)
            s["last"] = apply_norm(hs[n_aux], weight, eps)
        return s

    return read


def _arrow_reader(src: Path, weight, eps, a: int, b: int, n_aux: int):
    from safetensors import safe_open

    ds = _datasets().load_from_disk(str(src))
    missing = {"input_ids", "loss_mask"} - set(ds.column_names)
    if missing:
        raise ConvertError(f"{src}: dataset lacks columns {sorted(missing)} ({ds.column_names})")
    sidecar = src / SIDECAR
    offset = json.loads(sidecar.read_text())["row_range"][0] if sidecar.is_file() else 0
    if a - offset < 0 or b - offset > len(ds):
        raise ConvertError(
            f"{src}: rows {a}..{b - 1} are dataset rows {a - offset}..{b - 1 - offset}, but the "
            f"dataset has {len(ds)} rows"
        )

    def read(i: int, states: bool) -> dict:
        row = ds[i]
        f = src / HS_DIR / f"hs_{i}.safetensors"
        where = f"{src} row {i}"
        ids = torch.as_tensor(row["input_ids"], dtype=torch.long)
        if "seq_len" in row and int(row["seq_len"]) != ids.numel():
            raise ConvertError(f"{where}: seq_len {row['seq_len']} != {ids.numel()} input_ids")
        if not f.is_file():
            raise ConvertError(f"{f}: missing hidden-state file")
        try:
            with safe_open(str(f), "pt") as st:
                keys = set(st.keys())
                if not {"hidden_states", "token_ids"} <= keys:
                    raise ConvertError(
                        f"{f}: needs hidden_states and token_ids, has {sorted(keys)}"
                    )
                sl = st.get_slice("hidden_states")
                shape, tag = sl.get_shape(), sl.get_dtype()
                token_ids = st.get_tensor("token_ids").long()
                hs = st.get_tensor("hidden_states") if states else None
        except ConvertError:
            raise
        except Exception as e:  # safetensors raises its own types for damaged files
            raise ConvertError(f"{f}: unreadable ({str(e).splitlines()[0]})") from None
        if len(shape) != 3 or shape[1] != n_aux + 1:
            raise ConvertError(
                f"{f}: hidden_states is {shape}, expected [S, {n_aux + 1}, H] ({n_aux} aux states + the "
                "final state: launch vLLM with the last layer included)"
            )
        if tag not in ST_DTYPES:
            raise ConvertError(f"{f}: hidden_states dtype {tag} is not one of {list(ST_DTYPES)}")
        if not torch.equal(token_ids, ids):
            raise ConvertError(f"{f}: token_ids differ from the dataset's input_ids of row {i}")
        input_ids, loss_mask = check_sample(
            f, ids, torch.as_tensor(row["loss_mask"]), [torch.empty(shape[0], 0)]
        )
        s = {
            "input_ids": input_ids,
            "loss_mask": loss_mask,
            "hidden_size": shape[2],
            "dtype": ST_DTYPES[tag],
        }
        if states:
            s["aux"] = hs[:, :n_aux].reshape(shape[0], n_aux * shape[2])
            s["last"] = apply_norm(hs[:, n_aux], weight, eps)
        return s

    return read, list(range(a - offset, b - offset)), offset


def _states(shard, r: int, weight) -> tuple[dict, list[torch.Tensor]]:
    h = shard.manifest["hidden_size"]
    row = shard.row(r)
    aux = row["aux_hidden_states"].to(
        STORAGE_DTYPES[shard.manifest["dtype"]][0]
    )  # float8: dequantized
    hs = list(aux.split(h, dim=-1))  # the K aux states, in the manifest's aux_layer_ids order
    hs.append(remove_norm(row["last_hidden_states"], weight).to(aux.dtype))
    return row, hs


def to_speculators(shard_path: Path, target: Path, out: Path, layout: str = "arrow") -> int:
    shard = open_full(shard_path, "speculators")
    weight, eps = final_norm(target)
    n = shard.manifest.get("target_layers")
    ids = shard.manifest["aux_layer_ids"]
    last = f"pre-norm: h / norm.weight (eps {eps}); applying the target's norm gives h back"
    if layout == "pt":
        start = shard.manifest["row_range"][0]
        for r in tqdm(range(len(shard)), desc="to-speculators", unit="row"):
            row, hs = _states(shard, r, weight)
            sample = {
                "input_ids": row["input_ids"].clone(),
                "hidden_states": [t.clone() for t in hs],  # clone: never save the mmap
                "loss_mask": row["loss_mask"].long(),
            }
            save_sample(sample, out / f"data_{start + r}.pt")
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
        write_sidecar(out, shard, "speculators-v1", last)
        return len(shard)
    return _to_arrow(shard, out, weight, last)


def _to_arrow(shard, out: Path, weight, last: str) -> int:
    from safetensors.torch import save_file

    datasets = _datasets()
    if out.exists() and any(out.iterdir()):
        raise ConvertError(f"{out}: exists and is not empty; remove it or pick another --out")
    out.parent.mkdir(parents=True, exist_ok=True)
    stage = Path(tempfile.mkdtemp(prefix=f".tmp-{out.name}-", dir=out.parent))
    try:
        (stage / HS_DIR).mkdir()
        cols = {"input_ids": [], "loss_mask": [], "seq_len": []}
        for r in tqdm(range(len(shard)), desc="to-speculators", unit="row"):
            row, hs = _states(shard, r, weight)
            cols["input_ids"].append(row["input_ids"].tolist())
            cols["loss_mask"].append(row["loss_mask"].long().tolist())
            cols["seq_len"].append(row["input_ids"].numel())
            tensors = {
                "hidden_states": torch.stack(hs, dim=1).contiguous(),
                "token_ids": row["input_ids"].clone(),
            }
            save_file(tensors, str(stage / HS_DIR / f"hs_{r}.safetensors"))
        ds = datasets.Dataset.from_dict(cols)
        ds.set_format(type="torch")  # saved in state.json: speculators' reader expects tensors
        ds.save_to_disk(str(stage / "dataset"))
        for p in (stage / "dataset").iterdir():
            p.rename(stage / p.name)
        (stage / "dataset").rmdir()
        write_sidecar(stage, shard, "speculators-arrow", last)
        if out.exists():
            out.rmdir()
        stage.rename(out)
    except BaseException:
        shutil.rmtree(stage, ignore_errors=True)
        raise
    return len(shard)
