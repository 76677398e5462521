"""Engines: who does the work of a stage (transformers in-process, an SGLang or vLLM server).

The stage modules (`draftsmith.regenerate`, `draftsmith.capture`, `draftsmith.bench`) stay the
CLIs the rules call: they read inputs, validate, write artifacts and reports. The work between
is asked of the engine named by the stage's `backend` key, through one function per stage:

    regenerate_rows(conversations, job, *, target, threads, seed, max_total)
        -> (conversations, report)
        conversations in and out as in `draftsmith.regenerate_base.regenerate`; seed: the
        range's (regenerate.seed + its first row); max_total: data.max_length, which prompt +
        reply must fit in; report: the engine's figures (backend, prompts, new_tokens,
        prompt_tokens, seconds, hit_limit, empty, wall_seconds, tokens_per_second, ...), merged
        into the range's report.json.
    capture_range(tokens, job, *, target, out, ids, manifest, threads, draft_ids, **inputs)
        -> manifest
        tokens: the token file's tensors; writes the shard at `out` (draftsmith.shard_writer) with the
        aux states of layer ids `ids` and returns its manifest. draft_ids: the draft vocabulary's
        target ids where the storage mode keeps a top-k teacher over it (else None); inputs:
        the engine's own inputs (WORKFLOW["inputs"]["capture"], below) as paths.
    bench_sets(sets, job, *, target, draft, threads) -> (measurements, info)
        sets: name -> conversations; measurements: name -> what the engine measured (token ids,
        verification passes, accepted-length histograms, seconds of both sides), the format of
        `draftsmith.benchfigures`, which computes every figure of the report from them; info:
        device, threads, aux_layer_ids, draft_vocab_size, method (the report's prose), and
        anything engine-specific.

`job` is the job's typed settings (`draftsmith.settings.stage_job`, a frozen `JobSettings`,
every key the schema's default where the job was not given it): the stage's section
(`job.regenerate`, `job.capture`, `job.bench`), `job.target`, and `job.engine`, the engine's own
settings section (WORKFLOW "settings", typed by the dataclass its module names as `SETTINGS`;
None for an engine without one). The run settings of `--run` (server ports, timeouts, retries,
capture.concurrency: the schema's x-execution keys, outside params, see `common.merge_run`) are
merged into their sections before typing, so they arrive there too. `job.given` holds the
sections as received (what reports and provenance record), and keys that are no config, such
as segment capture's `capture_server` (draftsmith.segcapture).

An engine is one module here that defines the functions of the stages it implements, and one
line of `ENGINES`; docs/architecture.md ("Adding an engine") has the whole recipe (the schema's
backend enums, a role where it needs its own packages). The registry imports an engine's module
only when a stage asks for it (the Snakefile, which imports the package at DAG-build time,
never does).

What the workflow needs from an engine, the module declares in a literal `WORKFLOW` dict, which
`needs(backend)` reads from its source without importing it (the keys of `NEEDS`, with their
defaults): the rules, `draftsmith.config.check_config` and the stage CLIs ask `needs` instead
of naming engines.

A stage that reads the target's tokenizer in the engine's role asks `load_tokenizer(stage, job,
target)`: an engine whose role needs a preparation first (SGLang's CPU role declares torchvision's
op schemas) defines `tokenizer(target, job, stage)`; the others get transformers' AutoTokenizer.

An engine that computes in the job's own process says so (`IN_PROCESS = True`): its stages then
run under `draftsmith.stopping.stop_promptly`, so SIGINT/SIGTERM end the job within a second even
inside a long torch op. A server engine keeps Python's KeyboardInterrupt, whose cleanup stops
the server it started (draftsmith.server).
"""

from __future__ import annotations

import ast
import contextlib
import importlib
import importlib.util
from collections.abc import Callable
from pathlib import Path

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


# what an engine's WORKFLOW may declare, and the default of each key
NEEDS = {
    # the config section of the engine's own settings (a server's): its keys that change
    # results (the schema's non-x-execution ones) are params of every job that uses the engine,
    # and the module's SETTINGS, a frozen dataclass of the section's keys, types it for the
    # engine (job.engine, own_settings); None: it has none
    "settings": None,
    # GPUs one job of a GPU role takes: a number, or "section.key" naming the config key that
    # says (a server's tensor-parallel size); train's GPUs are train.nproc whatever the engine
    "gpus": 1,
    # how the GPU layout printed at parse time explains that number ({n}: the number)
    "gpus_why": "one GPU",
    # stage -> {name: path}: files a job of that stage also needs (built by a rule of their
    # own), the stage CLI's --<name> and the engine function's keyword argument <name>
    "inputs": {},
    # "stage.key" settings that only some engines honour (check_config refuses the others)
    "honours": [],
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


def needs(backend: str) -> dict:
    """What the workflow needs from engine `backend`: its module's `WORKFLOW` over the defaults
    of `NEEDS`, read from the module's source (a literal), never importing it."""
    module = ENGINES.get(backend)
    if module is None:
        raise EngineError(f"backend {backend!r} is not an engine; engines: {', '.join(ENGINES)}")
    path = Path(importlib.util.find_spec(module).origin)
    declared = {}
    for node in ast.parse(path.read_text(encoding="utf-8")).body:
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "WORKFLOW" for t in node.targets
        ):
            try:
                declared = ast.literal_eval(node.value)
            except ValueError:
                raise EngineError(
                    f"{path}: WORKFLOW must be a literal (dicts, lists, strings, numbers)"
                ) from None
    unknown = sorted(set(declared) - set(NEEDS))
    if unknown:
        raise EngineError(f"{path}: WORKFLOW keys {unknown} are not among {sorted(NEEDS)}")
    return {**NEEDS, **declared}


def honoured_by(setting: str) -> list[str]:
    """The engines that honour a "stage.key" setting only some engines honour."""
    return [name for name in ENGINES if setting in needs(name)["honours"]]


def engine_inputs(backend: str, stage: str) -> dict[str, str]:
    """name -> path of the files engine `backend` also needs for `stage` ({}: none)."""
    return dict(needs(backend)["inputs"].get(stage) or {})


def stage_inputs(stage: str) -> dict[str, str]:
    """name -> path of every engine's extra inputs for `stage` (the stage CLI's options)."""
    out: dict[str, str] = {}
    for name in ENGINES:
        out.update(engine_inputs(name, stage))
    return out


def implements(backend: str) -> list[str]:
    """The stages an engine implements (imports its module)."""
    mod = importlib.import_module(ENGINES[backend])
    return [stage for stage, name in ENTRY_POINTS.items() if hasattr(mod, name)]


def own_settings(backend: str):
    """(section, dataclass) of engine `backend`'s own settings: its WORKFLOW's "settings" section
    and the frozen dataclass its module names as `SETTINGS` (imports the module); None when it
    has none or `backend` is no engine (engine() names that error)."""
    module = ENGINES.get(backend)
    section = needs(backend)["settings"] if module else None
    if section is None:
        return None
    cls = getattr(importlib.import_module(module), "SETTINGS", None)
    if cls is None:
        raise EngineError(
            f"{module}: WORKFLOW names the settings section {section!r} but the module has no "
            "SETTINGS dataclass of its keys"
        )
    return section, cls


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
        from draftsmith.stopping import stop_promptly

        return stop_promptly(f"draftsmith.{stage}")
    return contextlib.nullcontext()
