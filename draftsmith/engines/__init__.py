"""Engines: who does the work of a stage (transformers in-process, an SGLang or vLLM server).

The stage modules (`draftsmith.stages.regenerate`, `draftsmith.stages.capture`, `draftsmith.stages.bench`) stay the
CLIs the rules call: they read inputs, validate, write artifacts and reports. The work between
is asked of the engine named by the stage's `backend` key, through one function per stage:

    regenerate_rows(conversations, job, *, target, threads, seed, max_total)
        -> (conversations, report)
        conversations in and out as in `draftsmith.data.regenerate.regenerate`; seed: the
        range's (regenerate.seed + its first row); max_total: data.max_length, which prompt +
        reply must fit in; report: the engine's figures (backend, prompts, new_tokens,
        prompt_tokens, seconds, hit_limit, empty, wall_seconds, tokens_per_second, ...), merged
        into the range's report.json.
    capture_range(tokens, job, *, target, out, ids, manifest, threads, draft_ids, **inputs)
        -> manifest
        tokens: the token file's tensors; writes the shard at `out` (draftsmith.hidden.writer) with the
        aux states of layer ids `ids` and returns its manifest. draft_ids: the draft vocabulary's
        target ids where the storage mode keeps a top-k teacher over it (else None); inputs:
        the engine's own inputs (WORKFLOW["inputs"]["capture"], below) as paths.
    bench_sets(sets, job, *, target, draft, spec, threads) -> (measurements, info)
        spec: the draft's algorithm, resolved once by the stage (draftsmith.algorithms
        .open_draft), which the engine reads its flags and words from; sets: name -> conversations; measurements: name -> what the engine measured (token ids,
        verification passes, accepted-length histograms, seconds of both sides), the format of
        `draftsmith.bench.figures`, which computes every figure of the report from them; info:
        device, threads, aux_layer_ids, draft_vocab_size, method (the report's prose), and
        anything engine-specific.

`job` is the job's typed settings (`draftsmith.config.settings.stage_job`, a frozen `JobSettings`,
every key the schema's default where the job was not given it): the stage's section
(`job.regenerate`, `job.capture`, `job.bench`), `job.target`, and `job.engine`, the engine's own
settings section (WORKFLOW "settings", the one place an engine declares it, typed by the
section's dataclass in `draftsmith.config.settings.ENGINE_SECTIONS`; None for an engine without
one). The run settings of `--run` (server ports, timeouts, retries,
capture.concurrency: the schema's x-execution keys, outside params, see `common.merge_run`) are
merged into their sections before typing, so they arrive there too. `job.given` holds the
sections as received (what reports and provenance record), and keys that are no config, such
as segment capture's `capture_server` (draftsmith.stages.segcapture).

An engine is one folder here, `engines/<name>/`, whose `engine.py` defines the functions of the
stages it implements (its other modules are its own helpers), and one line of `ENGINES`
(draftsmith.config.engines); engine-neutral server infrastructure stays beside the folders
(`server.py`, `sharedserver.py`). docs/architecture.md ("Adding an engine") has the whole recipe (the schema's
backend enums, a role where it needs its own packages). The registry imports an engine's module
only when a stage asks for it (the Snakefile, which imports the package at DAG-build time,
never does).

What the workflow needs from an engine, the module declares in a literal `WORKFLOW` dict, which
`needs(backend)` reads from its source without importing it (the keys of `NEEDS`, with their
defaults): the rules, `draftsmith.config.checks.check_config` and the stage CLIs ask `needs` instead
of naming engines.

A stage that reads the target's tokenizer in the engine's role asks `load_tokenizer(stage, job,
target)`: an engine whose role needs a preparation first (SGLang's CPU role declares torchvision's
op schemas) defines `tokenizer(target, job, stage)`; the others get transformers' AutoTokenizer.

An engine that computes in the job's own process says so (`IN_PROCESS = True`): its stages then
run under `draftsmith.runtime.stopping.stop_promptly`, so SIGINT/SIGTERM end the job within a second even
inside a long torch op, and the run's idle shared servers that hold GPUs are stopped first
(draftsmith.runtime.serverhosts). A server engine keeps Python's KeyboardInterrupt, whose
cleanup stops the server it started (draftsmith.engines.server).

May import: every subpackage but stages (engines sit below the stage commands that call them).
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Callable

# the table (backend -> module, what each declares) lives below the engines, in config
from draftsmith.config.engines import (  # noqa: F401
    ENGINES,
    ENTRY_POINTS,
    NEEDS,
    EngineError,
    engine_inputs,
    honoured_by,
    needs,
    stage_inputs,
)


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


def own_settings(backend: str):
    """(section, dataclass) of engine `backend`'s own settings: its WORKFLOW's "settings" section
    and the config layer's dataclass of it (draftsmith.config.settings.engine_settings, which
    imports no engine); None when it has none or `backend` is no engine (engine() names that
    error)."""
    from draftsmith.config.settings import engine_settings

    return engine_settings(backend)


def load_tokenizer(stage: str, job, target):
    """The target's tokenizer for `stage`, loaded as its engine's role interpreter needs it (`job`:
    the job's JobSettings, with the stage's section and `target`); `job.target.trust_remote_code`
    allows the target's code."""
    module = ENGINES.get(getattr(job, stage).backend)
    own = getattr(importlib.import_module(module), "tokenizer", None) if module else None
    if own is not None:
        return own(target, job, stage)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(
        str(target), trust_remote_code=job.target.trust_remote_code
    )


def stop_guard(stage: str, backend: str):
    """The context a stage's engine work runs in (see the module doc); enter it before torch
    starts threads. A backend that is not an engine gets no guard (engine() names the error)."""
    module = ENGINES.get(backend)
    if module is not None and getattr(importlib.import_module(module), "IN_PROCESS", False):
        from draftsmith.runtime.serverhosts import release_gpu_hosts
        from draftsmith.runtime.stopping import stop_promptly

        # work in this process may use GPUs: the run's idle servers give theirs back first
        release_gpu_hosts()

        return stop_promptly(f"draftsmith.{stage}")
    return contextlib.nullcontext()
