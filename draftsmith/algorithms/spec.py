"""One draft algorithm, described once: `AlgorithmSpec`.

An algorithm is a folder, `draftsmith/algorithms/<name>/`, whose `__init__` imports its parts
and builds `SPEC` from them, and one line of the registry (`draftsmith.algorithms.MODULES`),
which imports the folder only when asked for that algorithm. The spec holds what the rest of
the package asks of an algorithm, so that nothing outside the folder names it:

- the draft it trains: switches on the EAGLE-3 draft layer (`draft`), and its parts
  (`trainer`, `exporter`, `decoder`, `estimator`): modules of its folder, each held as a `Part`
  that imports its module on first use, so that the parse-time checks, which read only the
  declarations below, do not import torch (0.5 s against 5 s per parse on a 2-core CPU);
- what it needs captured (`aux_layers`: the count of aux layer ids, None for any), checked
  at parse time against capture.aux_layer_ids;
- how each engine serves it (`serving`: the engine's flag value, or why it cannot), which the
  workflow checks at parse time and the engines read their flags from;
- what it refuses (`refuses`: a setting -> why), checked at parse time too;
- the words the report uses for it (`title`, `drafting`).

No module of an algorithm's folder imports the registry: a stage resolves the spec once
(`draftsmith.algorithms.get(draft.algorithm)` for training, or `of_export(config.json)` for a
draft already exported, which records its algorithm's name, ALGORITHM_KEY) and passes it down.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from importlib import import_module
from types import ModuleType

# the exported config.json key that records the algorithm's name
ALGORITHM_KEY = "draftsmith_algorithm"
# config.json keys SGLang or vLLM act on that no algorithm here trains: a draft carrying one
# would be served with a layer its training never had
FOREIGN = {
    "use_aux_norm": "SGLang's legacy name of fc_norm",
    "norm_before_fc": "one RMSNorm over all aux states before fc",
}


def foreign_problems(c: dict) -> list[str]:
    """The FOREIGN keys config.json `c` switches on, each with why."""
    return [
        f"config.json {k} is {c[k]!r}: {why}; draftsmith trains no draft with it"
        for k, why in FOREIGN.items()
        if c.get(k) not in (None, False)
    ]


@dataclass(frozen=True)
class Serving:
    """How one engine serves drafts of an algorithm: `flag`, the engine's name for it (SGLang's
    --speculative-algorithm, vLLM's speculative_config method), or `refused`, why it cannot."""

    flag: str | None = None
    refused: str | None = None

    def __post_init__(self):
        if (self.flag is None) == (self.refused is None):
            raise ValueError("Serving: give exactly one of flag and refused")


def no_problems(c: dict) -> list[str]:
    return []


class Part:
    """One module of an algorithm's folder, named by the folder's `__init__` and imported on the
    first attribute read (then found in sys.modules): `spec.trainer.build_draft` is the module's
    `build_draft`, and setting an attribute sets the module's. `__name__` is the module's name;
    the import test reads it as an edge of the folder."""

    __slots__ = ("__name__",)

    def __init__(self, name: str):
        self.__name__ = name

    def __getattr__(self, attr: str):
        if attr.startswith("__"):
            raise AttributeError(attr)
        return getattr(import_module(self.__name__), attr)

    def __setattr__(self, attr: str, value) -> None:  # the module's (a test patching a part)
        if attr == "__name__":
            object.__setattr__(self, attr, value)
        else:
            setattr(import_module(self.__name__), attr, value)

    def __delattr__(self, attr: str) -> None:
        delattr(import_module(self.__name__), attr)

    def __repr__(self) -> str:
        return f"Part({self.__name__!r})"


@dataclass(frozen=True)
class AlgorithmSpec:
    """What one draft algorithm is (see the module doc). `config_problems(c)`: what in an
    exported config.json it refuses (keys of another algorithm, its own keys missing).

    The parts: `trainer` has build_draft, objective, losses (draftsmith.algorithms.eagle3.train);
    `exporter` has export_draft, check_export, load_export (each given the spec: the dispatch,
    draftsmith.algorithms.export, resolves it once), config_problems, arch, layer_ids and
    family_layer_ids;
    `decoder` has runner(draft, model, aux_ids), the in-process decoder's draft side;
    `estimator` has for_run, the offline acceptance estimate (None: the algorithm has none)."""

    name: str  # the schema's draft.algorithm value
    title: str  # its name in prose ("EAGLE-3.1")
    drafting: str  # how the draft proposes, for the report's method line ({n}: draft tokens)
    serving: Mapping[str, Serving]  # engine -> how it serves this algorithm
    trainer: Part | ModuleType
    exporter: Part | ModuleType
    decoder: Part | ModuleType | None = None
    estimator: Part | ModuleType | None = None
    draft: Mapping[str, bool] = field(default_factory=dict)  # EAGLE-3 layer switches
    aux_layers: int | None = None  # the count of aux layer ids it needs (None: any count)
    speculators: bool = False  # the export also writes the speculators copy
    refuses: Mapping[str, str] = field(default_factory=dict)  # "section.key" -> why
    config_problems: Callable = no_problems

    def part(self, role: str) -> Part | ModuleType | None:
        """The algorithm's module for `role` (trainer, exporter, decoder, estimator)."""
        return getattr(self, role)

    def drafting_words(self, k: int) -> str:
        """How K draft tokens are proposed, for an engine's method line in the report."""
        tokens = f"{k} draft token{'' if k == 1 else 's'}"
        return f"{self.drafting.format(n=k)}, {tokens} per verification pass"

    def serves(self, engine: str) -> Serving:
        """How `engine` serves this algorithm (refused where the spec does not say)."""
        return self.serving.get(engine) or Serving(
            refused=f"no {engine} serving path is known for {self.title} drafts"
        )
