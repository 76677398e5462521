"""docs/ stand alone and agree with the defaults a run gets."""

from __future__ import annotations

import re
import subprocess

import yaml
from wf import ROOT, with_defaults

from draftsmith.config.checks import row_ranges
from draftsmith.data.prompts import load_sources

PAGES = sorted((ROOT / "docs").rglob("*.md")) + [ROOT / "README.md"]


def test_docs_do_not_point_outside_the_repository():
    bad = []
    for page in PAGES:
        for n, line in enumerate(page.read_text().splitlines(), start=1):
            if re.search(r"\.\./shared|shared/reference|DESIGN\.md|the DESIGN\b", line):
                bad.append(f"{page.name}:{n}: {line.strip()}")
    assert not bad, "\n".join(bad)


CONTRACTS = {
    "layer-ids.md": ("Layer ids", "Final hidden state"),
    "shard-format.md": ("Shard format", "Storage modes"),
    "loss-mask.md": ("Loss mask",),
    "vocabulary.md": ("Draft vocabulary",),
    "draft-checkpoint.md": ("Draft checkpoint", "The export check"),
    "training.md": ("Training",),
    "acceptance.md": ("Acceptance", "Sampling"),
}
TASKS = (
    "default-run.md",
    "own-model.md",
    "serving.md",
    "cluster.md",
    "scale.md",
    "algorithms.md",
    "report.md",
    "troubleshooting.md",
)


def test_a_page_per_contract_covers_it():
    index = (ROOT / "docs" / "contracts" / "README.md").read_text()
    for page, headings in CONTRACTS.items():
        text = (ROOT / "docs" / "contracts" / page).read_text()
        assert text.startswith("# Contract: "), page
        for heading in headings:
            assert re.search(rf"^## {heading}", text, flags=re.M), f"{page}: {heading}"
        assert f"`docs/contracts/{page}`" in index, page


def test_the_index_names_every_page_and_every_task_has_one():
    index = (ROOT / "docs" / "README.md").read_text()
    pages = {str(p.relative_to(ROOT)) for p in (ROOT / "docs").rglob("*.md")} - {"docs/README.md"}
    assert {p for p in pages if f"`{p}`" not in index} == set()
    assert {t for t in TASKS if not (ROOT / "docs" / t).is_file()} == set()


# docs/ paths another page names that are not (yet) there: (file, path); each entry must still
# occur, so the list empties as the pages are fixed
STALE_DOC_PATHS: set[tuple[str, str]] = set()


def test_every_docs_path_named_in_the_repository_exists():
    files = subprocess.run(
        ["git", "ls-files"], capture_output=True, text=True, cwd=ROOT, check=True
    ).stdout.split()
    named = set()
    for f in files:
        if f != "tests/test_docs.py" and (
            f.endswith((".md", ".py", ".smk", ".yaml")) or f == "Snakefile"
        ):
            text = (ROOT / f).read_text(errors="replace") if (ROOT / f).is_file() else ""
            named |= {(f, m) for m in re.findall(r"\bdocs/[\w./-]*\.md\b", text)}
    missing = {(f, m) for f, m in named if not (ROOT / m).is_file()}
    assert missing - STALE_DOC_PATHS == set()
    assert STALE_DOC_PATHS <= missing, "fixed: drop from STALE_DOC_PATHS"


def test_example_range_names_exist_in_the_default_config():
    cfg = with_defaults({})
    ranges = set(row_ranges(len(load_sources(cfg).train), cfg["data"]["rows_per_shard"]))
    bad = []
    for page in PAGES:
        for n, line in enumerate(page.read_text().splitlines(), start=1):
            if "snakemake" not in line and "--tokens" not in line and "--out" not in line:
                continue
            if re.search(r"refus|error|not a|invalid|fail|another", line, flags=re.I):
                continue  # an example of a name that is rejected
            for name in re.findall(r"rows_\d{6}-\d{6}", line):
                if name not in ranges:
                    bad.append(f"{page.name}:{n}: {name}")
    assert not bad, f"not ranges of the default config {sorted(ranges)}:\n" + "\n".join(bad)


