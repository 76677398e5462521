"""Typed settings (draftsmith.config.settings): the dataclasses match the schema key for key and type
for type, carry no defaults of their own, and fill a job's sections so that they equal the
validated config the Snakefile built. Fast: no workflow."""

from __future__ import annotations

import copy
import json
import types
import typing
from dataclasses import MISSING, dataclass, fields, is_dataclass
from pathlib import Path

import pytest
import yaml

from draftsmith.config import settings
from draftsmith.config.checks import (
    ConfigError,
    execution_keys,
    neutral_defaults,
    sections_json,
)
from draftsmith.config.settings import plain
from draftsmith.engines import ENGINES, own_settings
from draftsmith.runtime.files import merge_run

ROOT = Path(__file__).resolve().parents[1]
SCHEMA = yaml.safe_load((ROOT / "draftsmith" / "config" / "config.schema.yaml").read_text())
SCALARS = {"integer": int, "number": float, "boolean": bool, "string": str}


def problems(cls, spec: dict, where: str) -> list[str]:
    """How dataclass `cls` disagrees with the object schema `spec`: keys one has and the other
    lacks, types that differ (recursively), fields with a default of their own."""
    props, hints = spec["properties"], typing.get_type_hints(cls)
    names = [f.name for f in fields(cls)]
    found = [f"{where}.{k}: in the schema, not in {cls.__name__}" for k in props if k not in names]
    found += [f"{where}.{k}: in {cls.__name__}, not in the schema" for k in names if k not in props]
    for f in fields(cls):
        if f.default is not MISSING or f.default_factory is not MISSING:
            found.append(f"{where}.{f.name}: a default in {cls.__name__} (the schema's only)")
        if f.name in props:
            found += type_problems(hints[f.name], props[f.name], f"{where}.{f.name}")
    return found


def type_problems(hint, prop: dict, where: str) -> list[str]:
    """Schema type -> annotation: integer int, number float, boolean bool, string str, array
    tuple[item, ...], object with properties a dataclass, oneOf the union in the same order."""
    options = prop["oneOf"] if "oneOf" in prop else [prop]
    hints = typing.get_args(hint) if isinstance(hint, types.UnionType) else (hint,)
    if len(options) != len(hints):
        return [f"{where}: {hint} for {len(options)} schema type(s)"]
    found = []
    for option, h in zip(options, hints, strict=True):
        kind = option.get("type")
        if kind in SCALARS:
            if h is not SCALARS[kind]:
                found.append(f"{where}: {h} for schema type {kind}")
        elif kind == "array":
            args = typing.get_args(h)
            if typing.get_origin(h) is not tuple or len(args) != 2 or args[1] is not Ellipsis:
                found.append(f"{where}: {h} for an array (want tuple[item, ...])")
            else:
                found += type_problems(args[0], option["items"], f"{where}[]")
        elif kind == "object" and "properties" in option:
            if not is_dataclass(h):
                found.append(f"{where}: {h} for an object with properties (want a dataclass)")
            else:
                found += problems(h, option, where)
        elif kind == "object":
            if h is not dict:
                found.append(f"{where}: {h} for an object (want dict)")
        else:
            found.append(f"{where}: schema type {kind!r} has no rule here")
    return found


@pytest.mark.parametrize("name", sorted(settings.SECTIONS))
def test_the_dataclasses_match_the_schema(name):
    found = problems(settings.SECTIONS[name], SCHEMA["properties"][name], name)
    assert not found, "\n".join(found)


OWN = {name: own_settings(name) for name in ENGINES}


@pytest.mark.parametrize("backend", [b for b, own in OWN.items() if own])
def test_an_engines_settings_dataclass_matches_its_section(backend):
    """An engine's own section (WORKFLOW "settings") comes typed by its dataclass."""
    section, cls = OWN[backend]
    found = problems(cls, SCHEMA["properties"][section], section)
    assert not found, "\n".join(found)


def test_engines_with_a_settings_section_exist():
    assert any(OWN.values()), "no engine declares a settings section: the test above runs none"


def test_the_check_sees_a_missing_key_a_wrong_type_and_a_default():
    @dataclass(frozen=True)
    class Short:
        ttt_steps: float  # integer in the schema
        lr: float = 0.001  # a default of its own
        made_up: int = 0

    found = "\n".join(problems(Short, SCHEMA["properties"]["train"], "train"))
    assert "train.epochs: in the schema, not in Short" in found
    assert "train.made_up: in Short, not in the schema" in found
    assert "train.ttt_steps: <class 'float'> for schema type integer" in found
    assert "train.lr: a default in Short" in found
    spec = {"properties": {"ids": {"oneOf": [{"type": "string"}, {"type": "array"}]}}}

    @dataclass(frozen=True)
    class Ids:
        ids: str | list

    assert problems(Ids, spec, "x") == [
        "x.ids: <class 'list'> for an array (want tuple[item, ...])"
    ]


def validated(cfg: dict) -> dict:
    from snakemake.utils import validate

    out = copy.deepcopy(cfg)
    validate(out, str(ROOT / "draftsmith" / "config" / "config.schema.yaml"))
    return out


CONFIGS = [
    {},
    {
        "train": {"eval_rows": 8, "loss_positions": "all", "lr": 1, "checkpoint_every": 7},
        "draft": {"algorithm": "dflash", "dflash": {"layers": 2}},
        "capture": {"aux_layer_ids": [1, 2, 3], "storage": {"final": "topk", "topk": 8}},
        "bench": {
            "backend": "sglang",
            "concurrency": [1, 4],
            "temperature": 0.5,
            "files": [{"name": "x", "path": "x.jsonl"}],
        },
        "target": {"dtype": "bfloat16", "trust_remote_code": True},
        "regenerate": {"backend": "sglang", "thinking": "disabled", "max_new_tokens": 7},
        "sglang": {"tp_size": 2, "extra_args": ["--x", "1"], "port": 8123, "idle_timeout": 5},
    },
]


