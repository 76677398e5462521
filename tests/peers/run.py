"""Runs inside the `peers` role (speculators 0.9, specforge 0.2 on CPU torch): the peers' own
loaders, readers and writers, driven by tests/test_peers.py. Imports nothing from draftsmith.

    python tests/peers/run.py logits --draft DIR --target DIR --inputs IN --out OUT
    python tests/peers/run.py write-specforge --samples IN --out DIR
    python tests/peers/run.py read-specforge --src DIR --out OUT
    python tests/peers/run.py write-speculators --samples IN --out DIR
    python tests/peers/run.py read-speculators --src DIR --out OUT

IN/OUT are safetensors files; samples are stored as `<i>.<key>` tensors.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")  # SpecForge's RMSNorm/rotary: no compile
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402


def samples_of(path: str) -> list[dict]:
    flat = load_file(path)
    n = 1 + max(int(k.split(".")[0]) for k in flat)
    return [
        {k.split(".", 1)[1]: v for k, v in flat.items() if k.split(".")[0] == str(i)}
        for i in range(n)
    ]


def flat_of(samples: list[dict]) -> dict:
    return {f"{i}.{k}": v.contiguous() for i, s in enumerate(samples) for k, v in s.items()}


@torch.no_grad()
def specforge_logits(draft: str, target: str, aux, ids) -> list[torch.Tensor]:
    """SpecForge's trainer path: config from the directory, warm start, target embedding, then
    its own TTT step loop (SDPA backend: cache_hidden, ids shifted left each step)."""
    from specforge.modeling.draft.llama3_eagle import LlamaForCausalLMEagle3
    from specforge.training.model_loading import load_draft_config_source, warm_start_draft_model
    from specforge.utils import padding

    config = load_draft_config_source(draft)
    model = LlamaForCausalLMEagle3(config, attention_backend="sdpa").eval()
    report = warm_start_draft_model(
        model, draft, draft_config=config, strategy="eagle3", allow_missing_embedding=True
    )
    print("specforge warm start:", report, file=sys.stderr)
    model.load_embedding(target, embedding_key="model.embed_tokens.weight")
    t = aux.shape[1]
    pos = torch.arange(t)[None]
    mask = model.prepare_decoder_attention_mask(
        attention_mask=torch.ones(1, t, dtype=torch.bool),
        hidden_states=aux,
        batch_size=1,
        seq_length=t,
        past_key_values_length=0,
    )
    cache = [[], []]
    hidden = model.project_hidden_states(aux)
    out = []
    for _step in range(2):
        hidden = model.backbone(model.embed_input_ids(ids), hidden, cache, mask, pos)
        out.append(model.compute_logits(hidden)[0])
        ids = padding(ids, left=False)
    return out


@torch.no_grad()
def speculators_logits(draft: str, aux, ids) -> list[torch.Tensor]:
    """speculators' own loader (`SpeculatorModel.from_pretrained`) and forward; the logits of
    each TTT step are taken from its lm_head calls."""
    from speculators import SpeculatorModel

    model = SpeculatorModel.from_pretrained(draft).eval().float()
    out = []
    hook = model.lm_head.register_forward_hook(lambda _m, _i, o: out.append(o[0].clone()))
    t = aux.shape[1]
    model(
        hidden_states=aux,
        input_ids=ids,
        document_ids=torch.zeros(1, t, dtype=torch.long),
        position_ids=torch.arange(t)[None],
        ttt_steps=2,
    )
    hook.remove()
    return out


def write_specforge(samples: list[dict], out: Path) -> None:
    """SpecForge's own dump writer: LocalFeatureStore(dump_dir).put, files named by sample id."""
    from specforge.runtime.data_plane.feature_store import LocalFeatureStore

    out.mkdir(parents=True, exist_ok=True)
    store = LocalFeatureStore(dump_dir=str(out))
    for i, s in enumerate(samples):
        store.put(s, sample_id=f"sf-{i:06d}", metadata={"run_id": "interop"})


