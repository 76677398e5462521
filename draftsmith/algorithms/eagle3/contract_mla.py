"""The MLA draft's contract with SGLang's `Eagle3DeepseekV2ForCausalLM` loader (also vLLM's):
the config.json the export writes for `draft.attention: mla`, its inverse, and the checks of a
config and of the tensor names and shapes against the parameters that loader fills.

Read from the pinned wheels: SGLang 0.5.23 `srt/models/kimi_k25_eagle3.py`, vLLM 0.32
`model_executor/models/deepseek_eagle3.py`.

- `model_type` is `deepseek_v2`, not `deepseek_v3`: vLLM rewrites every deepseek_v3 draft config
  to its MTP draft (`deepseek_mtp`), which has no EAGLE-3 class. transformers' DeepseekV2Config
  fills any MLA key left out with DeepSeek's own widths, so every one is written.
- `rope_interleave: true`: SGLang's MLA applies RoPE to interleaved pairs unless it is false;
  vLLM's always does. RoPE stays in `rope_theta` / `rope_scaling` (YaRN or none).
- `num_hidden_layers` must be 1 (SGLang); the MLP is dense in both engines.
- Tensors: `midlayer.*` (SGLang maps a leading `layers.0.` to `midlayer.`, vLLM `midlayer.` to
  `layers.0.`), `self_attn.{q_a_proj, q_a_layernorm, q_b_proj, kv_a_proj_with_mqa,
  kv_a_layernorm, kv_b_proj, o_proj}`, `mlp.{gate,up,down}_proj`, the three layer norms, `fc`,
  `fc_norm.{i}` (eagle3.1), `norm`, `lm_head`, `d2t` / `t2d` (t2d is ignored by both). SGLang
  fuses q_a_proj and kv_a_proj_with_mqa into `fused_qkv_a_proj_with_mqa` only once both have
  arrived and silently skips any name it does not know, so `check_tensors` replays that.

Aux layer ids are written as for the Llama draft (draftsmith.algorithms.eagle3.contract): SGLang's in
`eagle_config`, vLLM's (+1) at the top level. No speculators copy: speculators has no MLA draft.

Pure functions over dicts (no I/O); draftsmith.algorithms.export writes and reads the files.
"""

from __future__ import annotations

import re

import draftsmith.algorithms.eagle3.mla as mla
from draftsmith.algorithms.eagle3.contract import (
    ContractError,
    draft_config,
    eagle3_config,
    replay_loader,
    switch_params,
    vllm_layer_ids,
)
from draftsmith.algorithms.eagle3.model import DraftConfig
from draftsmith.algorithms.spec import AlgorithmSpec

ARCH = "Eagle3DeepseekV2ForCausalLM"
SPECULATORS = False
FUSED_A = "self_attn.fused_qkv_a_proj_with_mqa.weight"


def is_mla(c: dict) -> bool:
    """An exported config.json of this contract (told from its architecture)."""
    return ARCH in (c.get("architectures") or [])


def sglang_config(cfg: DraftConfig) -> dict:
    """The MLA draft's config.json (DeepSeek-V2 fields + EAGLE-3 keys + its algorithm's)."""
    heads = {
        "num_key_value_heads": cfg.num_attention_heads,
        **{k: cfg.mla[k] for k in mla.KEYS},
        "rope_interleave": True,
    }
    return eagle3_config(cfg, ARCH, "deepseek_v2", heads, {"attention_bias": False})


def config_from_sglang(c: dict, spec: AlgorithmSpec) -> DraftConfig:
    """Inverse of `sglang_config` for a draft of algorithm `spec` (its name and switches;
    checks the contract keys on the way)."""
    problems = config_problems(c)
    if problems:
        raise ContractError("; ".join(problems))
    return draft_config(
        c,
        spec,
        num_key_value_heads=c["num_attention_heads"],
        head_dim=c["v_head_dim"],
        attention="mla",
        mla={k: c[k] for k in mla.KEYS},
    )


