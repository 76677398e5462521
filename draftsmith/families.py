"""What differs between target families, in one place: the final norm's weight convention.

Gemma-style RMSNorm multiplies by `1 + w` (the stored weight is centred on 0), where Llama's
multiplies by `w`. The draft (SGLang's `LlamaForCausalLMEagle3`, `draftsmith.model.RMSNorm`)
always multiplies by `w`, so a draft norm initialised from such a target, or a target norm applied
to stored states by the converters, must use `1 + w`. `OFFSET_NORM` lists the model types of the
pinned transformers (5.23.0) whose decoder's final norm is `1 + w`
(`tests/test_families.py` rereads the installed transformers' modeling files to keep it exact).

The convention is read from the target's `config.json`: `model_type` (of the config or of its
`text_config`), else the class names in `architectures`.
"""

from __future__ import annotations

# model_type -> the transformers RMSNorm class whose forward is x_normed * (1 + w)
OFFSET_NORM = {
    "gemma": "GemmaRMSNorm",
    "gemma2": "Gemma2RMSNorm",
    "gemma3": "Gemma3RMSNorm",
    "gemma3_text": "Gemma3RMSNorm",
    "vaultgemma": "VaultGemmaRMSNorm",
    "minimax_m3_vl": "MiniMaxM3VLRMSNorm",
    "minimax_m3_vl_text": "MiniMaxM3VLRMSNorm",
    "qwen3_next": "Qwen3NextRMSNorm",
    "qwen3_5": "Qwen3_5RMSNorm",
    "qwen3_5_text": "Qwen3_5RMSNorm",
    "qwen3_5_moe": "Qwen3_5MoeRMSNorm",
    "qwen3_5_moe_text": "Qwen3_5MoeRMSNorm",
}
# architecture class-name prefixes of the same families (configs without a model_type)
OFFSET_ARCH_PREFIXES = ("Gemma", "VaultGemma", "MiniMaxM3VL", "Qwen3Next", "Qwen3_5")


def model_types(cfg: dict) -> list[str]:
    """The model types a target config names: its own, then its text_config's."""
    out = [cfg.get("model_type")]
    text = cfg.get("text_config")
    if isinstance(text, dict):
        out.append(text.get("model_type"))
    return [str(t) for t in out if t]


def architectures(cfg: dict) -> list[str]:
    out = list(cfg.get("architectures") or [])
    text = cfg.get("text_config")
    if isinstance(text, dict):
        out += list(text.get("architectures") or [])
    return [str(a) for a in out]


def norm_offset(cfg: dict) -> float:
    """1.0 when the target's final RMSNorm applies its weight as `1 + w`, else 0.0."""
    kinds = model_types(cfg)
    if kinds:
        return 1.0 if any(k in OFFSET_NORM for k in kinds) else 0.0
    return 1.0 if any(a.startswith(OFFSET_ARCH_PREFIXES) for a in architectures(cfg)) else 0.0


def effective_norm_weight(weight, cfg: dict):
    """The weight a plain `x * w` RMSNorm needs to compute the target's final norm."""
    return weight.float() + norm_offset(cfg)


def norm_convention(cfg: dict) -> str:
    """How the target applies its final norm weight, for provenance and manifests."""
    return "1 + w (Gemma-style)" if norm_offset(cfg) else "w"