@pytest.mark.parametrize("cfg", CONFIGS, ids=["default", "changed"])
def test_a_jobs_params_fill_to_the_validated_config(cfg):
    """What a job receives (its params: x-omit-default keys left out at their default, the
    x-execution keys never but in DRAFTSMITH_RUN, capture.storage keys of other modes dropped)
    fills back to the validated config, every section and key."""
    full = validated(cfg)
    neutral, execution = neutral_defaults(SCHEMA), execution_keys(SCHEMA)
    names = tuple(settings.SECTIONS)
    own = {section for section, _ in filter(None, OWN.values())}
    given = json.loads(sections_json(full, (*names, *own), neutral=neutral, execution=execution))
    assert "checkpoint_every" not in given["train"] and "port" not in given["sglang"]
    run = {s: {k: full[s][k] for k in keys} for s, keys in execution.items()}
    given = merge_run(given, json.dumps(run), sections=(*names, *own))  # as DRAFTSMITH_RUN does
    for stage in ("regenerate", "capture", "bench"):
        job = settings.job(given, names, SCHEMA, stage=stage)
        assert job.given is given
        for name in names:
            assert plain(getattr(job, name)) == full[name], name
        backend = full[stage]["backend"]
        if OWN[backend]:
            assert plain(job.engine) == full[OWN[backend][0]], stage
        else:
            assert job.engine is None, stage


def test_a_stage_job_types_its_section_the_target_and_its_engines_section():
    job = settings.stage_job({"bench": {"backend": "sglang"}, "target": {}, "sglang": {}}, "bench")
    section, cls = OWN["sglang"]
    assert job.bench.backend == "sglang" and job.target == settings.section("target", {}, SCHEMA)
    assert job.engine == settings.fill(cls, {}, SCHEMA["properties"][section], section)
    assert job.capture is None and job.regenerate is None
    with pytest.raises(SystemExit, match="--cfg has no 'target' section"):
        settings.stage_job({"bench": {}}, "bench")
    with pytest.raises(SystemExit, match="--cfg has no 'sglang' section"):
        settings.stage_job({"capture": {"backend": "sglang"}, "target": {}}, "capture")
    hf = settings.stage_job({"regenerate": {}}, "regenerate", absent=("target",))
    assert hf.engine is None and hf.target.trust_remote_code is False
    with pytest.raises(SystemExit, match=r"--cfg: config: sglang: unknown key\(s\) ports"):
        settings.stage_job(
            {"bench": {"backend": "sglang"}, "target": {}, "sglang": {"ports": 1}}, "bench"
        )


def test_values_keep_their_type_and_arrays_are_tuples():
    train = settings.section("train", {"lr": 1, "noise_std": 0.5}, SCHEMA)
    assert train.lr == 1 and type(train.lr) is int  # the arithmetic is the dict's
    capture = settings.section("capture", {"aux_layer_ids": [5, 1, 3]}, SCHEMA)
    assert capture.aux_layer_ids == (5, 1, 3)
    assert settings.section("capture", {}, SCHEMA).aux_layer_ids == "auto"
    bench = settings.section("bench", {"files": [{"name": "a", "path": "p"}]}, SCHEMA)
    assert bench.files == (settings.BenchFile(name="a", path="p", format="prompt", size=0),)
    assert settings.section("draft", {}, SCHEMA).dflash == settings.DFlashSettings(
        layers=1, anchors=32, mask_token_id=-1, decay=7.0
    )
    with pytest.raises(AttributeError):
        train.lr = 2  # frozen


@pytest.mark.parametrize(
    ("name", "given", "needle"),
    [
        ("train", {"learning_rate": 0.1}, "train: unknown key(s) learning_rate"),
        ("capture", {"storage": {"bits": 4}}, "capture.storage: unknown key(s) bits"),
        ("train", {"epochs": "3"}, "train.epochs = '3' is not an integer"),
        ("train", {"epochs": True}, "train.epochs = True is not an integer"),
        ("capture", {"aux_layer_ids": [1, "x"]}, "capture.aux_layer_ids[1] = 'x'"),
        ("bench", {"concurrency": 1.5}, "bench.concurrency = 1.5 is not an integer or a list"),
        ("bench", {"files": [{"name": "a", "path": "p", "rows": 3}]}, "bench.files[0]: unknown"),
    ],
)
def test_unknown_keys_and_wrong_types_are_errors(name, given, needle):
    with pytest.raises(ConfigError) as e:
        settings.section(name, given, SCHEMA)
    assert needle in str(e.value)


def test_a_job_without_a_section_or_with_a_bad_key_ends_naming_it():
    with pytest.raises(SystemExit, match="--cfg has no 'draft' section"):
        settings.job({"train": {}}, ("train", "draft"), SCHEMA)
    with pytest.raises(SystemExit, match="--cfg: config: train: unknown key"):
        settings.job({"train": {"nope": 1}}, ("train",), SCHEMA)
    job = settings.job({"train": {}, "bench": {}}, ("train",), SCHEMA)
    assert (
        job.bench is None
        and job.train.epochs == SCHEMA["properties"]["train"]["properties"]["epochs"]["default"]
    )


def test_every_engine_section_is_declared_by_an_engine():
    """An engine declares its section once (WORKFLOW "settings"); ENGINE_SECTIONS holds a
    dataclass for each declared section and none that no engine declares."""
    assert set(settings.ENGINE_SECTIONS) == {own[0] for own in OWN.values() if own}
