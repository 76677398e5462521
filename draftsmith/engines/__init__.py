"""Engines: who does the work of a stage (transformers in-process, an SGLang or vLLM server).

The stage modules (`draftsmith.regenerate`, `draftsmith.capture`, `draftsmith.bench`) stay the
CLIs the rules call: they read inputs, validate, write artifacts and reports. The work between
is asked of the engine named by the stage's `backend` key, through one function per stage:

    regenerate_rows(conversations, cfg, *, target, threads, seed) -> (conversations, report)
        conversations in and out as in `draftsmith.regenerate_base.regenerate`; report: the engine's
        figures (backend, prompts, new_tokens, prompt_tokens, seconds, hit_limit, empty,
        wall_seconds, tokens_per_second, ...), merged into the range's report.json.
    capture_range(tokens, cfg, *, target, out, ids, manifest, threads) -> manifest
        tokens: the token file's tensors; writes the shard at `out` (draftsmith.shard_writer) with the
        aux states of layer ids `ids` and returns its manifest.
    bench_sets(sets, cfg, *, target, draft, threads) -> (results, info)
        sets: name -> conversations; results: name -> figures (the keys of
        `draftsmith.specdec.summarize` plus timing); info: device, threads, aux_layer_ids,
        draft_vocab_size, method (the report's prose), and anything engine-specific.

`cfg` is the job's `--cfg` (the config sections the rule passes), with the operational
settings of `--run` (server ports, timeouts, retries: outside params, see `common.merge_run`)
merged into their sections.

An engine is one module here that defines the functions of the stages it implements, and one
line of `ENGINES`; docs/architecture.md ("Adding an engine") lists what else a new engine touches
today (the schema's backend enums, a role, and for a server engine rules/common.smk).
The registry imports an engine's module only when a stage asks for it (the Snakefile, which
imports the package at DAG-build time, never does).

A stage that reads the target's tokenizer in the engine's role asks `load_tokenizer(stage, cfg,
target)`: an engine whose role needs a preparation first (SGLang's CPU role declares torchvision's
op schemas) defines `tokenizer(target, cfg, stage)`; the others get transformers' AutoTokenizer.

An engine that computes in the job's own process says so (`IN_PROCESS = True`): its stages then
run under `draftsmith.stopping.stop_promptly`, so SIGINT/SIGTERM end the job within a second even
inside a long torch op. A server engine keeps Python's KeyboardInterrupt, whose cleanup stops
the server it started (draftsmith.server).
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Callable

# backend name -> module
ENGINES = {
    "hf": "draftsmith.engines.hf",
    "sglang": "draftsmith.engines.sglang",
    "vllm": "draftsmith.engines.vllm",
}

# stage -> the function an engine defines for it
ENTRY_POINTS = {
    "regenerate": "regenerate_rows",
    "capture": "capture_range",
    "bench": "bench_sets",
}


class EngineError(ValueError):
    """A backend that is not an engine, or an engine without the requested stage."""


def engine(stage: str, backend: str) -> Callable:
    """The function of engine `backend` for `stage` (imports the engine's module)."""
    if stage not in ENTRY_POINTS:
        raise EngineError(f"unknown stage {stage!r}; stages: {', '.join(ENTRY_POINTS)}")
    module = ENGINES.get(backend)
    if module is None:
        raise EngineError(
            f"{stage}.backend {backend!r} is not an engine; engines: {', '.join(ENGINES)}"
        )
    fn = getattr(importlib.import_module(module), ENTRY_POINTS[stage], None)
    if fn is None:
        raise EngineError(
            f"{stage}.backend {backend!r}: the {backend} engine ({module}) does not implement "
            f"the {stage} stage"
        )
    return fn


def implements(backend: str) -> list[str]:
    """The stages an engine implements (imports its module)."""
    mod = importlib.import_module(ENGINES[backend])
    return [stage for stage, name in ENTRY_POINTS.items() if hasattr(mod, name)]


def load_tokenizer(stage: str, cfg: dict, target):
    """The target's tokenizer for `stage`, loaded as its engine's role interpreter needs it;
    `cfg["target"]["trust_remote_code"]` (when the job was given it) allows the target's code."""
    module = ENGINES.get(cfg[stage]["backend"])
    own = getattr(importlib.import_module(module), "tokenizer", None) if module else None
    if own is not None:
        return own(target, cfg, stage)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(target), trust_remote_code=trusts_code(cfg))


def trusts_code(cfg: dict) -> bool:
    """Whether the job's config allows the target's own code. A job is given a target section
    (with the key) when it reads the target, or by rules/common.smk only when the key is on."""
    return "target" in cfg and bool(cfg["target"]["trust_remote_code"])


def stop_guard(stage: str, backend: str):
    """The context a stage's engine work runs in (see the module doc); enter it before torch
    starts threads. A backend that is not an engine gets no guard (engine() names the error)."""
    module = ENGINES.get(backend)
    if module is not None and getattr(importlib.import_module(module), "IN_PROCESS", False):
        from draftsmith.stopping import stop_promptly

        return stop_promptly(f"draftsmith.{stage}")
    return contextlib.nullcontext()
