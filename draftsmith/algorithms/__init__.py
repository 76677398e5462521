"""Draft algorithms: what differs between them, one module each, chosen by `draft.algorithm`.

The registry maps the schema's `draft.algorithm` values to their modules. Every module holds
plain data and functions (no torch, no I/O) with the same names:

    NAME            the schema value
    DRAFT           the draft-model switches it turns on ({} = plain EAGLE-3), read by
                    draftsmith.algorithms.eagle3.model.DraftConfig: `fc_norm` (one RMSNorm per aux state before
                    fc) and `norm_output` (the post-norm state fed back between draft steps)
    SPECULATORS     whether the export also writes the speculators copy (speculators/)
    export_keys(c)  the top-level keys it adds to the exported config.json
    extra_params(c) {SGLang parameter name: shape} it adds, for `export check` (c: config.json)
    config_problems(c)  what in an exported config.json this algorithm refuses

An algorithm that is not a switch on the EAGLE-3 draft (dflash) also names its own modules:
TRAINER (draft, objective, losses) and EXPORTER (export, contract check, load back); `part`
imports them.

The exported config.json names no algorithm: both engines read the same architecture
(`LlamaForCausalLMEagle3`) and switch on its keys, so `of_export` tells the algorithm from
those keys. Keys that either engine would apply but no algorithm here trains are refused for
every algorithm (FOREIGN).

May import: draftsmith.runtime, config, data, targets, hidden (an algorithm's folder imports
no other algorithm's, except the shared EAGLE-3 draft layers).
"""

from __future__ import annotations

from importlib import import_module
from types import ModuleType

DEFAULT = "eagle3"
MODULES = {
    "eagle3": "draftsmith.algorithms.eagle3",
    "eagle3.1": "draftsmith.algorithms.eagle31",
    "dflash": "draftsmith.algorithms.dflash",
}
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


def get(name: str) -> ModuleType:
    """The module of algorithm `name` (a draft.algorithm value)."""
    if name not in MODULES:
        raise AlgorithmError(f"draft.algorithm {name!r} is not one of {names()}")
    return import_module(MODULES[name])


def of_config(cfg: dict) -> ModuleType:
    """The algorithm a workflow config selects (draft.algorithm; x-omit-default: a job's config
    lacks the key at its default)."""
    return get((cfg.get("draft") or {}).get("algorithm", "eagle3"))


def of_export(c: dict) -> ModuleType:
    """The algorithm an exported config.json was written by, told from its keys."""
    if "dflash_config" in c or "DFlashDraftModel" in (c.get("architectures") or []):
        return get("dflash")
    return get("eagle3.1" if c.get("fc_norm") or c.get("norm_output") else DEFAULT)


def part(algo: ModuleType, role: str) -> ModuleType | None:
    """An algorithm's own module for `role` (TRAINER, EXPORTER), None where it uses the
    EAGLE-3 draft's (draftsmith.train.loop / draftsmith.algorithms.export themselves)."""
    name = getattr(algo, role, None)
    return import_module(name) if name else None


def export_problems(c: dict) -> list[str]:
    """What is wrong with config.json `c` for the algorithm its keys name (plus FOREIGN keys)."""
    out = [
        f"config.json {k} is {c[k]!r}: {why}; draftsmith trains no draft with it"
        for k, why in FOREIGN.items()
        if c.get(k) not in (None, False)
    ]
    algo = of_export(c)
    own = part(algo, "EXPORTER")
    return out + (own.config_problems if own else algo.config_problems)(c)
