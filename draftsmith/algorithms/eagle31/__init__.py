"""EAGLE-3.1: the EAGLE-3 draft plus two switches both engines read from config.json.

- `fc_norm: true`: one RMSNorm (target hidden width, initialised to ones) on each aux state
  before they are concatenated into fc; tensors `fc_norm.{i}.weight`, one per aux layer.
- `norm_output: true`: the state fed back as the next draft step's hidden state is the output
  after the final norm (the one lm_head reads), not the pre-norm output. Training feeds the
  same state back between its TTT steps, so the draft is trained as it is served.

Same architecture name as EAGLE-3 (`LlamaForCausalLMEagle3`). `norm_before_residual` stays
off (SGLang does not implement it). vLLM's speculators-format translation of an "eagle3"
config does not carry these two keys over, so no speculators copy is written: vLLM is given
the draft directory itself (config.json + model.safetensors).
"""

from __future__ import annotations

from draftsmith.algorithms.spec import AlgorithmSpec, Part, Serving

decode = Part("draftsmith.algorithms.eagle3.decode")
export = Part("draftsmith.algorithms.eagle3.export")
offline = Part("draftsmith.algorithms.eagle3.offline")
train = Part("draftsmith.algorithms.eagle3.train")


def config_problems(c: dict) -> list[str]:
    return [
        f"config.json {k} is {c.get(k)!r}: an EAGLE-3.1 draft needs {k} true (the engines "
        "would serve another layer than the one trained)"
        for k in ("fc_norm", "norm_output")
        if c.get(k) is not True
    ]


SPEC = AlgorithmSpec(
    name="eagle3.1",
    title="EAGLE-3.1",
    drafting="Chain speculative decoding (EAGLE-3.1)",
    # both engines read fc_norm / norm_output under the EAGLE-3 architecture and flag
    serving={
        "hf": Serving(flag="chain"),
        "sglang": Serving(flag="EAGLE3"),
        "vllm": Serving(flag="eagle3"),
    },  # fmt: skip
    trainer=train,  # EAGLE-3's parts, with the two switches on
    exporter=export,  # writes the switches on as config.json keys, checks their tensors
    decoder=decode,
    estimator=offline,
    draft={"fc_norm": True, "norm_output": True},
    config_problems=config_problems,
)
