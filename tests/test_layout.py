"""Wrapped targets: the text model under `language_model.` / `text_config`, as
Kimi-K2.5 (`KimiK25ForConditionalGeneration`) and multimodal Gemma-3 ship, is found by
draftsmith.targets.layout and gives the same frozen pieces, captured states, training run and export as
the same model unwrapped."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from draftsmith.targets.layout import LayoutError, find_layout, read_pieces
from draftsmith.targets.tinymodel import wrap_target

# SGLang's DeepSeek model file reads ids as trained only when the first is 1 (draftsmith.targets.layerids),
# so the export refuses [0, 1, 2]: the tiny DeepSeek-V3 here has 5 layers, ids [1, 2, 3]
IDS = [1, 2, 3]


@pytest.fixture(scope="module")
def pair(tmp_path_factory) -> dict[str, Path]:
    """A tiny 5-layer DeepSeek-V3 as it is ("plain") and wrapped as Kimi-K2.5 ships ("kimi")."""
    from draftsmith.targets.model import write_meta
    from draftsmith.targets.tinymodel import make_tiny_target

    root = tmp_path_factory.mktemp("layout_pair")
    tiny_deepseek_target = make_tiny_target(root / "src" / "model", "deepseek_v3", num_layers=5)
    out = {}
    for name in ("plain", "kimi"):
        d = shutil.copytree(tiny_deepseek_target, root / name / "results" / "target")
        if name == "kimi":
            wrap_target(d, "kimi_k25")
        write_meta(d, source="path", origin=str(tiny_deepseek_target))
        out[name] = d
    return out


def test_layout_of_plain_and_kimi_wrapped(pair):
    from draftsmith.targets.model import read_meta, target_config

    plain, kimi = find_layout(pair["plain"]), find_layout(pair["kimi"])
    assert (plain.base, plain.lm_head, plain.wrapped) == ("model.", "lm_head.weight", False)
    assert plain.key_mapping() == {}
    assert kimi.base == "language_model.model." and kimi.lm_head == "language_model.lm_head.weight"
    assert kimi.nested and kimi.wrapped
    assert kimi.architectures == ("KimiK25ForConditionalGeneration",)
    assert set(kimi.key_mapping().values()) == {"model.", "lm_head.weight"}
    # the target's metadata says which prefix was found; a plain target's stays as it was
    assert "text_model" not in read_meta(pair["plain"])
    assert read_meta(pair["kimi"])["text_model"] == {
        "architectures": ["KimiK25ForConditionalGeneration"],
        "config": "text_config",
        "prefix": "language_model.model.",
        "lm_head": "language_model.lm_head.weight",
    }
    assert target_config(pair["kimi"]) == target_config(pair["plain"])


def test_the_target_stage_serves_a_multimodal_wrapper_text_only(pair, tmp_path):
    """Rule target_model's link step declares the wrapper (a vision_config beside the text model)
    text-only in results/target/config.json, a file then, the rest links; the user's directory
    is not written; a plain target is untouched (draftsmith.targets.layout.serve_text_only)."""
    from draftsmith.targets.model import link_path_target, read_meta, target_config

    for name in ("plain", "kimi"):
        out = tmp_path / name
        link_path_target(pair[name], out)
        cfg = json.loads((out / "config.json").read_text())
        meta = read_meta(out)
        if name == "plain":
            assert (out / "config.json").is_symlink() and "served_config" not in meta
            continue
        assert not (out / "config.json").is_symlink() and (out / "model.safetensors").is_symlink()
        assert cfg["language_model_only"] is True and cfg["vision_config"]["vt_hidden_size"] == 16
        assert meta["served_config"] == {"language_model_only": True}
        assert "language_model_only" not in json.loads((pair[name] / "config.json").read_text())
        assert target_config(out) == target_config(pair["plain"])
        assert find_layout(out).base == "language_model.model."


def test_target_tensors_of_a_wrapped_checkpoint(pair):
    """Training's frozen pieces of the wrapped model."""
    from draftsmith.algorithms.export import target_embedding
    from draftsmith.train.data import target_tensors

    plain, kimi = target_tensors(pair["plain"]), target_tensors(pair["kimi"])
    assert set(kimi) == {"embed", "lm_head", "norm"}
    for role in kimi:
        assert torch.equal(kimi[role], plain[role]), role
    assert not torch.equal(kimi["lm_head"], kimi["embed"])  # untied: the real head was read
    assert torch.equal(target_embedding(pair["kimi"]), target_embedding(pair["plain"]))


