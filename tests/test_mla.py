"""draft.attention mla: the MLA draft layer (draftsmith.algorithms.eagle3.mla), trained under TTT as it is decoded,
exported in `Eagle3DeepseekV2ForCausalLM`'s contract (draftsmith.algorithms.eagle3.contract_mla) and read
back. Equality with the engines' own classes: tests/test_mla_engines.py."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file, save_file

from draftsmith import algorithms
from draftsmith.algorithms.eagle3 import mla
from draftsmith.algorithms.eagle3.model import (
    DraftConfig,
    Eagle3Draft,
    KVCache,
    TTTCache,
    block_causal_mask,
)
from draftsmith.algorithms.export import ExportError, check_export, export_draft, load_export

ROOT = Path(__file__).resolve().parents[1]
YARN = {
    "rope_type": "yarn",
    "factor": 4.0,
    "original_max_position_embeddings": 512,
    "beta_fast": 32,
    "beta_slow": 1,
    "mscale": 1.0,
    "mscale_all_dim": 1.0,
}
TARGET = {  # a tiny DeepSeek-V3-shaped text config (MLA widths, YaRN as DeepSeek-V3/Kimi)
    "architectures": ["DeepseekV3ForCausalLM"],
    "model_type": "deepseek_v3",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "num_hidden_layers": 4,
    "q_lora_rank": 24,
    "kv_lora_rank": 32,
    "qk_nope_head_dim": 16,
    "qk_rope_head_dim": 8,
    "v_head_dim": 12,
    "vocab_size": 256,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "rope_scaling": YARN,
    "max_position_embeddings": 2048,
    "hidden_act": "silu",
}
VERIFIER = {"name_or_path": "results/target", "architectures": ["DeepseekV3ForCausalLM"]}


def tiny_mla(seed: int = 0, algorithm: str = "eagle3", target: dict | None = None) -> Eagle3Draft:
    """A random tiny MLA draft of TARGET (non-trivial norms, a 64-token draft vocabulary)."""
    cfg = DraftConfig.from_target_config(
        target or TARGET, 64, [1, 2, 3], attention="mla", spec=algorithms.get(algorithm)
    )
    torch.manual_seed(seed)
    draft = Eagle3Draft(cfg)
    with torch.no_grad():
        for name, p in draft.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    hot = torch.sort(torch.randperm(cfg.vocab_size)[: cfg.draft_vocab_size]).values
    t2d = torch.zeros(cfg.vocab_size, dtype=torch.bool)
    t2d[hot] = True
    draft.set_vocab(hot - torch.arange(cfg.draft_vocab_size), t2d)
    return draft.eval()


def export(draft, out: Path) -> Path:
    c = draft.config
    export_draft(
        draft, out, {}, embed=torch.randn(c.vocab_size, c.target_hidden_size), verifier=VERIFIER
    )
    return out


# ---------------------------------------------------------------------------------------------
# The switch and the config


def test_schema_switch_defaults_to_llama_and_stales_nothing():
    from draftsmith.config.checks import neutral_defaults, sections_json

    schema = yaml.safe_load((ROOT / "draftsmith" / "config" / "config.schema.yaml").read_text())
    prop = schema["properties"]["draft"]["properties"]["attention"]
    assert prop["enum"] == ["llama", "mla"] and prop["default"] == "llama"
    neutral = neutral_defaults(schema)
    draft = {"vocab_size": 4096, "init_from_target": True, "serve_check": "warn"}
    before = sections_json({"draft": draft}, ["draft"], neutral=neutral)
    assert sections_json(
        {"draft": {**draft, "attention": "llama"}}, ["draft"], neutral=neutral
    ) == (before)
    now = sections_json({"draft": {**draft, "attention": "mla"}}, ["draft"], neutral=neutral)
    assert json.loads(now)["draft"]["attention"] == "mla"


def test_mla_dims_and_rope_come_from_the_target():
    cfg = tiny_mla().config
    assert cfg.attention == "mla" and cfg.mla == {k: TARGET[k] for k in mla.KEYS}
    assert cfg.rope_scaling == YARN and cfg.num_key_value_heads == 4 and cfg.head_dim == 12
    d = cfg.to_dict()
    assert d["attention"] == "mla" and DraftConfig.from_dict(d) == cfg
    llama = DraftConfig.from_target_config(TARGET, 64, [1, 2, 3])
    assert "attention" not in llama.to_dict() and "mla" not in llama.to_dict()  # as before
    assert llama.rope_scaling is None  # the Llama draft does not carry YaRN


def test_shapes_of_the_mla_layer():
    att = tiny_mla().midlayer.self_attn
    shapes = {n: tuple(p.shape) for n, p in att.named_parameters()}
    assert shapes == {
        "q_a_proj.weight": (24, 128),
        "q_a_layernorm.weight": (24,),
        "q_b_proj.weight": (4 * (16 + 8), 24),
        "kv_a_proj_with_mqa.weight": (32 + 8, 128),
        "kv_a_layernorm.weight": (32,),
        "kv_b_proj.weight": (4 * (16 + 12), 32),
        "o_proj.weight": (64, 4 * 12),
    }
    out = tiny_mla().step(torch.randn(2, 5, 64), torch.randn(2, 5, 64), torch.arange(5)[None])
    assert out.shape == (2, 5, 64)


def test_refusals():
    llama_target = {k: v for k, v in TARGET.items() if k not in mla.KEYS}
    llama_target.update(model_type="llama", architectures=["LlamaForCausalLM"])
    with pytest.raises(mla.MLAError, match=r"no MLA fields \['q_lora_rank', 'kv_lora_rank'"):
        DraftConfig.from_target_config(llama_target, 64, [1, 2, 3], attention="mla")
    with pytest.raises(mla.MLAError, match=r"no MLA fields \['q_lora_rank'\]"):
        DraftConfig.from_target_config({**TARGET, "q_lora_rank": None}, 64, [1], attention="mla")
    longrope = {**TARGET, "rope_scaling": {"rope_type": "longrope", "factor": 2.0}}
    with pytest.raises(mla.MLAError, match="'longrope'"):
        DraftConfig.from_target_config(longrope, 64, [1, 2, 3], attention="mla")
    cfg = tiny_mla().config.to_dict()
    with pytest.raises(mla.MLAError, match="attn_factor"):
        DraftConfig(**{**cfg, "rope_scaling": {**YARN, "attn_factor": 2.0}})
    with pytest.raises(mla.MLAError, match="needs mla ="):
        DraftConfig(**{**cfg, "mla": None})
    with pytest.raises(ValueError, match="'mqa' is not one of llama, mla"):
        DraftConfig(**{**cfg, "attention": "mqa"})


def test_yarn_frequencies_and_scale_are_deepseeks():
    """YaRN inverse frequencies as transformers computes them for this config, cos/sin scaled
    by mscale/mscale_all_dim (1 here) and the softmax scale by mscale_all_dim's mscale^2."""
    from transformers import DeepseekV3Config
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    kw = {k: v for k, v in TARGET.items() if k != "architectures"}
    hf = DeepseekV3Config(**{**kw, "rope_scaling": dict(YARN)})  # transformers edits the dict
    hf.head_dim = TARGET["qk_rope_head_dim"]
    want, _ = ROPE_INIT_FUNCTIONS["yarn"](hf, "cpu")
    att = tiny_mla().midlayer.self_attn
    torch.testing.assert_close(att.rotary.inv_freq, want.float())
    m = 0.1 * math.log(4.0) + 1.0
    assert att.q_factor == pytest.approx(m * m)
    assert mla.softmax_scale(tiny_mla().config) == pytest.approx((16 + 8) ** -0.5 * m * m)
    plain = tiny_mla(target={**TARGET, "rope_scaling": None}).midlayer.self_attn
    assert plain.q_factor == 1.0 and plain.rotary.mscale == 1.0


