"""What differs between target families, in one place: the final norm's weight convention, the
RoPE the draft mirrors, and the facts the export records about the family (with which engine can
serve its draft: draftsmith.targets.serving).

Gemma-style RMSNorm multiplies by `1 + w` (the stored weight is centred on 0), where Llama's
multiplies by `w`. The draft (SGLang's `LlamaForCausalLMEagle3`, `draftsmith.algorithms.layers.RMSNorm`)
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


# ---------------------------------------------------------------------------------------------
# RoPE

# what the draft (draftsmith.algorithms.layers.Rotary, the same inverse frequencies as SGLang's get_rope)
# computes; the target's other kinds are not carried and the export says so
DRAFT_ROPE = ("default", "linear", "llama3")


def rope_kind(params: dict | None) -> str:
    return str((params or {}).get("rope_type", (params or {}).get("type", "default")))


def target_rope(cfg: dict) -> dict:
    """The target's RoPE as the draft mirrors it, from its text config: {"theta", "scaling"
    (a dict or None), "kind", "layer_type" (the layer type it was taken from when RoPE is per
    layer type, e.g. Gemma-3 in transformers 5), "source" (the config key)}.

    transformers 5 writes `rope_parameters` (theta inside); older configs `rope_theta` and
    `rope_scaling`. Per-layer-type parameters ({"full_attention": {...}, "sliding_attention":
    {...}}) give the full-attention layers' RoPE: the draft attends over the whole context.
    """
    cfg = cfg.get("text_config") or cfg
    params, source, layer_type = cfg.get("rope_parameters"), "rope_parameters", None
    if isinstance(params, dict) and params and all(isinstance(v, dict) for v in params.values()):
        layer_type = "full_attention" if "full_attention" in params else sorted(params)[0]
        params = params[layer_type]
    if not params:
        params, source = cfg.get("rope_scaling"), "rope_scaling"
    params = dict(params or {})
    theta = float(params.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    kind = rope_kind(params)
    scaling = {k: v for k, v in params.items() if k != "rope_theta"} if kind != "default" else None
    partial = float(params.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0)))
    return {
        "theta": theta,
        "scaling": scaling,
        "partial_rotary_factor": partial,
        "kind": kind,
        "layer_type": layer_type,
        "source": source if params else "rope_theta",
    }


def rope_note(rope: dict, draft_scaling: dict | None, trained_length: int) -> str | None:
    """What a user must know when the draft's RoPE is not the target's, else None."""
    partial = rope["partial_rotary_factor"]
    if draft_scaling == rope["scaling"] and partial == 1.0:  # a kind the draft carries as is
        return None  # (DRAFT_ROPE; YaRN too for the MLA draft, draftsmith.algorithms.eagle3.mla)
    original = (rope["scaling"] or {}).get("original_max_position_embeddings")
    past = f" (the target's original context is {original})" if original else ""
    what = f"{rope['kind']} RoPE" + (f" on {partial:g} of each head" if partial != 1.0 else "")
    return (
        f"the target uses {what} ({rope['source']}), which the draft does not reproduce: the "
        f"draft uses plain RoPE on whole heads with theta {rope['theta']:g} and was trained on "
        f"rows of at most {trained_length} tokens{past}; past that its predictions may degrade "
        "and fewer drafted tokens be accepted"
    )


def logit_softcap(cfg: dict) -> float | None:
    """The target's final logit soft-capping (Gemma-2: logits = c * tanh(logits / c), c = 30),
    from its text config; None when it has none."""
    text = cfg.get("text_config") if isinstance(cfg.get("text_config"), dict) else cfg
    cap = text.get("final_logit_softcapping")
    return float(cap) if cap else None


def softcap_note(cap: float | None) -> str | None:
    """What a user must know when the target soft-caps its logits: the teacher the draft is
    trained on (the stored post-norm states through the lm_head) does not."""
    if not cap:
        return None
    return (
        f"the target soft-caps its logits (final_logit_softcapping {cap:g}: c * tanh(z / c)); "
        "the teacher the draft was trained on is the uncapped lm_head output, so its soft "
        "targets are sharper than the target's distribution (same argmax: greedy acceptance "
        "is unaffected, sampled acceptance may be lower)"
    )


def family_facts(cfg: dict, draft_scaling: dict | None, trained_length: int) -> dict:
    """What the export records about the target family (provenance `target_family`) and the
    warnings it prints: norm convention, logit soft-capping, RoPE (the export adds serving per
    engine, draftsmith.targets.serving)."""
    rope = target_rope(cfg)
    note = rope_note(rope, draft_scaling, trained_length)
    cap = logit_softcap(cfg)
    warnings = [f"RoPE: {note}"] if note else []
    warnings += [f"logits: {softcap_note(cap)}"] if cap else []
    return {
        "model_types": model_types(cfg),
        "architectures": architectures(cfg),
        "norm": norm_convention(cfg),
        "logit_softcap": cap,
        "rope": {**rope, "draft_scaling": draft_scaling, "trained_length": trained_length},
        "warnings": warnings,
    }