def read_specforge(src: Path) -> list[dict]:
    """SpecForge's readers: OfflineManifestReader + LocalFeatureStore.get (the trainer's path),
    cross-checked against OfflineEagle3Dataset's file listing and per-sample processing."""
    from specforge.data.preprocessing import OfflineEagle3Dataset, list_local_files
    from specforge.runtime.data_plane.feature_store import LocalFeatureStore, load_feature_file
    from specforge.runtime.data_plane.offline_reader import OfflineManifestReader

    refs = OfflineManifestReader(str(src), validate_files=True).read()
    store = LocalFeatureStore()
    files = list_local_files(str(src))
    assert [r.feature_store_uri.removeprefix("file://") for r in refs] == files
    got = []
    for ref, f in zip(refs, files, strict=True):
        tensors, handle = store.get(ref)
        tensors = {k: v.clone() for k, v in tensors.items()}
        store.release(handle)
        processed = OfflineEagle3Dataset.process_data(load_feature_file(f), max_len=1 << 20)
        assert torch.equal(processed["hidden_state"], tensors["aux_hidden_state"])
        got.append(tensors)
    return got


def write_speculators(samples: list[dict], out: Path) -> None:
    """speculators' own dataset builder for pre-tokenized rows + save_to_disk; the hidden-state
    files as vLLM's hidden-states connector writes them (safetensors hidden_states, token_ids)."""
    from datasets import Dataset
    from speculators.data_generation.preprocessing import build_speculator_training_dataset

    raw = Dataset.from_dict(
        {
            "input_ids": [s["input_ids"].tolist() for s in samples],
            "loss_mask": [s["loss_mask"].tolist() for s in samples],
        }
    )
    ds = build_speculator_training_dataset(raw, processor=None, max_length=1 << 20, num_proc=1)
    ds.save_to_disk(str(out))
    (out / "hidden_states").mkdir()
    for i, s in enumerate(samples):
        tensors = {"hidden_states": s["hidden_states"], "token_ids": s["input_ids"]}
        save_file(tensors, str(out / "hidden_states" / f"hs_{i}.safetensors"))


def read_speculators(src: Path) -> list[dict]:
    """speculators' training reader: ArrowDataset over the directory (no server: raise on a
    missing file), plus its own hidden-state validation."""
    from speculators.data_generation.offline import check_hidden_states
    from speculators.train.data import ArrowDataset

    ds = ArrowDataset(max_len=1 << 20, datapath=src, on_missing="raise")
    got = []
    for i in range(len(ds)):
        item = ds[i]
        hs = load_file(str(src / "hidden_states" / f"hs_{i}.safetensors"))
        check_hidden_states(hs, ds.data[i]["input_ids"].tolist())
        got.append({k: v for k, v in item.items() if isinstance(v, torch.Tensor)})
    return got


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("cmd")
    for a in ("--draft", "--target", "--inputs", "--samples", "--src", "--out"):
        ap.add_argument(a)
    args = ap.parse_args()
    torch.manual_seed(0)
    if args.cmd == "logits":
        x = load_file(args.inputs)
        aux, ids = x["aux"][None].float(), x["ids"][None]
        sf = specforge_logits(args.draft, args.target, aux, ids)
        sp = speculators_logits(str(Path(args.draft) / "speculators"), aux, ids)
        save_file(
            {
                "specforge_0": sf[0],
                "specforge_1": sf[1],
                "speculators_0": sp[0],
                "speculators_1": sp[1],
            },
            args.out,
        )
    elif args.cmd == "write-specforge":
        write_specforge(samples_of(args.samples), Path(args.out))
    elif args.cmd == "read-specforge":
        save_file(flat_of(read_specforge(Path(args.src))), args.out)
    elif args.cmd == "write-speculators":
        write_speculators(samples_of(args.samples), Path(args.out))
    elif args.cmd == "read-speculators":
        save_file(flat_of(read_speculators(Path(args.src))), args.out)
    else:
        raise SystemExit(f"unknown command {args.cmd}")


if __name__ == "__main__":
    main()
