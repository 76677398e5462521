"""Export an algorithm's draft, check an exported draft, read one back: the dispatch to the
algorithm's own exporter (`spec.exporter`: draftsmith.algorithms.eagle3.export for EAGLE-3 and
EAGLE-3.1, draftsmith.algorithms.dflash.export for DFlash), plus what every artifact shares
(draftsmith.algorithms.artifact: the error type, the provenance, the target facts).

The algorithm of a draft being exported is its config's (`draft.config.algorithm`, or the spec
a stage resolved and passes as `spec`); that of an exported directory is the name its
config.json records (`algorithms.of_export`). Each is resolved here once and handed down.

CLI: `python -m draftsmith export check results/draft`.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from draftsmith import algorithms
from draftsmith.algorithms.artifact import (
    PROVENANCE,
    WEIGHTS,
    ExportError,
    family_of,
    read_provenance,
    say_family,
    serve_gate,
    target_embedding,
    verifier_ref,
)
from draftsmith.algorithms.spec import AlgorithmSpec
from draftsmith.runtime.files import subcommand_parser
from draftsmith.targets import serving

__all__ = [
    "PROVENANCE",
    "WEIGHTS",
    "ExportError",
    "check_export",
    "export_draft",
    "load_export",
    "read_provenance",
    "say_family",
    "serve_gate",
    "target_embedding",
    "target_family",
    "verifier_ref",
]


def spec_of(draft_config, spec: AlgorithmSpec | None) -> AlgorithmSpec:
    """`spec` as given, else the one the draft's config names (its `algorithm`)."""
    return spec if spec is not None else algorithms.of_draft(draft_config)


def target_family(target_dir, cfg, trained_length: int, spec: AlgorithmSpec | None = None) -> dict:
    """The target family's facts for the provenance (`draftsmith.targets.families.family_facts`),
    read from the target's whole config.json (a multimodal wrapper's own model type included),
    with what the algorithm's exporter adds (the layer ids each engine feeds the draft)."""
    full, facts = family_of(target_dir, cfg.rope_scaling, trained_length)
    return spec_of(cfg, spec).exporter.family_layer_ids(full, cfg, facts)


def export_draft(
    draft, out_dir, provenance: dict, *, spec: AlgorithmSpec | None = None, **kw
) -> None:
    """Write `out_dir` atomically and contract-check it first, by the exporter of the draft's
    algorithm (`spec`, else the one its config names). `kw`: the exporter's own arguments
    (EAGLE-3's `embed`, `verifier`, `num_tokens`; every exporter's `family`)."""
    spec = spec_of(draft.config, spec)
    spec.exporter.export_draft(draft, out_dir, provenance, spec=spec, **kw)


def exported_spec(out: Path) -> AlgorithmSpec:
    """The algorithm an exported directory's config.json records (refused when unreadable)."""
    try:
        return algorithms.open_draft(out).spec
    except algorithms.AlgorithmError as e:
        raise ExportError(str(e)) from None


def check_export(out_dir: str | os.PathLike, metrics: str | os.PathLike | None = None) -> None:
    """Raise ExportError listing every way `out_dir` breaks its algorithm's contract, or holds
    NaN or infinite weights, or (with `metrics`, when that file exists) comes from a training run
    whose metrics end non-finite."""
    out = Path(out_dir)
    for p in (out / "config.json", out / WEIGHTS):
        if not p.is_file():
            raise ExportError(f"{p} is missing")
    spec = exported_spec(out)
    spec.exporter.check_export(out, metrics, spec=spec)


def load_export(out_dir, spec: AlgorithmSpec | None = None):
    """The exported draft back as its algorithm's draft module (contract-checked first), by
    `spec` where the caller opened the draft already, else the one its config.json records."""
    spec = spec if spec is not None else exported_spec(Path(out_dir))
    if not (Path(out_dir) / WEIGHTS).is_file():
        raise ExportError(f"{Path(out_dir) / WEIGHTS} is missing")
    return spec.exporter.load_export(out_dir, spec=spec)


def main(argv: list[str] | None = None) -> None:
    ap, sub = subcommand_parser("export", __doc__)
    chk = sub.add_parser("check", help="contract-check an exported draft directory")
    chk.add_argument("draft_dir")
    chk.add_argument(
        "--strict",
        action="store_true",
        help="fail when a pinned engine cannot serve the draft's target as trained (the "
        "target_family.serving entries of draftsmith_draft.json); warn otherwise",
    )
    chk.add_argument(
        "--metrics",
        help="training metrics whose last record must be finite (default: "
        "<draft_dir>/../train/metrics.jsonl, the workflow's layout, when it exists)",
    )
    args = ap.parse_args(argv)
    if args.metrics and not Path(args.metrics).is_file():
        raise SystemExit(f"--metrics {args.metrics}: no such file")
    metrics = args.metrics or Path(args.draft_dir).resolve().parent / "train" / "metrics.jsonl"
    try:
        check_export(args.draft_dir, metrics)
    except ExportError as e:
        raise SystemExit(str(e)) from None
    family = read_provenance(args.draft_dir).get("target_family") or {}
    for w in family.get("warnings", []):
        print(f"{args.draft_dir}: warning: {w}", file=sys.stderr)
    bad = serving.problems(family.get("serving", []))
    if args.strict and bad:
        raise SystemExit(f"{args.draft_dir}: --strict: " + "; ".join(bad))
    c = json.loads((Path(args.draft_dir) / "config.json").read_text())
    algo = exported_spec(Path(args.draft_dir))
    print(f"{args.draft_dir}: OK ({algo.exporter.arch(c)} contract, {algo.name})")
