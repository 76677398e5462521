"""What every exported draft shares, whatever its algorithm: the error type, the file names,
the provenance beside the weights, and the target facts an export records or needs (its family
and serving findings, its input embedding, the speculators `verifier` entry).

The algorithms' exporters (`spec.exporter`: draftsmith.algorithms.eagle3.export,
draftsmith.algorithms.dflash.export) build on this module; draftsmith.algorithms.export
dispatches to them. It imports no algorithm and not the registry.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import torch

from draftsmith.runtime.files import read_json_object
from draftsmith.targets import layerids, serving
from draftsmith.targets.families import family_facts
from draftsmith.targets.layout import LayoutError, read_pieces

WEIGHTS = "model.safetensors"
PROVENANCE = "draftsmith_draft.json"

log = logging.getLogger("draftsmith.algorithms.export")


class ExportError(ValueError):
    """The exported draft is not what the engines' loaders will consume."""


def read_config(path: Path, error: type[ExportError] = ExportError) -> dict:
    """An exported draft's JSON file (its config.json) as a dict; `error` naming the file where
    it cannot be read or is not a JSON object (runtime.files.read_json_object)."""
    return read_json_object(path, error, "draft config")


def read_provenance(draft_dir) -> dict:
    """The draft's provenance (PROVENANCE beside its weights), or {} for a draft without one."""
    path = Path(draft_dir) / PROVENANCE
    return json.loads(path.read_text()) if path.is_file() else {}


def family_of(target_dir, rope_scaling, trained_length: int) -> tuple[dict, dict]:
    """(the target's whole config.json, its family's facts for the provenance:
    `draftsmith.targets.families.family_facts` plus the serving findings and their warnings)."""
    full = json.loads((Path(target_dir) / "config.json").read_text())
    facts = family_facts(full, rope_scaling, trained_length)
    facts["serving"] = serving.findings(full)
    facts["warnings"] += serving.warnings(facts["serving"])
    return full, facts


def serve_gate(target_dir, mode: str, ids: list[int] | None = None) -> None:
    """draft.serve_check strict: refuse, before training, a target an engine of the pinned
    wheels cannot serve an EAGLE-3 draft for (or serves with other aux states). Aux layer ids
    (`ids`, SGLang numbering) that an engine would read as other layers are refused whatever
    the mode (draftsmith.targets.layerids): the export would refuse them after training."""
    full = json.loads((Path(target_dir) / "config.json").read_text())
    if ids is not None:
        bad = layerids.setting_problems(full, list(ids))
        if bad:
            raise ExportError(
                f"{target_dir}: a pinned engine would feed the draft other layers than "
                "training uses:\n  " + "\n  ".join(bad)
            )
    problems = serving.problems(serving.findings(full))
    if problems and mode == "strict":
        raise ExportError(
            f"{target_dir}: draft.serve_check is strict and a pinned engine cannot serve this "
            "target's EAGLE-3 draft as trained:\n  " + "\n  ".join(problems)
        )


def say_family(where, facts: dict) -> None:
    """The family warnings on stderr (the job's log): RoPE not carried, serving per engine."""
    for w in facts["warnings"]:
        log.warning("%s: %s", where, w)


def verifier_ref(target_dir: str | os.PathLike) -> dict:
    """The speculators `verifier` entry for a target directory: a path relative to the
    current directory (the workflow root) when the target lies below it, and its architectures."""
    target = Path(target_dir)
    rel = os.path.relpath(target.absolute())
    arch = json.loads((target / "config.json").read_text()).get("architectures") or []
    if not arch:
        raise ExportError(f"{target}/config.json has no architectures: speculators needs them")
    return {"name_or_path": str(target) if rel.startswith("..") else rel, "architectures": arch}


def target_embedding(target_dir: str | os.PathLike) -> torch.Tensor:
    """The target's input embedding exactly as stored: the text model's `embed_tokens.weight`,
    under whatever prefix a wrapped checkpoint puts it (draftsmith.targets.layout)."""
    try:
        return read_pieces(target_dir, roles=("embed",))["embed"]
    except LayoutError as e:
        raise ExportError(str(e)) from None