def test_defaults_quoted_in_the_docs_are_the_schemas():
    """A sentence that says "default" and quotes `section.key: value` (or `key: value` for a
    key name only one section has) must quote the schema's default."""
    cfg = with_defaults({})
    owners: dict[str, list[str]] = {}
    for section, keys in cfg.items():
        for name in keys if isinstance(keys, dict) else ():
            owners.setdefault(name, []).append(section)
    bad = []
    for page in PAGES:
        if page.name == "config.md":
            continue  # generated from the schema itself
        # prose only: code blocks are commands, not statements about defaults
        prose = re.sub(r"```.*?```", " ", page.read_text(), flags=re.S)
        text = " ".join(prose.split())
        for n, line in enumerate(re.split(r"(?<=[.;:!?])\s+(?=[A-Z(])", text), start=1):
            # "the embedded default" names the shipped config, not a key's default value
            if "default" not in line.lower().replace("embedded default", ""):
                continue
            quoted = re.findall(r"`([a-z_]+(?:\.[a-z_]+)?): ([^`]+)`", line)
            # "`section.key` ... (the default 4)": the value named after the key
            quoted += re.findall(r"`([a-z_]+\.[a-z_]+)`[^`()]*\(the default ([\w.\-]+)\)", line)
            for key, value in quoted:
                section, _, name = key.rpartition(".")
                if not section:
                    if len(owners.get(name, [])) != 1:
                        continue
                    section = owners[name][0]
                if section in cfg and name in cfg[section] and not value.startswith(("[", "{")):
                    if yaml.safe_load(value) != cfg[section][name]:
                        want = cfg[section][name]
                        bad.append(f"{page.name} sentence {n}: {key}: {value} (default {want})")
    assert not bad, "\n".join(bad)


# ---------------------------------------------------------------- docs/architecture.md


def doc_table(page: str, heading: str) -> list[list[str]]:
    """The rows (cells) of the first table under `## <heading>` in a page."""
    text = (ROOT / page).read_text()
    section = text.split(f"\n## {heading}\n", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("|")]
    return [[c.strip() for c in row.strip().strip("|").split("|")] for row in rows[2:]]


def ticked(cell: str) -> list[str]:
    return re.findall(r"`([^`]+)`", cell)


def test_architecture_lists_every_rule_by_its_file():
    documented = {ticked(row[0])[0]: set(ticked(row[1])) for row in doc_table(ARCH, "Rules")}
    actual = {}
    for path in [ROOT / "Snakefile", *sorted((ROOT / "rules").glob("*.smk"))]:
        name = str(path.relative_to(ROOT))
        actual[name] = set(re.findall(r"^\s*rule (\w+):", path.read_text(), flags=re.M))
    assert documented == actual


def test_architecture_lists_every_role():
    documented = {ticked(row[0])[0] for row in doc_table(ARCH, "Roles")}
    assert documented == {p.stem for p in (ROOT / "envs").glob("*.txt")}


def test_architecture_lists_every_module():
    documented = {ticked(row[0])[0] for row in doc_table(ARCH, "Modules")}
    package = ROOT / "draftsmith"
    actual = {str(p.relative_to(ROOT)) for p in package.rglob("*.py") if "overlay" not in p.parts}
    assert documented == actual


ARCH = "docs/architecture.md"


# ---------------------------------------------------------------- README figures

# README tables whose figures no file in benchmarks/results/ holds; the README says so above each.
NOT_BACKED: set[str] = set()
NUMBER = re.compile(r"\d+(?:\.\d+)?")


def readme_tables() -> list[tuple[str, list[tuple[int, list[str]]]]]:
    """(heading, [(line number, cells)]) of every table in the README, header rows left out."""
    tables, heading, current = [], "", None
    for n, line in enumerate((ROOT / "README.md").read_text().splitlines(), start=1):
        if line.startswith("#"):
            heading = line
        if not line.startswith("|"):
            current = None
            continue
        if current is None:
            current = []
            tables.append((heading, current))
        current.append((n, [c.strip() for c in line.strip().strip("|").split("|")]))
    return [(h, rows[2:]) for h, rows in tables]