# ---------------------------------------------------------------------------------------------
# The attention: the absorbed (latent-cache) form, TTT, the decoder


@torch.no_grad()
def absorbed_attention(att, x, pos):
    """What the engines run: cache only the normed latent c and the roped k_pe per position;
    fold kv_b_proj's key half into the query and its value half after the attention."""
    b, t, _ = x.shape
    nh, nope, rope, vd, kl = att.nh, att.nope, att.rope, att.vd, att.kv_lora
    q = att.q_b_proj(att.q_a_layernorm(att.q_a_proj(x))).view(b, t, nh, nope + rope)
    c, k_pe = att.kv_a_proj_with_mqa(x).split([kl, rope], -1)
    c = att.kv_a_layernorm(c)  # [b, t, kl]: the cache, with k_pe
    q_pe = att.rotary(q[..., nope:].transpose(1, 2), pos)  # [b, nh, t, rope]
    k_pe = att.rotary(k_pe[:, None], pos)[:, 0]  # [b, t, rope]
    w = att.kv_b_proj.weight.view(nh, nope + vd, kl)
    w_kc, w_vc = w[:, :nope], w[:, nope:]  # [nh, nope, kl], [nh, vd, kl]
    q_lat = torch.einsum("bthn,hnk->bhtk", q[..., :nope], w_kc)
    scores = q_lat @ c[:, None].transpose(-1, -2) + q_pe @ k_pe[:, None].transpose(-1, -2)
    scores = scores * (nope + rope) ** -0.5 * att.q_factor
    causal = torch.ones(t, t, dtype=torch.bool).tril()
    p = torch.softmax(scores.masked_fill(~causal, float("-inf")), -1)
    lat = p @ c[:, None]  # [b, nh, t, kl]
    out = torch.einsum("bhtk,hvk->bthv", lat, w_vc).reshape(b, t, nh * vd)
    return att.o_proj(out)


