"""draft.init_layer_from_target (draftsmith.algorithms.eagle3.warmstart): the draft's decoder
layer copied from the target layer after the deepest aux state, what is refused, and the key's
default leaving the train job's params as they were."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import yaml
from safetensors import safe_open

from draftsmith import algorithms
from draftsmith.algorithms.eagle3 import warmstart
from draftsmith.algorithms.eagle3.model import DraftConfig, Eagle3Draft

ROOT = Path(__file__).resolve().parents[1]
SCHEMA = yaml.safe_load((ROOT / "draftsmith" / "config" / "config.schema.yaml").read_text())


def target_layer(target: Path, index: int) -> dict[str, torch.Tensor]:
    prefix = f"model.layers.{index}."
    with safe_open(str(target / "model.safetensors"), framework="pt") as f:
        return {k.removeprefix(prefix): f.get_tensor(k) for k in f.keys() if k.startswith(prefix)}


def draft_for(target: Path, aux_ids, algorithm="eagle3", **over) -> Eagle3Draft:
    cfg = json.loads((target / "config.json").read_text())
    dcfg = DraftConfig.from_target_config(cfg, 32, aux_ids, spec=algorithms.get(algorithm))
    for k, v in over.items():
        setattr(dcfg, k, v)
    torch.manual_seed(0)
    return Eagle3Draft(dcfg)


@pytest.mark.parametrize(("aux_ids", "source"), [([1, 2, 3], 4), ([3, 1, 5], 5), ([0, 2, 4], 5)])
def test_source_is_the_layer_after_the_deepest_aux_state(aux_ids, source):
    assert warmstart.source_layer(aux_ids, 6) == source


@pytest.mark.parametrize("algorithm", ["eagle3", "eagle3.1"])
def test_layer_copied_as_specified(tiny_target: Path, algorithm: str):
    aux = [3, 1, 2]  # the deepest (3) is the first block of fc
    draft = draft_for(tiny_target, aux, algorithm)
    before = {k: v.clone() for k, v in draft.state_dict().items()}
    cfg = json.loads((tiny_target / "config.json").read_text())
    index, pieces = warmstart.read_source(tiny_target, cfg, aux)
    assert index == 4
    warmstart.init_layer(draft, index, pieces, cfg)
    want = target_layer(tiny_target, 4)
    mid = dict(draft.midlayer.named_parameters())
    h = draft.config.hidden_size
    for name in ("self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"):
        torch.testing.assert_close(mid[f"{name}.weight"], want[f"{name}.weight"].float())
    for name in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"):
        w = mid[f"{name}.weight"]
        torch.testing.assert_close(w[:, h:], want[f"{name}.weight"].float())  # hidden half
        torch.testing.assert_close(w[:, :h], before[f"midlayer.{name}.weight"][:, :h])  # as is
    torch.testing.assert_close(mid["hidden_norm.weight"], want["input_layernorm.weight"])
    torch.testing.assert_close(
        mid["post_attention_layernorm.weight"], want["post_attention_layernorm.weight"]
    )
    torch.testing.assert_close(
        mid["input_layernorm.weight"], before["midlayer.input_layernorm.weight"]
    )
    fc = draft.fc.weight
    torch.testing.assert_close(fc[:, :h], torch.eye(h))
    assert not fc[:, h:].any()
    for k in ("lm_head.weight", "norm.weight", "d2t", "t2d"):
        torch.testing.assert_close(draft.state_dict()[k], before[k])
    if algorithm == "eagle3.1":
        assert all(bool((n.weight == 1).all()) for n in draft.fc_norm)
    # step 0's hidden state is the deepest aux state itself
    aux_states = torch.randn(1, 3, 3 * h)
    torch.testing.assert_close(draft.fc(aux_states), aux_states[..., :h])


def test_refusals_name_the_key_and_why(tiny_target: Path):
    cfg = json.loads((tiny_target / "config.json").read_text())
    index, pieces = warmstart.read_source(tiny_target, cfg, [1, 2, 3])
    wider = draft_for(tiny_target, [1, 2, 3], intermediate_size=cfg["intermediate_size"] * 2)
    with pytest.raises(ValueError, match=r"draft.init_layer_from_target: .*mlp.gate_proj"):
        warmstart.init_layer(Eagle3Draft(wider.config), index, pieces, cfg)
    draft = draft_for(tiny_target, [1, 2, 3])
    no_mlp = {k: v for k, v in pieces.items() if not k.startswith("mlp.")}
    with pytest.raises(ValueError, match=r"draft.init_layer_from_target: target layer 4 has no"):
        warmstart.init_layer(draft, index, no_mlp, cfg)
    gemma = {**pieces, "pre_feedforward_layernorm.weight": pieces["input_layernorm.weight"]}
    with pytest.raises(ValueError, match="norms the draft layer does not compute"):
        warmstart.init_layer(draft, index, gemma, cfg)
    draft.config.attention = "mla"
    with pytest.raises(ValueError, match="draft.attention mla"):
        warmstart.init_layer(draft, index, pieces, cfg)


def test_dflash_refuses_the_key_at_parse_time():
    cfg = {"draft": {"algorithm": "dflash", "init_layer_from_target": True}}
    (problem,) = algorithms.setting_problems(cfg, SCHEMA)
    assert "draft.init_layer_from_target True" in problem and "DFlash" in problem
    assert algorithms.setting_problems({"draft": {"algorithm": "dflash"}}, SCHEMA) == []
    off = {"draft": {"algorithm": "dflash", "init_layer_from_target": False}}
    assert algorithms.setting_problems(off, SCHEMA) == []


def test_the_default_stales_nothing():
    """At its default (false) the key is not in the train job's params: the commands planned
    are those of a config without it; true is in them."""
    from draftsmith.config.checks import neutral_defaults, sections_json

    neutral = neutral_defaults(SCHEMA)
    assert neutral["draft"]["init_layer_from_target"] is False
    draft = {"vocab_size": 4096, "init_from_target": True, "serve_check": "warn"}
    before = sections_json({"draft": draft}, ["draft"], neutral=neutral)
    off = {"draft": {**draft, "init_layer_from_target": False}}
    assert sections_json(off, ["draft"], neutral=neutral) == before
    on = {"draft": {**draft, "init_layer_from_target": True}}
    assert json.loads(sections_json(on, ["draft"], neutral=neutral))["draft"][
        "init_layer_from_target"
    ]


def test_build_draft_reads_the_target_only_when_asked(tiny_target: Path):
    """The trainer's build_draft (through the loop's) copies the layer with the key on and
    builds the draft of before with it off."""
    from draftsmith.config.settings import job
    from draftsmith.train.loop import build_draft

    cfg = json.loads((tiny_target / "config.json").read_text())
    vocab = int(cfg["vocab_size"])
    inputs = SimpleNamespace(
        algorithm=algorithms.get("eagle3"),
        target_cfg=cfg,
        aux_ids=[1, 2, 3],
        d2t=torch.zeros(32, dtype=torch.long),
        t2d=torch.arange(vocab) < 32,
        heads={},
        target_dir=tiny_target,
    )
    drafts = {}
    for on in (False, True):
        settings = {
            "draft": {"vocab_size": 32, "init_from_target": False, "init_layer_from_target": on},
            "train": {"seed": 0},
        }
        drafts[on], _ = build_draft(job(settings, ("train", "draft")), inputs, torch.device("cpu"))
    want = target_layer(tiny_target, 4)["mlp.down_proj.weight"].float()
    torch.testing.assert_close(drafts[True].midlayer.mlp.down_proj.weight, want)
    assert not torch.equal(drafts[False].midlayer.mlp.down_proj.weight, want)
    dflash = SimpleNamespace(**{**inputs.__dict__, "algorithm": algorithms.get("dflash")})
    settings["draft"]["algorithm"] = "dflash"
    with pytest.raises(SystemExit, match="draft.init_layer_from_target: .*DFlash"):
        build_draft(job(settings, ("train", "draft")), dflash, torch.device("cpu"))
