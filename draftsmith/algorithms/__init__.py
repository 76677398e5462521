"""Draft algorithms: one folder each (`<name>/`, its `SPEC`, draftsmith.algorithms.spec), chosen
by `draft.algorithm` and resolved once per stage through this registry, which imports a folder
only when asked for its algorithm (the folder's `__init__` names the parts its spec holds,
each imported on first use: spec.Part).

`get(name)` is the spec of a `draft.algorithm` value; `of_export(c)` the spec of an exported
config.json, which records the name it was trained as (`ALGORITHM_KEY`; a draft exported before
the key existed is told from its keys) and is checked against its keys for consistency;
`open_draft(dir)` an exported draft as the bench stage opens it once (its config and spec, handed
to the engines).
`serving_problems(cfg)`, `setting_problems(cfg)` and `capture_problems(cfg)` are what the
workflow refuses at parse time: an engine that cannot serve the algorithm, a setting the
algorithm does not support, a count of captured layers it cannot use.

Keys that either engine would apply but no algorithm here trains are refused for every
algorithm (draftsmith.algorithms.spec.FOREIGN).

May import: draftsmith.runtime, config, data, targets, hidden (an algorithm's folder imports
no other algorithm's, except the shared EAGLE-3 draft layers, and never this registry).
"""

from __future__ import annotations

from dataclasses import dataclass
from importlib import import_module
from pathlib import Path

from draftsmith.algorithms.spec import ALGORITHM_KEY, AlgorithmSpec, foreign_problems
from draftsmith.runtime.files import read_json_object

DEFAULT = "eagle3"
# draft.algorithm value -> the module (folder) whose SPEC describes it
MODULES = {
    "eagle3": "draftsmith.algorithms.eagle3",
    "eagle3.1": "draftsmith.algorithms.eagle31",
    "dflash": "draftsmith.algorithms.dflash",
}


class AlgorithmError(ValueError):
    """An unknown draft.algorithm, or a config.json no algorithm here exports."""


def names() -> list[str]:
    return list(MODULES)


def get(name: str) -> AlgorithmSpec:
    """The spec of algorithm `name` (a draft.algorithm value)."""
    if name not in MODULES:
        raise AlgorithmError(f"draft.algorithm {name!r} is not one of {names()}")
    spec = import_module(MODULES[name]).SPEC
    if spec.name != name:
        raise AlgorithmError(f"{MODULES[name]}: SPEC.name is {spec.name!r}, registered as {name!r}")
    return spec


def of_config(cfg: dict) -> AlgorithmSpec:
    """The algorithm a workflow config selects (draft.algorithm; x-omit-default: a job's config
    lacks the key at its default)."""
    return get((cfg.get("draft") or {}).get("algorithm", DEFAULT))


def of_draft(draft_config) -> AlgorithmSpec:
    """The algorithm a draft model's config names (its `algorithm` field; EAGLE-3 where it has
    none): for callers handed a draft without its spec (tests, benchmarks); the stages and
    engines pass the spec they resolved instead."""
    return get(getattr(draft_config, "algorithm", None) or DEFAULT)


def by_keys(c: dict) -> str:
    """The algorithm an exported config.json's keys say (the exports' own markers)."""
    if "dflash_config" in c or "DFlashDraftModel" in (c.get("architectures") or []):
        return "dflash"
    return "eagle3.1" if c.get("fc_norm") or c.get("norm_output") else DEFAULT


def of_export(c: dict) -> AlgorithmSpec:
    """The algorithm an exported config.json was written by: the name it records, else (an
    export from before the key) the one its keys say."""
    return get(c.get(ALGORITHM_KEY) or by_keys(c))


@dataclass(frozen=True)
class OpenDraft:
    """An exported draft as a stage opens it once: its directory, its config.json and the spec
    of the algorithm it was written by; the stage hands these to the engines."""

    path: Path
    config: dict
    spec: AlgorithmSpec


def open_draft(draft: str | Path) -> OpenDraft:
    """The exported draft in directory `draft` (a speculators copy inside an export is opened
    as that export): its config.json read and its algorithm resolved (of_export). AlgorithmError
    names the file where it is missing, not JSON or of no algorithm here."""
    path = Path(draft)
    c = read_json_object(path / "config.json", AlgorithmError, "draft config")
    if "speculators_model_type" in c and (path.parent / "config.json").is_file():
        c = read_json_object(path.parent / "config.json", AlgorithmError, "draft config")
    try:
        return OpenDraft(path, c, of_export(c))
    except AlgorithmError as e:
        raise AlgorithmError(f"{path}/config.json: {e}") from None


def export_problems(c: dict) -> list[str]:
    """What is wrong with config.json `c` for the algorithm it records (plus FOREIGN keys): the
    algorithm's own checks refuse keys of another (EAGLE-3.1's switches in an EAGLE-3 draft)."""
    out = foreign_problems(c)
    recorded = c.get(ALGORITHM_KEY)
    if recorded is not None and recorded not in MODULES:
        return out + [f"config.json {ALGORITHM_KEY} {recorded!r} is not one of {names()}"]
    return out + of_export(c).config_problems(c)  # the keys against the recorded name


def serving_problems(cfg: dict) -> list[str]:
    """The engines this config benchmarks with that cannot serve its algorithm (parse time)."""
    spec = of_config(cfg)
    backend = cfg["bench"]["backend"]
    serving = spec.serves(backend)
    if serving.refused is None:
        return []
    return [f"draft.algorithm {spec.name} with bench.backend {backend}: {serving.refused}"]


def capture_problems(cfg: dict) -> list[str]:
    """The captured-layer count this config asks for (capture.aux_layer_ids; auto: the
    default count) where its algorithm needs another (spec.aux_layers); `cfg`: the validated
    workflow config (every key present)."""
    from draftsmith.config.checks import aux_layer_count

    spec = of_config(cfg)
    setting = cfg["capture"]["aux_layer_ids"]
    if spec.aux_layers is None or aux_layer_count(setting) == spec.aux_layers:
        return []
    return [
        f"draft.algorithm {spec.name} with capture.aux_layer_ids {setting!r} "
        f"({aux_layer_count(setting)} layers): a {spec.title} draft reads exactly "
        f"{spec.aux_layers} captured layers; list {spec.aux_layers} ids"
    ]


def refusals(cfg: dict, schema: dict | None = None) -> list[str]:
    """What the workflow refuses at parse time for this config's algorithm (serving_problems,
    setting_problems, capture_problems): before any job runs."""
    return serving_problems(cfg) + setting_problems(cfg, schema) + capture_problems(cfg)


def off_value(key: str, schema: dict):
    """The schema's default of a "section.key" setting: its off value (a refused setting left
    at its default is no use of it)."""
    section, _, name = key.partition(".")
    return schema["properties"][section]["properties"][name]["default"]


def setting_problems(cfg: dict, schema: dict | None = None) -> list[str]:
    """The settings of this config its algorithm refuses (spec.refuses), each with why; a
    setting at the schema's default (its off value) is no use of it."""
    from draftsmith.config.checks import load_schema

    spec = of_config(cfg)
    if not spec.refuses:
        return []
    schema = load_schema() if schema is None else schema
    out = []
    for key, why in spec.refuses.items():
        section, _, name = key.partition(".")
        value = (cfg.get(section) or {}).get(name)
        if value is not None and value != off_value(key, schema):
            out.append(f"draft.algorithm {spec.name} with {key} {value!r}: {why}")
    return out
