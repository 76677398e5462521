"""Export a DFlash draft as vLLM 0.32 loads `DFlashDraftModel`, its contract check, load back.

`results/draft/`:
    config.json          DFlashDraftModel, model_type qwen3, dflash_config
    model.safetensors    fc, hidden_norm, layers.{i}.*, norm (fp32; no embed_tokens, no lm_head:
                         vLLM shares the target's when the checkpoint has none)
    draftsmith_draft.json provenance

Layer ids. Our manifests number aux states as output-of-layer ids (SGLang's, HF
`hidden_states[i + 1]`), and `dflash_config.target_layer_ids` uses the same numbering: SGLang
reads it as is, vLLM adds 1 (its aux ids are input-of-layer ids) unless a top-level
`eagle_aux_hidden_state_layer_ids` exists, which it then reads instead. We write no top-level
key, and the check refuses one that is not `target_layer_ids + 1`. The ids must increase: both
engines concatenate the aux states in layer order, and so did training.

The check refuses every config.json key with which vLLM would run another draft than the one
trained (causal or sliding-window layers, sink bias, value scale, a RoPE other than plain neox,
an own vocabulary, bias terms), and any tensor it would not consume, miss or misshape
(`mask_hidden` is an assert in vLLM's loader).
"""

from __future__ import annotations

import logging
from pathlib import Path

from safetensors import safe_open
from safetensors.torch import load_file, save_file

from draftsmith.algorithms.artifact import PROVENANCE, WEIGHTS, ExportError, read_config
from draftsmith.algorithms.dflash.model import DFlashConfig, DFlashDraft
from draftsmith.algorithms.spec import ALGORITHM_KEY
from draftsmith.runtime.files import atomic_dir, atomic_write_json
from draftsmith.runtime.finite import metrics_problem, nonfinite_tensors

log = logging.getLogger("draftsmith.algorithms.export")
ARCH = "DFlashDraftModel"
CPU_KNORM = (
    "vLLM 0.32 on CPU norms every layer's context keys with layer 0's k_norm weight (its CPU "
    "rms_norm ignores the per-layer weights of precompute_and_store_context_kv): a draft of "
    "more than one layer is served there otherwise than trained (docs/algorithms.md)"
)
# keys that, set to anything but these values, make vLLM serve another draft than ours
MUST = {
    "is_causal": (None, False),
    "layer_types": (None,),
    "attention_bias": (None, False),
    "rope_scaling": (None,),
    "is_neox_style": (None, True),
    "tie_word_embeddings": (None, False),
    "use_sliding_window": (None, False),
}
DFLASH_MUST = {
    "causal": (None, False),
    "use_swa": (None, False),
    "attention_sink_bias": (None, False),
    "attention_value_scale": (None,),
    "use_aux_hidden_state": (None, True),
}


class DFlashExportError(ExportError):
    """The exported DFlash draft is not what vLLM's loader would consume as trained."""


# config.json keys that are DFlashConfig fields of the same name, in config.json's order
FIELDS = (
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "intermediate_size",
    "hidden_act",
    "rms_norm_eps",
    "rope_theta",
    "max_position_embeddings",
    "vocab_size",
    "target_hidden_size",
    "num_target_layers",
)


def config_json(cfg: DFlashConfig) -> dict:
    return {
        "architectures": [ARCH],
        ALGORITHM_KEY: "dflash",
        "model_type": "qwen3",
        **{k: getattr(cfg, k) for k in FIELDS},
        "attention_bias": False,
        "tie_word_embeddings": False,
        "block_size": cfg.block_size,
        "dflash_config": {
            "target_layer_ids": list(cfg.aux_layer_ids),
            "mask_token_id": cfg.mask_token_id,
            "block_size": cfg.block_size,
        },
        "torch_dtype": "float32",
    }


def config_from_json(c: dict) -> DFlashConfig:
    d = c["dflash_config"]
    return DFlashConfig(
        **{k: c[k] for k in FIELDS if k != "target_hidden_size"},
        aux_layer_ids=list(d["target_layer_ids"]),
        target_hidden_size=c.get("target_hidden_size", c["hidden_size"]),
        mask_token_id=d["mask_token_id"],
        block_size=d["block_size"],
    )


