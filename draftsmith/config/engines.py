"""The engines' table: each backend's module and what the workflow needs from it, read from
the engine module's source (its literal `WORKFLOW`) without importing it.

Config checks, the rules and the stages ask here (`needs`, `honoured_by`, `engine_inputs`) and
never name an engine; `draftsmith.engines` imports an engine's module when a stage runs it.
"""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1]

# backend name -> its engine module (draftsmith/engines/<name>/engine.py)
ENGINES = {
    "hf": "draftsmith.engines.hf.engine",
    "sglang": "draftsmith.engines.sglang.engine",
    "vllm": "draftsmith.engines.vllm.engine",
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
    # and the section's frozen dataclass (draftsmith.config.settings.ENGINE_SECTIONS) types it
    # for the engine (job.engine, own_settings); None: it has none
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


def source_of(module: str) -> Path:
    """The source file of `module`, found without importing it or its package (a module of this
    package is looked up under it; another one through the import system's finders)."""
    head, _, rest = module.partition(".")
    if head == "draftsmith" and rest:
        base = PACKAGE.joinpath(*rest.split("."))
        for path in (base.with_suffix(".py"), base / "__init__.py"):
            if path.is_file():
                return path
        raise EngineError(f"engine module {module} has no source under {PACKAGE}")
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.origin:
        raise EngineError(f"engine module {module} is not importable")
    return Path(spec.origin)


def needs(backend: str) -> dict:
    """What the workflow needs from engine `backend`: its module's `WORKFLOW` over the defaults
    of `NEEDS`, read from the module's source (a literal), never importing it."""
    module = ENGINES.get(backend)
    if module is None:
        raise EngineError(f"backend {backend!r} is not an engine; engines: {', '.join(ENGINES)}")
    path = source_of(module)
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