def results_numbers() -> dict[int, set[str]]:
    """Every number in benchmarks/results/*.md|json, as written at 0-4 decimals (a README figure
    may round a results file's)."""
    text = "\n".join(
        p.read_text() for p in sorted((ROOT / "benchmarks" / "results").glob("*.[mj][ds]*"))
    )
    out: dict[int, set[str]] = {d: set() for d in range(5)}
    for s in NUMBER.findall(text):
        for d in out:
            out[d].add(f"{float(s):.{d}f}")
    return out


def test_every_readme_table_figure_is_in_a_results_file():
    """Each number in the README's tables (label column left out) appears in a file of
    benchmarks/results/ at the README's precision, but for the tables the README marks as not
    backed (NOT_BACKED)."""
    have = results_numbers()
    tables = readme_tables()
    assert len(tables) >= 3 and NOT_BACKED <= {h for h, _ in tables}
    missing = []
    for heading, rows in tables:
        if heading in NOT_BACKED:
            continue
        for n, cells in rows:
            for cell in cells[1:]:
                for num in NUMBER.findall(cell):
                    decimals = len(num.split(".")[1]) if "." in num else 0
                    if num not in have[min(decimals, 4)]:
                        missing.append(f"README.md:{n}: {num} ({cell!r})")
    assert not missing, "README figures without a results file:\n" + "\n".join(missing)


def test_readme_marks_the_tables_that_are_not_backed():
    text = (ROOT / "README.md").read_text()
    for heading in NOT_BACKED:
        section = text.split(heading, 1)[1].split("\n#", 1)[0]
        assert "Not backed by a results file" in section, heading


def test_a_readme_table_is_checked_against_the_results_file_it_names():
    """A README table whose paragraph names a `benchmarks/results/` file takes every figure
    from that file (at the README's precision), not from any results file."""
    lines = (ROOT / "README.md").read_text().splitlines()
    checked, missing, paragraph = 0, [], []
    for n, line in enumerate(lines, start=1):
        if not line.startswith("|"):
            paragraph = [] if line.startswith("#") else [*paragraph, line]
            continue
        named = re.findall(r"`(benchmarks/results/[^`]+\.(?:md|json))`", " ".join(paragraph))
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if not named or set("".join(cells)) <= set("-: ") or cells == lines[n - 1]:
            continue
        text = "\n".join((ROOT / p).read_text() for p in named)
        have = {f"{float(s):.{d}f}" for s in NUMBER.findall(text) for d in range(5)}
        for cell in cells[1:]:
            for num in NUMBER.findall(cell):
                checked += 1
                if num not in have:
                    missing.append(f"README.md:{n}: {num} not in {named}")
    assert checked >= 8, "no README table names its results file"
    assert not missing, "\n".join(missing)


def test_every_test_the_readme_cites_as_proof_runs_in_ci():
    """The README's "What is verified where" cells name test files: each exists, and none is
    left out of CI as a whole (a module-level `extended` mark); the README says CI runs them."""
    import ast

    from test_extended_reasons import extended_marks

    [(_, rows)] = [(h, r) for h, r in readme_tables() if "verified where" in h.lower()]
    named = {m for _, cells in rows for c in cells[1:] for m in re.findall(r"test_\w+\.py", c)}
    assert len(named) >= 10, named
    for name in sorted(named):
        path = ROOT / "tests" / name
        assert path.is_file(), f"README names {name}, which does not exist"
        tree = ast.parse(path.read_text())
        module_marks = [
            node
            for node in tree.body
            if isinstance(node, ast.Assign)
            and any(getattr(t, "id", "") == "pytestmark" for t in node.targets)
        ]
        for node in module_marks:
            assert not list(extended_marks(node)), f"README cites {name}, which CI leaves out"
