"""One draft algorithm, described once: `AlgorithmSpec`.

An algorithm is a folder, `draftsmith/algorithms/<name>/`, whose `__init__` defines `SPEC`, and
one line of the registry (`draftsmith.algorithms.MODULES`). The spec holds what the rest of the
package asks of an algorithm, so that nothing outside the folder names it:

- the draft it trains: switches on the EAGLE-3 draft layer (`draft`), or its own modules by
  name (`trainer`, `exporter`, `decoder`), imported only when a stage asks (`part`);
- how each engine serves it (`serving`: the engine's flag value, or why it cannot), which the
  workflow checks at parse time and the engines read their flags from;
- what it refuses (`refuses`: a setting -> why), checked at parse time too;
- the words the report uses for it (`title`, `drafting`).

A stage resolves the spec once (`draftsmith.algorithms.get(draft.algorithm)` for training, or
`of_export(config.json)` for a draft already exported, which records its algorithm's name) and
passes it down.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import ModuleType


@dataclass(frozen=True)
class Serving:
    """How one engine serves drafts of an algorithm: `flag`, the engine's name for it (SGLang's
    --speculative-algorithm, vLLM's speculative_config method), or `refused`, why it cannot."""

    flag: str | None = None
    refused: str | None = None

    def __post_init__(self):
        if (self.flag is None) == (self.refused is None):
            raise ValueError("Serving: give exactly one of flag and refused")


def no_keys(cfg) -> dict:
    return {}


def no_params(c: dict) -> dict[str, tuple]:
    return {}


def no_problems(c: dict) -> list[str]:
    return []


@dataclass(frozen=True)
class AlgorithmSpec:
    """What one draft algorithm is (see the module doc). `export_keys(cfg)`: the top-level keys
    it adds to the exported config.json; `extra_params(c)`: {SGLang parameter: shape} it adds,
    for the export check; `config_problems(c)`: what in an exported config.json it refuses."""

    name: str  # the schema's draft.algorithm value
    title: str  # its name in prose ("EAGLE-3.1")
    drafting: str  # how the draft proposes, for the report's method line ({n}: draft tokens)
    serving: Mapping[str, Serving]  # engine -> how it serves this algorithm
    draft: Mapping[str, bool] = field(default_factory=dict)  # EAGLE-3 layer switches
    speculators: bool = False  # the export also writes the speculators copy
    arch: str | None = None  # the architecture its own exporter writes (None: EAGLE-3's)
    trainer: str = ""  # module: build_draft, objective, losses (draftsmith.algorithms.eagle3.train)
    exporter: str | None = None  # module: export_draft, check_export, load_export, ...
    decoder: str = ""  # module: runner(draft, model, aux_ids), the in-process decoder's draft side
    estimator: str | None = None  # module: for_run, the offline acceptance estimate
    refuses: Mapping[str, str] = field(default_factory=dict)  # "section.key" -> why
    export_keys: Callable = no_keys
    extra_params: Callable = no_params
    config_problems: Callable = no_problems

    def part(self, role: str) -> ModuleType | None:
        """The algorithm's module for `role` (trainer, exporter, decoder); None for an exporter
        it does not name (it uses the EAGLE-3 draft's export, draftsmith.algorithms.export)."""
        name = getattr(self, role)
        return importlib.import_module(name) if name else None

    def serves(self, engine: str) -> Serving:
        """How `engine` serves this algorithm (refused where the spec does not say)."""
        return self.serving.get(engine) or Serving(
            refused=f"no {engine} serving path is known for {self.title} drafts"
        )