def config_problems(c: dict) -> list[str]:
    """What in config.json `c` vLLM would load otherwise than the draft trained here."""
    out = []
    if c.get("architectures") != [ARCH]:
        out.append(f"architectures is {c.get('architectures')!r}, not [{ARCH!r}]")
    d = c.get("dflash_config")
    if not isinstance(d, dict):
        return [*out, "dflash_config is missing"]
    for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "head_dim"):
        if not isinstance(c.get(key), int):
            out.append(f"{key} is missing or not an integer")
    for key in ("target_layer_ids", "mask_token_id", "block_size"):
        if key not in d:
            out.append(f"dflash_config.{key} is missing")
    out += [
        f"{k} is {c[k]!r}: not a draft trained here" for k, ok in MUST.items() if c.get(k) not in ok
    ]
    out += [
        f"dflash_config.{k} is {d[k]!r}: not a draft trained here"
        for k, ok in DFLASH_MUST.items()
        if d.get(k) not in ok
    ]
    ids = d.get("target_layer_ids") or []
    if ids != sorted(set(ids)):
        out.append(
            f"dflash_config.target_layer_ids {ids} must increase (engines concatenate in layer order)"
        )
    n_target = c.get("num_target_layers")
    if isinstance(n_target, int) and any(not 0 <= i < n_target for i in ids):
        out.append(f"dflash_config.target_layer_ids {ids} outside the target's {n_target} layers")
    top = c.get("eagle_aux_hidden_state_layer_ids")
    if top is not None and list(top) != [i + 1 for i in ids]:
        out.append(
            f"eagle_aux_hidden_state_layer_ids {top} overrides vLLM's target_layer_ids + 1 "
            f"({[i + 1 for i in ids]}): vLLM would capture other aux states"
        )
    if c.get("draft_vocab_size") not in (None, c.get("vocab_size")):
        out.append(
            "draft_vocab_size differs from vocab_size: drafts here share the target's lm_head"
        )
    if c.get("target_hidden_size", c.get("hidden_size")) != c.get("hidden_size"):
        out.append("target_hidden_size differs from hidden_size: the target's embedding is shared")
    if d.get("block_size") is not None and c.get("block_size", d["block_size"]) != d["block_size"]:
        out.append("block_size differs from dflash_config.block_size")
    m, v = d.get("mask_token_id"), c.get("vocab_size")
    if not (isinstance(m, int) and isinstance(v, int) and 0 <= m < v):
        out.append(f"dflash_config.mask_token_id {m!r} is not a token id below vocab_size {v!r}")
    return out


def expected_tensors(c: dict) -> dict[str, tuple]:
    h, hd = c["hidden_size"], c["head_dim"]
    nh, nkv, inter = c["num_attention_heads"], c["num_key_value_heads"], c["intermediate_size"]
    n_aux = len(c["dflash_config"]["target_layer_ids"])
    out = {
        "fc.weight": (h, n_aux * c.get("target_hidden_size", h)),
        "hidden_norm.weight": (h,),
        "norm.weight": (h,),
    }
    for i in range(c["num_hidden_layers"]):
        p = f"layers.{i}."
        out |= {
            p + "input_layernorm.weight": (h,),
            p + "post_attention_layernorm.weight": (h,),
            p + "self_attn.q_proj.weight": (nh * hd, h),
            p + "self_attn.k_proj.weight": (nkv * hd, h),
            p + "self_attn.v_proj.weight": (nkv * hd, h),
            p + "self_attn.o_proj.weight": (h, nh * hd),
            p + "self_attn.q_norm.weight": (hd,),
            p + "self_attn.k_norm.weight": (hd,),
            p + "mlp.gate_proj.weight": (inter, h),
            p + "mlp.up_proj.weight": (inter, h),
            p + "mlp.down_proj.weight": (h, inter),
        }
    return out