@torch.no_grad()
def test_decompressed_attention_equals_the_absorbed_form():
    from draftsmith.algorithms.eagle3.model import CausalAttention

    att = tiny_mla(seed=1).midlayer.self_attn
    x = torch.randn(2, 9, 128, generator=torch.Generator().manual_seed(2))
    pos = torch.arange(100, 109)[None].expand(2, 9)
    torch.testing.assert_close(
        att(x, pos, CausalAttention()), absorbed_attention(att, x, pos), rtol=1e-5, atol=1e-5
    )


@pytest.mark.parametrize("algorithm", ["eagle3", "eagle3.1"])
@torch.no_grad()
def test_ttt_steps_equal_the_decoders_chain(algorithm):
    """The TTT unroll (TTTCache) at the last position equals the in-process decoder's chain
    (KVCache, DraftRunner's path), step by step, with MLA's wider keys than values."""
    draft = tiny_mla(seed=2, algorithm=algorithm)
    c = draft.config
    g = torch.Generator().manual_seed(3)
    t, steps = 7, 3
    aux = torch.randn(1, t, c.num_aux * c.target_hidden_size, generator=g)
    emb = torch.randn(1, t + steps, c.hidden_size, generator=g)
    cache = TTTCache(block_causal_mask(torch.zeros(1, t, dtype=torch.long)))
    hidden, ttt = draft.project(aux), []
    for j in range(steps):
        out = draft.step(emb[:, j : j + t], hidden, torch.arange(j, j + t)[None], cache)
        ttt.append(draft.logits(out[:, -1]))
        hidden = draft.feedback(out)
    kv = KVCache()
    out = draft.step(emb[:, :t], draft.project(aux), torch.arange(t)[None], kv)[:, -1:]
    chain = [draft.logits(out[:, -1])]
    for j in range(1, steps):
        out = draft.step(
            emb[:, t - 1 + j : t + j], draft.feedback(out), torch.tensor([[t - 1 + j]]), kv
        )
        chain.append(draft.logits(out[:, -1]))
    for j in range(steps):
        torch.testing.assert_close(ttt[j], chain[j], rtol=1e-5, atol=1e-5)


@torch.no_grad()
def test_the_decoder_runs_an_mla_draft():
    """draftsmith.bench.specdec.DraftRunner proposes with an MLA draft exactly the argmax chain
    recomputed without a cache."""
    from draftsmith.algorithms.eagle3.decode import DraftRunner

    draft = tiny_mla(seed=8, algorithm="eagle3.1")
    c = draft.config
    embed = torch.nn.Embedding(c.vocab_size, c.hidden_size)
    g = torch.Generator().manual_seed(9)
    t, k = 6, 4
    aux = torch.randn(t, c.num_aux * c.target_hidden_size, generator=g) * 3
    tokens = torch.randint(0, c.vocab_size, (t,), generator=g).tolist()
    runner = DraftRunner(draft, embed, [1, 2, 3])
    runner.extend(tokens, aux)
    props = runner.propose(k)
    ids, first, outs, want = list(tokens), draft.project(aux[None]), [], []
    for j in range(k):
        hidden = torch.cat([first, *[draft.feedback(h) for h in outs]], 1)
        full = draft.step(embed(torch.tensor([ids])), hidden, torch.arange(t + j)[None])
        outs = [full[:, t - 1 + i : t + i] for i in range(j + 1)]
        tok = int(draft.draft_to_target(draft.logits(full[0, -1]).argmax()))
        want.append(tok)
        ids.append(tok)
    assert props == want


