"""Captions of the Snakemake HTML report, rendered with the configuration the benchmark ran with.

Snakemake renders a caption with the config of the `snakemake --report` call, which may differ
from the run that produced the figures (a changed `bench.num_steps` would be described under an
old plot). So the bench job renders the templates in `report/*.rst` itself, with `run` = the
"config" of its report.json (bench, data and target sections, plus the train, draft and capture
sections recorded in the draft's provenance), and writes the result to results/bench/captions/;
the rule's captions point there. Templates use `{{ run.bench.num_steps }}` and the like.

    python -m draftsmith captions --report results/bench/report.json --out results/bench/captions
"""

from __future__ import annotations

import json
from pathlib import Path

from draftsmith.runtime.files import command_parser

TEMPLATES = Path(__file__).resolve().parents[2] / "report"
CAPTIONS = ("summary", "acceptance", "accept_hist", "report_json", "training")


def render(name: str, run: dict, templates: Path = TEMPLATES) -> str:
    """One caption as reStructuredText; an unknown key in a template is an error, not a blank."""
    import jinja2

    env = jinja2.Environment(undefined=jinja2.StrictUndefined, keep_trailing_newline=True)
    text = (templates / f"{name}.rst").read_text(encoding="utf-8")
    return env.from_string(text).render(run=run)


def write_captions(report: dict, out_dir: str | Path, templates: Path = TEMPLATES) -> list[Path]:
    """Render every caption with report["config"] into out_dir/<name>.rst (atomically)."""
    from draftsmith.runtime.files import atomic_write_text

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for name in CAPTIONS:
        path = out_dir / f"{name}.rst"
        atomic_write_text(path, render(name, report["config"], templates))
        written.append(path)
    return written


def main(argv: list[str] | None = None) -> None:
    ap = command_parser("captions", __doc__)
    ap.add_argument("--report", type=Path, required=True, help="results/bench/report.json")
    ap.add_argument("--out", type=Path, required=True, help="results/bench/captions")
    args = ap.parse_args(argv)
    report = json.loads(args.report.read_text())
    for path in write_captions(report, args.out):
        print(path)