def write_weights(d: Path, names: dict[str, torch.Tensor], config: dict | None = None) -> Path:
    d.mkdir(parents=True)
    save_file({k: v.clone() for k, v in names.items()}, str(d / "model.safetensors"))
    (d / "config.json").write_text(json.dumps(config or {"architectures": ["X"]}))
    return d


def test_other_layouts_and_refusals(tmp_path):
    """Gemma-3 as transformers >= 4.52 saves it (model.language_model.*, top-level lm_head),
    a tied head, a sharded index, and checkpoints with no or two text models, refused by name."""
    e, n = torch.arange(12.0).reshape(4, 3), torch.ones(3)
    layer = {"layers.0.input_layernorm.weight": n}

    def text(prefix):
        return {f"{prefix}embed_tokens.weight": e, f"{prefix}norm.weight": n} | {
            f"{prefix}{k}": v for k, v in layer.items()
        }

    vision = {"model.vision_tower.vision_model.encoder.layers.0.layer_norm1.weight": n}
    gemma = write_weights(
        tmp_path / "gemma",
        text("model.language_model.") | vision | {"lm_head.weight": 2 * e},
        {"architectures": ["Gemma3ForConditionalGeneration"], "text_config": {"hidden_size": 3}},
    )
    lay = find_layout(gemma)
    assert (lay.base, lay.lm_head, lay.wrapped) == ("model.language_model.", "lm_head.weight", True)
    assert lay.key_mapping() == {r"^model\.language_model\.": "model."}
    assert torch.equal(read_pieces(gemma)["lm_head"], 2 * e)
    tied = write_weights(tmp_path / "tied", text("model."))
    pieces = read_pieces(tied)
    assert find_layout(tied).lm_head is None and pieces["lm_head"] is pieces["embed"]
    # an index names the files: the weights may be split across shards
    shard = tmp_path / "sharded"
    shard.mkdir()
    save_file({"language_model.model.embed_tokens.weight": e}, str(shard / "a.safetensors"))
    rest = {k: v for k, v in text("language_model.model.").items() if "embed" not in k}
    save_file({k: v.clone() for k, v in rest.items()}, str(shard / "b.safetensors"))
    weight_map = {k: "a.safetensors" for k in ["language_model.model.embed_tokens.weight"]}
    weight_map |= dict.fromkeys(rest, "b.safetensors")
    (shard / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    (shard / "config.json").write_text("{}")
    assert torch.equal(read_pieces(shard)["embed"], e)
    with pytest.raises(LayoutError, match=r"no text model found.*embeddings seen: \[\]"):
        find_layout(write_weights(tmp_path / "none", {"vision.proj.weight": n}))
    two = write_weights(tmp_path / "two", text("a.model.") | text("b.model."))
    with pytest.raises(LayoutError, match=r"two: several text model.*'a.model.', 'b.model.'"):
        find_layout(two)


def test_hf_capture_of_a_wrapped_target_equals_the_plain_one(pair, tmp_path):
    """The capture CLI (engine hf) on the wrapped model: shards with the same states bit for
    bit, while the wrapper's vision tensors are never read into the model."""
    from draftsmith.engines.hf.engine import decoder_parts
    from draftsmith.stages.capture import main
    from draftsmith.targets.model import load_target

    model, _ = load_target(pair["kimi"])
    base, layers = decoder_parts(model)
    assert len(layers) == 5 and not any("vision" in k for k in model.state_dict())
    g = torch.Generator().manual_seed(0)
    offsets = torch.tensor([0, 9, 25, 31, 48])
    tok = {
        "input_ids": torch.randint(0, 300, (48,), generator=g),
        "loss_mask": (torch.rand(48, generator=g) > 0.3).to(torch.uint8),
        "row_offsets": offsets,
    }
    tokens = tmp_path / "rows_000000-000004.safetensors"
    save_file(tok, str(tokens))
    cfg = {
        "capture": {"backend": "hf", "role": "cpu", "aux_layer_ids": IDS, "dtype": "float32"},
        "target": {"dtype": "float32"},
    }
    cfg["capture"]["batch_tokens"] = 64
    for target in pair.values():
        out = target.parent / "hidden" / tokens.name
        main(["--cfg", json.dumps(cfg), "--tokens", str(tokens), "--target", str(target)]
             + ["--out", str(out), "--threads", "1"])  # fmt: skip
    shards = [load_file(pair[n].parent / "hidden" / tokens.name) for n in ("plain", "kimi")]
    assert shards[0].keys() == shards[1].keys()
    for key in shards[0]:
        assert torch.equal(shards[0][key], shards[1][key]), key


def train_cfg() -> dict:
    train = {
        "role": "cpu",
        "ttt_steps": 2,
        "epochs": 3,
        "lr": 0.003,
        "warmup_ratio": 0.1,
        "batch_tokens": 64,
        "max_steps": 3,
        "seed": 0,
        "checkpoint_every": 0,
        "checkpoint_seconds": 0,
        "noise_std": 0.0,
        "nproc": 1,
        "precision": "fp32",
    }
    return {
        "train": train,
        "draft": {"vocab_size": 64, "init_from_target": True},
        "capture": {"aux_layer_ids": IDS},
    }


def test_train_and_export_on_a_wrapped_target(pair, tmp_path):
    """A few training steps and the export on the wrapped model's shards: the same losses and
    draft as on the plain model, a checked export whose verifier is the wrapper, the speculators
    copy carrying the text model's embedding."""
    from draftsmith.algorithms.export import check_export
    from draftsmith.stages.train import main as train_main

    hidden = pair["plain"].parent / "hidden" / "rows_000000-000004.safetensors"
    if not hidden.exists():
        test_hf_capture_of_a_wrapped_target_equals_the_plain_one(pair, tmp_path)
    counts = torch.bincount(load_file(hidden)["input_ids"], minlength=384)
    hot = torch.sort(torch.argsort(counts, descending=True, stable=True)[:64]).values
    t2d = torch.zeros(384, dtype=torch.bool)
    t2d[hot] = True
    vocab = tmp_path / "vocab.safetensors"
    save_file({"d2t": hot - torch.arange(64), "t2d": t2d, "counts": counts[hot]}, str(vocab))
    metrics, weights = {}, {}
    here = Path.cwd()
    for name, target in pair.items():
        root = target.parent.parent
        shard = target.parent / "hidden" / hidden.name
        os.chdir(root)  # the export's verifier reference is relative to the project root
        try:
            train_main(["--cfg", json.dumps(train_cfg()), "--shards", str(shard), "--vocab",
                        str(vocab), "--target", "results/target", "--out", "results/draft",
                        "--metrics", "results/metrics.jsonl", "--state", "state",
                        "--threads", "1", "--device", "cpu"])  # fmt: skip
        finally:
            os.chdir(here)
        draft = root / "results" / "draft"
        check_export(draft, root / "results" / "metrics.jsonl")
        metrics[name] = [
            json.loads(ln)["loss"]
            for ln in (root / "results/metrics.jsonl").read_text().splitlines()
        ]
        weights[name] = load_file(draft / "model.safetensors")
        spec = json.loads((draft / "speculators" / "config.json").read_text())
        with safe_open(str(draft / "speculators" / "model.safetensors"), "pt") as f:
            embed = f.get_tensor("embed_tokens.weight")
        assert torch.equal(embed, read_pieces(target, roles=("embed",))["embed"])
        if name == "kimi":
            verifier = spec["speculators_config"]["verifier"]
            assert verifier["architectures"] == ["KimiK25ForConditionalGeneration"]
    assert len(metrics["kimi"]) == 3 and metrics["kimi"] == metrics["plain"]
    for key in weights["plain"]:
        assert torch.equal(weights["kimi"][key], weights["plain"][key]), key


def test_tiny_deepseek_v3_with_engine_shapes(tmp_path):
    """--engine-shapes: the ranks vLLM's CPU MLA kernels take (576-wide latent), DeepSeek's
    YaRN, and (always) the MoE routing keys; transformers loads and runs it."""
    from transformers import AutoModelForCausalLM

    from draftsmith.targets.tinymodel import DEEPSEEK_YARN, make_tiny_target

    path = make_tiny_target(tmp_path / "m", "deepseek_v3", num_layers=2, engine_shapes=True)
    c = json.loads((path / "config.json").read_text())
    assert c["kv_lora_rank"] + c["qk_rope_head_dim"] == 576
    assert c["rope_parameters"] == {"rope_theta": 10000.0, **DEEPSEEK_YARN}
    assert (c["topk_method"], c["scoring_func"], c["moe_layer_freq"]) == ("noaux_tc", "sigmoid", 1)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    assert model(torch.tensor([[1, 5, 9]])).logits.shape == (1, 3, c["vocab_size"])
    plain = json.loads(
        (make_tiny_target(tmp_path / "p", "deepseek_v3", 2) / "config.json").read_text()
    )
    assert plain["kv_lora_rank"] == 16 and plain["topk_method"] == "noaux_tc"
    with pytest.raises(ValueError, match="engine_shapes"):
        make_tiny_target(tmp_path / "l", "llama", 2, engine_shapes=True)