# ---------------------------------------------------------------------------------------------
# Export and its contract


@pytest.mark.parametrize("algorithm", ["eagle3", "eagle3.1"])
@torch.no_grad()
def test_export_round_trip(algorithm, tmp_path):
    draft = tiny_mla(seed=4, algorithm=algorithm)
    out = export(draft, tmp_path / "draft")
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["Eagle3DeepseekV2ForCausalLM"]
    assert cfg["model_type"] == "deepseek_v2" and cfg["rope_interleave"] is True
    assert {k: cfg[k] for k in mla.KEYS} == {k: TARGET[k] for k in mla.KEYS}
    assert cfg["rope_scaling"] == YARN and cfg["num_hidden_layers"] == 1
    assert cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 2, 3]
    assert cfg["eagle_aux_hidden_state_layer_ids"] == [2, 3, 4]
    assert bool(cfg.get("fc_norm")) == bool(cfg.get("norm_output")) == (algorithm == "eagle3.1")
    names = set(load_file(str(out / "model.safetensors")))
    attn = {"q_a_proj", "q_a_layernorm", "q_b_proj", "kv_a_proj_with_mqa", "kv_a_layernorm"}
    assert {f"midlayer.self_attn.{n}.weight" for n in attn | {"kv_b_proj", "o_proj"}} <= names
    assert not any("embed" in n for n in names)
    assert not (out / "speculators").exists()  # speculators has no MLA draft
    back = load_export(out)
    assert back.config == draft.config
    for k, v in draft.state_dict().items():
        assert torch.equal(back.state_dict()[k], v), k
    x = torch.randn(1, 5, 64)
    torch.testing.assert_close(
        back.step(x, x, torch.arange(5)[None]), draft.step(x, x, torch.arange(5)[None])
    )


def test_contract_refusals(tmp_path):
    from draftsmith.algorithms.export import main

    good = export(tiny_mla(seed=5, algorithm="eagle3.1"), tmp_path / "good")
    main(["check", str(good)])
    w = load_file(str(good / "model.safetensors"))
    c = json.loads((good / "config.json").read_text())

    def variant(name, tensors, cfg):
        d = tmp_path / name
        d.mkdir()
        save_file(tensors, str(d / "model.safetensors"))
        (d / "config.json").write_text(json.dumps(cfg))
        return d

    renamed = {k.replace("midlayer.", "layers.0."): v for k, v in w.items()}
    check_export(variant("layers0", renamed, c))  # SGLang maps layers.0. to midlayer. itself
    with pytest.raises(ExportError, match="model_type is 'deepseek_v3'"):
        check_export(variant("v3", w, {**c, "model_type": "deepseek_v3"}))
    no_rank = {k: v for k, v in c.items() if k != "kv_lora_rank"}
    with pytest.raises(ExportError, match="kv_lora_rank is None: every MLA width"):
        check_export(variant("no_rank", w, no_rank))
    with pytest.raises(ExportError, match="rope_interleave is False"):
        check_export(variant("neox", w, {**c, "rope_interleave": False}))
    half = {k: v for k, v in w.items() if "kv_a_proj_with_mqa" not in k}
    with pytest.raises(ExportError, match=r"fused_qkv_a_proj_with_mqa.weight is not .*\['kv'\]"):
        check_export(variant("half_fused", half, c))
    odd = {**w, "midlayer.self_attn.q_proj.weight": torch.zeros(96, 128)}
    with pytest.raises(ExportError, match="q_proj.weight .*SGLang's loader would skip it"):
        check_export(variant("q_proj", odd, c))
    short = {**w, "midlayer.self_attn.kv_b_proj.weight": torch.zeros(100, 32)}
    with pytest.raises(ExportError, match=r"kv_b_proj.weight is \[100, 32\]"):
        check_export(variant("short", short, c))
    with pytest.raises(ExportError, match="norm_output is None: an EAGLE-3.1 draft"):
        check_export(variant("half_31", w, {k: v for k, v in c.items() if k != "norm_output"}))
    (variant("spec", w, c) / "speculators").mkdir()
    with pytest.raises(ExportError, match="Eagle3DeepseekV2ForCausalLM draft has no speculators"):
        check_export(tmp_path / "spec")


