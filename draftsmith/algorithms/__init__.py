"""Draft algorithms: one folder each (`<name>/`, its `SPEC`, draftsmith.algorithms.spec), chosen
by `draft.algorithm` and resolved once per stage through this registry.

`get(name)` is the spec of a `draft.algorithm` value; `of_export(c)` the spec of an exported
config.json, which records the name it was trained as (`ALGORITHM_KEY`; a draft exported before
the key existed is told from its keys) and is checked against its keys for consistency.
`serving_problems(cfg)` and `setting_problems(cfg)` are what the workflow refuses at parse time:
an engine that cannot serve the algorithm, a setting the algorithm does not support.

Keys that either engine would apply but no algorithm here trains are refused for every
algorithm (FOREIGN).

May import: draftsmith.runtime, config, data, targets, hidden (an algorithm's folder imports
no other algorithm's, except the shared EAGLE-3 draft layers).
"""

from __future__ import annotations

from importlib import import_module

from draftsmith.algorithms.spec import AlgorithmSpec

DEFAULT = "eagle3"
# draft.algorithm value -> the module (folder) whose SPEC describes it
MODULES = {
    "eagle3": "draftsmith.algorithms.eagle3",
    "eagle3.1": "draftsmith.algorithms.eagle31",
    "dflash": "draftsmith.algorithms.dflash",
}
# the exported config.json key that records the algorithm's name
ALGORITHM_KEY = "draftsmith_algorithm"
# config.json keys SGLang or vLLM act on that no algorithm here trains: a draft carrying one
# would be served with a layer its training never had
FOREIGN = {
    "use_aux_norm": "SGLang's legacy name of fc_norm",
    "norm_before_fc": "one RMSNorm over all aux states before fc",
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


def by_keys(c: dict) -> str:
    """The algorithm an exported config.json's keys say (the exports' own markers)."""
    if "dflash_config" in c or "DFlashDraftModel" in (c.get("architectures") or []):
        return "dflash"
    return "eagle3.1" if c.get("fc_norm") or c.get("norm_output") else DEFAULT


def of_export(c: dict) -> AlgorithmSpec:
    """The algorithm an exported config.json was written by: the name it records, else (an
    export from before the key) the one its keys say."""
    return get(c.get(ALGORITHM_KEY) or by_keys(c))


def part(spec: AlgorithmSpec, role: str):
    """An algorithm's own module for `role` (trainer, exporter, decoder), None where it uses
    the EAGLE-3 draft's (draftsmith.train.loop, draftsmith.algorithms.export themselves)."""
    return spec.part(role)


def export_problems(c: dict) -> list[str]:
    """What is wrong with config.json `c` for the algorithm it records (plus FOREIGN keys): the
    algorithm's own checks refuse keys of another (EAGLE-3.1's switches in an EAGLE-3 draft)."""
    out = [
        f"config.json {k} is {c[k]!r}: {why}; draftsmith trains no draft with it"
        for k, why in FOREIGN.items()
        if c.get(k) not in (None, False)
    ]
    recorded = c.get(ALGORITHM_KEY)
    if recorded is not None and recorded not in MODULES:
        return out + [f"config.json {ALGORITHM_KEY} {recorded!r} is not one of {names()}"]
    spec = of_export(c)  # its config_problems check the keys against the recorded name
    own = spec.part("exporter")
    return out + (own.config_problems if own else spec.config_problems)(c)


def serving_problems(cfg: dict) -> list[str]:
    """The engines this config benchmarks with that cannot serve its algorithm (parse time)."""
    spec = of_config(cfg)
    backend = cfg["bench"]["backend"]
    serving = spec.serves(backend)
    if serving.refused is None:
        return []
    return [f"draft.algorithm {spec.name} with bench.backend {backend}: {serving.refused}"]


def refusals(cfg: dict, schema: dict | None = None) -> list[str]:
    """What the workflow refuses at parse time for this config's algorithm (serving_problems,
    setting_problems): before any job runs."""
    return serving_problems(cfg) + setting_problems(cfg, schema)


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