def check_tensors(c: dict, tensors: dict[str, tuple[tuple, str]]) -> list[str]:
    """Every expected tensor present with its shape in a float dtype, nothing else."""
    want = expected_tensors(c)
    out = [
        f"tensor {k} is not one vLLM's DFlashDraftModel consumes here"
        for k in tensors
        if k not in want
    ]
    for k, shape in want.items():
        if k not in tensors:
            out.append(f"tensor {k} is missing")
        elif tuple(tensors[k][0]) != shape:
            out.append(f"tensor {k} is {list(tensors[k][0])}, needs {list(shape)}")
        elif not tensors[k][1].startswith(("F", "BF")):
            out.append(f"tensor {k} has dtype {tensors[k][1]}, not a float")
    return out


def arch(c: dict) -> str:
    """The architecture config.json `c` is written for, in words."""
    return ARCH


def family_layer_ids(full: dict, cfg: DFlashConfig, facts: dict) -> dict:
    """`facts` as they are: the check reads the draft's ids from its config.json (layer_ids)."""
    return facts


def check_export(out_dir, metrics=None, *, spec=None) -> None:
    """Raise DFlashExportError listing every way `out_dir` breaks the contract, holds
    non-finite weights, or (with `metrics`, when it exists) ends a non-finite run. `spec`: the
    dispatcher's (draftsmith.algorithms.export), unused: one algorithm writes this format."""
    out = Path(out_dir)
    cfg_path, w_path = out / "config.json", out / WEIGHTS
    for p in (cfg_path, w_path):
        if not p.is_file():
            raise DFlashExportError(f"{p} is missing")
    c = read_config(cfg_path, DFlashExportError)
    problems = config_problems(c)
    if not problems:
        with safe_open(str(w_path), framework="pt") as f:
            tensors = {
                k: (f.get_slice(k).get_shape(), f.get_slice(k).get_dtype()) for k in f.keys()
            }
        problems = check_tensors(c, tensors)
    if not problems:
        problems = [f"{w_path}: {b}" for b in nonfinite_tensors(w_path)]
    if not problems and metrics is not None and Path(metrics).is_file():
        problems += [p for p in [metrics_problem(metrics)] if p]
    if problems:
        raise DFlashExportError(f"{out}: not a valid {ARCH} draft:\n  " + "\n  ".join(problems))


def export_draft(
    draft: DFlashDraft,
    out_dir,
    provenance: dict,
    family: dict | None = None,
    *,
    spec=None,
    embed=None,
    verifier=None,
    num_tokens: int | None = None,
) -> None:
    """Write `out_dir` atomically (staging dir, fsync, rename), contract-checked first.
    `spec`, `embed`, `verifier`, `num_tokens`: the dispatcher's, unused (no speculators copy)."""
    with atomic_dir(out_dir) as stage:
        state = {
            k: v.detach().to("cpu").float().contiguous() for k, v in draft.state_dict().items()
        }
        save_file(state, str(stage / WEIGHTS), metadata={"format": "pt"})
        atomic_write_json(stage / "config.json", config_json(draft.config))
        facts = {"target_family": family} if family is not None else {}
        draft_cfg = draft.config.to_dict()
        atomic_write_json(stage / PROVENANCE, {**provenance, "draft_config": draft_cfg, **facts})
        check_export(stage)


def load_export(out_dir, *, spec=None) -> DFlashDraft:
    """The exported draft back as a `DFlashDraft` (contract-checked first)."""
    check_export(out_dir)
    cfg = config_from_json(read_config(Path(out_dir) / "config.json", DFlashExportError))
    draft = DFlashDraft(cfg)
    draft.load_state_dict(load_file(str(Path(out_dir) / WEIGHTS)), strict=True)
    return draft.eval()


def layer_ids(c: dict) -> dict:
    """The draft's aux ids (SGLang numbering) and vLLM's: dflash_config.target_layer_ids, which
    vLLM reads + 1."""
    ids = c["dflash_config"]["target_layer_ids"]
    return {"aux_layer_ids": ids, "vllm_aux_layer_ids": [i + 1 for i in ids]}