# ---------------------------------------------------------------------------------------------
# Training


def test_training_an_mla_draft_on_a_deepseek_v3_target(tmp_path):
    """The train CLI with draft.attention mla, on a target whose config.json is the tiny
    DeepSeek-V3 of `draftsmith.targets.tinymodel --arch deepseek_v3` (with YaRN) at the synthetic
    shards' widths: the loss drops, the export passes the MLA contract and reads back."""
    from test_train import TRAIN, make_inputs, read_metrics, train_args

    from draftsmith.stages.train import main
    from draftsmith.targets.tinymodel import make_tiny_target

    inputs = make_inputs(tmp_path / "in", n_shards=1, rows=12, aux_ids=[1, 2, 4])
    ours = json.loads((inputs["target"] / "config.json").read_text())
    tiny = json.loads(
        (make_tiny_target(tmp_path / "dsv3", "deepseek_v3", 2, 32) / "config.json").read_text()
    )
    assert tiny["model_type"] == "deepseek_v3" and tiny["kv_lora_rank"] > 0
    tiny.update(vocab_size=ours["vocab_size"], num_hidden_layers=ours["num_hidden_layers"])
    tiny.update(
        rope_scaling={**YARN, "original_max_position_embeddings": 64}, tie_word_embeddings=True
    )
    tiny.pop("rope_parameters", None)
    (inputs["target"] / "config.json").write_text(json.dumps(tiny))
    cfg = {
        "train": {**TRAIN, "epochs": 4, "checkpoint_every": 0},
        "draft": {"vocab_size": 48, "init_from_target": True, "attention": "mla"},
        # SGLang's deepseek_v2.py adds 1 only when the first id is 1 (draftsmith.targets.layerids)
        "capture": {"aux_layer_ids": [1, 2, 4]},
    }
    torch.set_num_threads(1)
    main(train_args(inputs, tmp_path / "run", json.dumps(cfg)))
    draft = tmp_path / "run" / "draft"
    check_export(draft)
    back = load_export(draft)
    assert (
        back.config.attention == "mla" and back.config.mla["kv_lora_rank"] == tiny["kv_lora_rank"]
    )
    assert back.config.rope_scaling["rope_type"] == "yarn"
    prov = json.loads((draft / "draftsmith_draft.json").read_text())
    rope = [w for w in prov["target_family"]["warnings"] if w.startswith("RoPE")]
    assert not rope, rope  # the MLA draft carries the target's YaRN: nothing to warn about
    losses = [m["loss"] for m in read_metrics(tmp_path / "run" / "metrics.jsonl")]
    assert all(math.isfinite(x) for x in losses)
    first, last = sum(losses[:3]) / 3, sum(losses[-3:]) / 3
    assert last < 0.8 * first, (first, last)


def test_training_refuses_mla_for_a_target_without_mla_fields(tmp_path):
    from test_train import TRAIN, make_inputs, train_args

    from draftsmith.stages.train import main

    inputs = make_inputs(tmp_path / "in", n_shards=1, rows=4)  # a Llama target
    cfg = {
        "train": {**TRAIN, "max_steps": 1},
        "draft": {"vocab_size": 48, "init_from_target": True, "attention": "mla"},
        "capture": {"aux_layer_ids": "auto"},
    }
    with pytest.raises(SystemExit, match=r"LlamaForCausalLM, model_type 'llama'\) has no MLA"):
        main(train_args(inputs, tmp_path / "run", json.dumps(cfg)))
    assert not (tmp_path / "run" / "draft").exists()


@pytest.mark.workflow
def test_workflow_plans_an_mla_draft_and_the_default_value_changes_no_command():
    from test_algorithms import train_command

    default = train_command()
    assert "attention" not in default
    assert train_command('draft={"attention": "llama"}') == default
    new = train_command('draft={"attention": "mla"}')
    assert '"attention": "mla"' in new and new != default
