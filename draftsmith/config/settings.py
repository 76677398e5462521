"""Typed settings of a job's config sections, filled once per job.

A job gets its config sections as `--cfg` JSON (the rules' params, validated at parse time)
without the keys the schema marks x-omit-default while they are at their default and without
the x-execution keys (those come as DRAFTSMITH_RUN, draftsmith.runtime.files.merge_run). `job(cfg,
sections)` turns what the job received into frozen dataclasses, each missing key filled with
the schema's default, read from draftsmith/config/config.schema.yaml: the dataclasses below carry no
default of their own, and tests/test_settings.py fails when their fields or types and the
schema's properties disagree. An unknown key is an error, as in the schema's validation.

Arrays become tuples (the settings are frozen); numbers keep the type they came with (an
integer `lr` stays an int), so the arithmetic is the dict's. The sections as received stay
available as `JobSettings.given`: run keys hash them and provenance records them, exactly as
before the typed settings.

The engine seam (draftsmith.engines) hands an engine the job's `JobSettings`: its stage's
section, `target` and, as `engine`, the engine's own settings section (its WORKFLOW's
"settings", typed by its dataclass in `ENGINE_SECTIONS`, filled the same way; the
x-execution keys among them arrive through DRAFTSMITH_RUN, merged before typing). `stage_job`
builds that for a stage CLI.
"""

from __future__ import annotations

import types
import typing
from dataclasses import dataclass, fields, is_dataclass

from draftsmith.config.checks import ConfigError, load_schema


@dataclass(frozen=True)
class TrainSettings:
    """The `train` section (draftsmith/config/config.schema.yaml describes each key)."""

    role: str
    ttt_steps: int
    epochs: int
    lr: float
    warmup_ratio: float
    batch_tokens: int
    max_steps: int
    eval_rows: int
    segment_rows: int
    seed: int
    checkpoint_every: int
    checkpoint_seconds: float
    noise_std: float
    loss_positions: str
    nproc: int
    precision: str


@dataclass(frozen=True)
class DFlashSettings:
    """`draft.dflash`."""

    layers: int
    anchors: int
    mask_token_id: int
    decay: float


@dataclass(frozen=True)
class DraftSettings:
    """The `draft` section."""

    algorithm: str
    attention: str
    vocab_size: int
    init_from_target: bool
    init_layer_from_target: bool
    serve_check: str
    dflash: DFlashSettings


@dataclass(frozen=True)
class StorageSettings:
    """`capture.storage` (draftsmith.hidden.storage.Storage is the mode built from it)."""

    aux: str
    scale_block: int
    final: str
    topk: int
    topk_vocab: str

    def as_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self)}


@dataclass(frozen=True)
class CaptureSettings:
    """The `capture` section."""

    keep: bool
    backend: str
    concurrency: int
    retries: int
    role: str
    aux_layer_ids: str | tuple[int, ...]
    dtype: str
    storage: StorageSettings
    batch_tokens: int


@dataclass(frozen=True)
class BenchFile:
    """One entry of `bench.files`."""

    name: str
    path: str
    format: str
    size: int


@dataclass(frozen=True)
class BenchSettings:
    """The `bench` section."""

    backend: str
    role: str
    num_steps: int
    topk: int
    num_draft_tokens: int
    concurrency: int | tuple[int, ...]
    workers: str | int
    max_new_tokens: int
    temperature: float
    top_p: float
    seed: int
    tau_floor: float
    smoke: bool
    heldout_size: int
    humaneval_size: int
    files: tuple[BenchFile, ...]


@dataclass(frozen=True)
class TargetSettings:
    """The `target` section."""

    source: str
    path: str
    dtype: str
    trust_remote_code: bool


@dataclass(frozen=True)
class RegenerateSettings:
    """The `regenerate` section."""

    enabled: bool
    backend: str
    role: str
    temperature: float
    max_new_tokens: int
    dtype: str
    batch_size: int
    seed: int
    thinking: str


@dataclass(frozen=True)
class SGLangSettings:
    """The `sglang` section, the SGLang engine's own settings (WORKFLOW "settings"; the schema
    describes each key, tests/test_settings.py checks the fields)."""

    tp_size: int
    extra_args: tuple[str, ...]
    port: int
    startup_timeout: float
    request_timeout: float
    retries: int
    shared_server: str
    idle_timeout: float


SECTIONS = {
    "train": TrainSettings,
    "draft": DraftSettings,
    "capture": CaptureSettings,
    "bench": BenchSettings,
    "target": TargetSettings,
    "regenerate": RegenerateSettings,
}
# the dataclass of each engine's own section: an engine declares its section once, as its
# WORKFLOW's "settings" (read without importing it), and gets it typed by the class here
ENGINE_SECTIONS = {"sglang": SGLangSettings}


@dataclass(frozen=True)
class JobSettings:
    """A job's config: `given`, the sections as the job received them (what run keys hash and
    provenance records), the typed sections it asked for (None for the others), and `engine`,
    the typed own settings section of its stage's engine (None: not asked, or the engine has
    none)."""

    given: dict
    train: TrainSettings | None
    draft: DraftSettings | None
    capture: CaptureSettings | None
    bench: BenchSettings | None
    target: TargetSettings | None
    regenerate: RegenerateSettings | None
    engine: object | None