def config_problems(c: dict) -> list[str]:
    want = {
        "architectures": [ARCH],
        "model_type": "deepseek_v2",
        "num_hidden_layers": 1,
        "tie_word_embeddings": False,
        "hidden_act": "silu",
        "rope_interleave": True,
        "norm_before_residual": False,
    }
    out = [
        f"config.json {k} is {c.get(k)!r}, the MLA draft needs {v!r}"
        for k, v in want.items()
        if c.get(k) != v
    ]
    need = ("hidden_size", "intermediate_size", "num_attention_heads", "rms_norm_eps")
    need += ("vocab_size", "draft_vocab_size", "rope_theta", "max_position_embeddings")
    out += [f"config.json has no {k!r}" for k in need if k not in c]
    out += [
        f"config.json {k} is {c.get(k)!r}: every MLA width must be written as a positive int "
        "(transformers' DeepseekV2Config would fill in DeepSeek-V2's own)"
        for k in mla.KEYS
        if not (isinstance(c.get(k), int) and c[k] > 0)
    ]
    if c.get("num_key_value_heads", c.get("num_attention_heads")) != c.get("num_attention_heads"):
        out.append("config.json num_key_value_heads must equal num_attention_heads (MLA)")
    s = c.get("rope_scaling")
    kind = None if s is None else str(s.get("rope_type", s.get("type")))
    if s is not None and (kind != "yarn" or set(s) - mla.YARN_KEYS or "factor" not in s):
        out.append(f"config.json rope_scaling {s!r}: the MLA draft takes none or DeepSeek's yarn")
    if c.get("rope_parameters") is not None:
        out.append("config.json has rope_parameters: the MLA draft writes rope_theta/rope_scaling")
    ids = (c.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    if not (isinstance(ids, list) and ids and all(isinstance(i, int) for i in ids)):
        out.append(f"config.json eagle_config.eagle_aux_hidden_state_layer_ids is {ids!r}")
    elif c.get("eagle_aux_hidden_state_layer_ids") != vllm_layer_ids(ids):
        out.append(
            f"config.json eagle_aux_hidden_state_layer_ids is "
            f"{c.get('eagle_aux_hidden_state_layer_ids')!r}: vLLM reads it first and needs the "
            f"SGLang ids + 1, {vllm_layer_ids(ids)}"
        )
    if (c.get("eagle_config") or {}).get("use_aux_hidden_state") is not True:
        out.append("config.json eagle_config.use_aux_hidden_state must be true")
    return out


def sglang_params(c: dict) -> dict[str, tuple]:
    """Parameter name -> shape of SGLang's Eagle3DeepseekV2ForCausalLM (TP 1) for `c`."""
    h, i, nh = c["hidden_size"], c["intermediate_size"], c["num_attention_heads"]
    ql, kl = c["q_lora_rank"], c["kv_lora_rank"]
    nope, rope, v = c["qk_nope_head_dim"], c["qk_rope_head_dim"], c["v_head_dim"]
    n_aux = len(c["eagle_config"]["eagle_aux_hidden_state_layer_ids"])
    p = "model.midlayer."
    return {
        "model.embed_tokens.weight": (c["vocab_size"], h),
        "model.fc.weight": (h, c.get("target_hidden_size", h) * n_aux),
        p + FUSED_A: (ql + kl + rope, 2 * h),
        p + "self_attn.q_a_layernorm.weight": (ql,),
        p + "self_attn.q_b_proj.weight": (nh * (nope + rope), ql),
        p + "self_attn.kv_a_layernorm.weight": (kl,),
        p + "self_attn.kv_b_proj.weight": (nh * (nope + v), kl),
        p + "self_attn.o_proj.weight": (h, nh * v),
        p + "mlp.gate_up_proj.weight": (2 * i, h),
        p + "mlp.down_proj.weight": (h, i),
        p + "input_layernorm.weight": (h,),
        p + "hidden_norm.weight": (h,),
        p + "post_attention_layernorm.weight": (h,),
        "model.norm.weight": (h,),
        "lm_head.weight": (c["draft_vocab_size"], h),
        **switch_params(c),
    }


def sglang_destination(name: str, params: dict) -> tuple[str, object] | None:
    """Where SGLang's load_weights puts checkpoint tensor `name`: (param, shard) or None."""
    if name in ("d2t", "t2d") or name.endswith((".d2t", ".t2d")):
        return name.rsplit(".", 1)[-1], None
    mapped = re.sub(r"^layers\.0\.", "midlayer.", name)
    if not mapped.startswith("lm_head."):
        mapped = f"model.{mapped}"
    for fused, part, shard in (
        (".gate_up_proj", ".gate_proj", 0),
        (".gate_up_proj", ".up_proj", 1),
    ):
        if part in mapped and mapped.replace(part, fused) in params:
            return mapped.replace(part, fused), shard
    for part, shard in (("kv_a_proj_with_mqa", "kv"), ("q_a_proj", "q")):
        if part in mapped:
            fused = mapped.replace(part, "fused_qkv_a_proj_with_mqa")
            return (fused, shard) if fused in params else None
    return (mapped, None) if mapped in params else None


def _shard_shape(c: dict, shard) -> tuple:
    two_h = 2 * c["hidden_size"]
    if shard == "q":
        return (c["q_lora_rank"], two_h)
    if shard == "kv":
        return (c["kv_lora_rank"] + c["qk_rope_head_dim"], two_h)
    return (c["intermediate_size"], c["hidden_size"])


def check_tensors(c: dict, tensors: dict[str, tuple[tuple, str]]) -> list[str]:
    """Problems with {name: (shape, safetensors dtype tag)} against what SGLang consumes."""
    fused = {
        "model.midlayer." + FUSED_A: {"q", "kv"},
        "model.midlayer.mlp.gate_up_proj.weight": {0, 1},
    }
    return replay_loader(
        c,
        tensors,
        sglang_params(c),
        sglang_destination,
        lambda _param, shard: _shard_shape(c, shard),
        fused,
    )
