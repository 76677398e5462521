"""EAGLE-3 as SGLang and vLLM serve `LlamaForCausalLMEagle3` by default: fc over the
concatenated aux states, one Llama decoder layer, the pre-norm output fed back between draft
steps. The export adds nothing to the common contract (draftsmith.algorithms.export)."""

from __future__ import annotations

NAME = "eagle3"
DRAFT: dict[str, bool] = {}
SPECULATORS = True


def export_keys(cfg) -> dict:
    return {}


def extra_params(c: dict) -> dict[str, tuple]:
    return {}


def config_problems(c: dict) -> list[str]:
    """A config.json read as EAGLE-3 must not switch on EAGLE-3.1's layers (of_export sends
    those to eagle3.1, so only a hand-edited mixture arrives here)."""
    return [
        f"config.json {k} is {c[k]!r}: an EAGLE-3 draft has no {k}"
        for k in ("fc_norm", "norm_output")
        if c.get(k) not in (None, False)
    ]
