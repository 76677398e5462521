"""EAGLE-3 as SGLang and vLLM serve `LlamaForCausalLMEagle3` by default: fc over the
concatenated aux states, one Llama decoder layer, the pre-norm output fed back between draft
steps. Its parts are this folder's modules: the trainer (`train`), the exporter (`export`,
SGLang's contract plus a speculators copy), the decoder (`decode`) and the offline estimate
(`offline`); EAGLE-3.1 (draftsmith.algorithms.eagle31) names the same parts with two switches
on."""

from __future__ import annotations

from draftsmith.algorithms.spec import AlgorithmSpec, Part, Serving

decode = Part("draftsmith.algorithms.eagle3.decode")
export = Part("draftsmith.algorithms.eagle3.export")
offline = Part("draftsmith.algorithms.eagle3.offline")
train = Part("draftsmith.algorithms.eagle3.train")


def config_problems(c: dict) -> list[str]:
    """A config.json read as EAGLE-3 must not switch on EAGLE-3.1's layers (of_export sends
    those to eagle3.1, so only a hand-edited mixture arrives here)."""
    return [
        f"config.json {k} is {c[k]!r}: an EAGLE-3 draft has no {k}"
        for k in ("fc_norm", "norm_output")
        if c.get(k) not in (None, False)
    ]


SPEC = AlgorithmSpec(
    name="eagle3",
    title="EAGLE-3",
    drafting="Chain speculative decoding (EAGLE-3)",
    serving={
        "hf": Serving(flag="chain"),
        "sglang": Serving(flag="EAGLE3"),
        "vllm": Serving(flag="eagle3"),
    },  # fmt: skip
    trainer=train,
    exporter=export,
    decoder=decode,
    estimator=offline,
    speculators=True,
    config_problems=config_problems,
)
