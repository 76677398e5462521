"""DFlash: a block drafter (draftsmith.algorithms.dflash.model) served as vLLM's `DFlashDraftModel`.

Not a switch on the EAGLE-3 draft: this algorithm brings its own draft module, objective
(draftsmith.algorithms.dflash.train), export and contract check (draftsmith.algorithms.dflash.export) and decoder
(draftsmith.algorithms.dflash.decode), the parts its spec holds:

    trainer   module with build_draft, objective, batch_losses
    exporter  module with export_draft, check_export, load_export, config_problems
    decoder   module with the in-process runner (DFlashRunner)

It has no offline estimate (its spec refuses train.eval_rows).

Capture: the configured `capture.aux_layer_ids` (the same shards as EAGLE-3 by default; DFlash
recipes often list five ids, which the shards, the fc and the export follow); the block size
is train.ttt_steps + 1 (one known token and ttt_steps masks).
"""

from __future__ import annotations

from draftsmith.algorithms.spec import AlgorithmSpec, Part, Serving

decode = Part("draftsmith.algorithms.dflash.decode")
export = Part("draftsmith.algorithms.dflash.export")
train = Part("draftsmith.algorithms.dflash.train")


def config_problems(c: dict) -> list[str]:
    """What in an exported config.json a DFlash draft refuses (its exporter's check)."""
    return export.config_problems(c)


SPEC = AlgorithmSpec(
    name="dflash",
    title="DFlash",
    drafting="Block speculative decoding (DFlash: one draft forward proposes all {n} tokens)",
    serving={
        "hf": Serving(flag="block"),
        "vllm": Serving(flag="dflash"),
        "sglang": Serving(
            refused="SGLang 0.5.23 refuses DFLASH on CPU (CpuSRTPlatform), and no SGLang run "
            "has served draftsmith's DFlash export (vLLM's DFlashDraftModel) on a GPU; "
            "bench.backend hf or vllm serve it"
        ),
    },
    config_problems=config_problems,
    trainer=train,
    exporter=export,
    decoder=decode,
    refuses={
        "bench.temperature": "speculative sampling is not implemented for the DFlash block "
        "drafter (greedy only): set bench.temperature 0",
        "draft.attention": "the DFlash draft has no attention variant: set draft.attention llama",
        "draft.init_layer_from_target": "it initialises the EAGLE-3 draft's one decoder layer; "
        "DFlash's layers attend over the target's states and their own block, not the "
        "target layer's inputs: set draft.init_layer_from_target false",
        "train.eval_rows": "the offline acceptance estimate runs EAGLE-3's chain decoder, not "
        "DFlash's block drafter: set train.eval_rows 0",
    },
)