def job(
    cfg: dict, sections, schema: dict | None = None, *, absent=(), stage: str | None = None
) -> JobSettings:
    """The typed `sections` of a job's config `cfg` (its --cfg JSON after merge_run); a missing
    section, an unknown key or a value of the wrong type ends the job naming it. `absent`: the
    sections of `sections` the job may lack, typed at their defaults then (the caller says
    why). `stage`: also type the own settings section of that stage's engine as `engine`."""
    if stage is not None and stage not in sections:
        raise ValueError(f"stage {stage!r} is not among the sections {sections}")
    missing = [s for s in sections if s not in cfg and s not in absent]
    if missing:
        raise SystemExit(f"--cfg has no {missing[0]!r} section")
    schema = load_schema() if schema is None else schema
    typed = {name: None for name in SECTIONS}
    try:
        for name in sections:
            typed[name] = section(name, cfg.get(name), schema)
        engine = engine_section(cfg, typed[stage].backend, schema) if stage else None
    except ConfigError as e:
        raise SystemExit(f"--cfg: {e}") from None
    return JobSettings(given=cfg, **typed, engine=engine)


def stage_job(cfg: dict, stage: str, schema: dict | None = None, *, absent=()) -> JobSettings:
    """The settings an engine's stage job hands its engine: the stage's section, `target`, and
    the engine's own section (`engine`)."""
    return job(cfg, (stage, "target"), schema, absent=absent, stage=stage)


def engine_settings(backend: str):
    """(section, dataclass) of engine `backend`'s own settings: the section its WORKFLOW declares
    as "settings" and the class ENGINE_SECTIONS holds for it (the engine's module is not
    imported); None when it has none or `backend` is no engine (engine() names that error)."""
    from draftsmith.config.engines import ENGINES, EngineError, needs

    name = needs(backend)["settings"] if backend in ENGINES else None
    if name is None:
        return None
    cls = ENGINE_SECTIONS.get(name)
    if cls is None:
        raise EngineError(
            f"{ENGINES[backend]}: WORKFLOW names the settings section {name!r}, which has no "
            "dataclass in draftsmith.config.settings.ENGINE_SECTIONS"
        )
    return name, cls


def engine_section(cfg: dict, backend: str, schema: dict):
    """The typed own settings section of engine `backend` (engine_settings), required in `cfg`;
    None when the engine has none or `backend` is no engine (the stage's engine() call names
    that error)."""
    own = engine_settings(backend)
    if own is None:
        return None
    name, cls = own
    if name not in cfg:
        raise SystemExit(f"--cfg has no {name!r} section (the settings of the {backend} engine)")
    return fill(cls, cfg[name], schema["properties"][name], name)


def section(name: str, given: dict | None, schema: dict | None = None):
    """The settings dataclass of section `name` from its keys `given`, defaults filled."""
    schema = load_schema() if schema is None else schema
    return fill(SECTIONS[name], given, schema["properties"][name], name)


def fill(cls, given: dict | None, spec: dict, where: str):
    """An instance of dataclass `cls` from `given` (a mapping of the object schema `spec`),
    each key it lacks at the schema's default; unknown keys and wrong types are ConfigErrors."""
    if given is not None and not isinstance(given, dict):
        raise ConfigError(f"config: {where} must be an object, got {given!r}")
    given = given or {}
    props = spec["properties"]
    names = [f.name for f in fields(cls)]
    unknown = sorted(set(given) - set(names))
    if unknown:
        raise ConfigError(
            f"config: {where}: unknown key(s) {', '.join(unknown)} (the keys are "
            f"{', '.join(names)}; draftsmith/config/config.schema.yaml)"
        )
    hints = typing.get_type_hints(cls)
    values = {}
    for name in names:
        prop = props[name]
        value = given[name] if name in given else prop["default"]
        values[name] = typed(value, hints[name], prop, f"{where}.{name}")
    return cls(**values)


def typed(value, hint, prop: dict, where: str):
    """`value` as type `hint` (arrays as tuples, objects as their dataclass); a value that
    does not fit is a ConfigError naming the key."""
    options = typing.get_args(hint) if isinstance(hint, types.UnionType) else (hint,)
    for option in options:
        ok, out = _as(value, option, prop, where)
        if ok:
            return out
    shown = " or ".join(_type_name(o) for o in options)
    raise ConfigError(f"config: {where} = {value!r} is not {shown}")


def _as(value, hint, prop: dict, where: str):
    """(fits, converted) of `value` for one non-union type `hint`."""
    if is_dataclass(hint):
        if not isinstance(value, dict):
            return False, None
        return True, fill(hint, value, _option(prop, "object"), where)
    if typing.get_origin(hint) is tuple:
        if not isinstance(value, list | tuple):
            return False, None
        item, items = typing.get_args(hint)[0], _option(prop, "array").get("items", {})
        return True, tuple(typed(v, item, items, f"{where}[{i}]") for i, v in enumerate(value))
    if hint is bool:
        return isinstance(value, bool), value
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool), value
    if hint is float:
        return isinstance(value, int | float) and not isinstance(value, bool), value
    return isinstance(value, hint), value


def plain(value):
    """A settings value as the config holds it: dataclasses as dicts, tuples as lists."""
    if is_dataclass(value):
        return {f.name: plain(getattr(value, f.name)) for f in fields(value)}
    if isinstance(value, tuple):
        return [plain(v) for v in value]
    return value


def _option(prop: dict, kind: str) -> dict:
    """The member of a oneOf of type `kind` (the property itself when it has no oneOf)."""
    for option in prop.get("oneOf", []):
        if option.get("type") == kind:
            return option
    return prop


def _type_name(hint) -> str:
    if typing.get_origin(hint) is tuple:
        return f"a list (each {_type_name(typing.get_args(hint)[0])})"
    if is_dataclass(hint):
        return "an object"
    return {int: "an integer", float: "a number", bool: "true or false", str: "a string"}.get(
        hint, str(hint)
    )
