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


# ---------------------------------------------------------------- tests the pages cite

CITED = re.compile(r"\b(?:tests/)?(test_\w+\.py)(?:::(\w+))?")
MARKER_EXPR = re.compile(r'pytest -m "([^"]+)"')
ENGINES = ("sglang", "vllm")  # markers of the engine a case runs; a sentence naming one cites those


def ci_marker_expressions() -> list[str]:
    """The marker expressions .ci/run selects tests by, with `extended` left out as .ci/run
    leaves it out (its `$(not_extended)`)."""
    text = (ROOT / ".ci" / "run").read_text()
    found = [e.replace("$(not_extended)", " and not extended") for e in MARKER_EXPR.findall(text)]
    assert found, ".ci/run selects no tests by marker"
    return found


def selected(expression: str, marks: set[str]) -> bool:
    """Whether a pytest `-m` expression (names, and, or, not, parentheses) selects `marks`."""
    names = set(re.findall(r"[A-Za-z_]\w*", expression)) - {"and", "or", "not"}
    return eval(expression, {"__builtins__": {}}, {n: n in marks for n in names})


def mark_names(node) -> set[str]:
    """The `pytest.mark.<name>` names in an expression (a decorator, a pytestmark value, a
    pytest.param's marks), `parametrize` and the like included."""
    import ast

    out = set()
    for sub in ast.walk(node):
        if isinstance(sub, ast.Attribute) and isinstance(sub.value, ast.Attribute):
            if sub.value.attr == "mark":
                out.add(sub.attr)
    return out


def case_marks(path) -> dict[str, list[set[str]]]:
    """{test function: the mark sets of its cases} of a test file, read from the source: the
    module's and its class's `pytestmark`, the decorators, and each `pytest.param`'s marks
    (a function with no marked case has one case)."""
    import ast

    tree = ast.parse(path.read_text())

    def assigned(body) -> set[str]:
        return {
            m
            for node in body
            if isinstance(node, ast.Assign)
            and any(getattr(t, "id", "") == "pytestmark" for t in node.targets)
            for m in mark_names(node.value)
        }

    out: dict[str, list[set[str]]] = {}

    def visit(body, inherited: set[str]) -> None:
        for node in body:
            if isinstance(node, ast.ClassDef):
                own = {m for d in node.decorator_list for m in mark_names(d)}
                visit(node.body, inherited | own | assigned(node.body))
            elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                if not node.name.startswith("test"):
                    continue
                marks = set(inherited)
                cases = []
                for d in node.decorator_list:
                    params = [
                        c
                        for c in ast.walk(d)
                        if isinstance(c, ast.Call) and getattr(c.func, "attr", "") == "param"
                    ]
                    for p in params:
                        given = [k.value for k in p.keywords if k.arg == "marks"]
                        cases.append(set().union(*(mark_names(v) for v in given)))
                    outside = mark_names(d) - {
                        m for p in params for k in p.keywords for m in mark_names(k.value)
                    }
                    marks |= outside
                out[node.name] = [marks | c for c in cases] or [marks]

    visit(tree.body, assigned(tree.body))
    return out


def citation_units(text: str) -> list[str]:
    """A page cut where a citation's context ends: each table cell, each line of a code block,
    each sentence of a paragraph or list item."""
    units, paragraph, in_code = [], [], False

    def flush() -> None:
        joined = " ".join(paragraph)
        units.extend(re.split(r"(?<=[.!?])\s+(?=[A-Z(`*])", joined))
        paragraph.clear()

    for line in text.splitlines():
        if line.startswith("```"):
            flush()
            in_code = not in_code
        elif in_code:
            units.append(line)
        elif line.startswith("|"):
            flush()
            units.extend(line.strip().strip("|").split("|"))
        elif not line.strip() or line.startswith("#") or re.match(r"\s*(?:[-*]|\d+\.)\s", line):
            flush()
            paragraph.append(line) if line.strip() and not line.startswith("#") else None
        else:
            paragraph.append(line.strip())
    flush()
    return units


def citation_problems(text: str, name: str, tests=ROOT / "tests") -> list[str]:
    """Each test a page cites (`tests/test_x.py`, `test_x.py`, `...::test_name`) exists and is
    run by CI (.ci/run's marker expressions, `extended` left out); a cited test that is
    entirely marked extended is cited with the word "extended" in the same sentence or cell."""
    exprs, marks, bad = ci_marker_expressions(), {}, []
    for unit in citation_units(text):
        for file, func in CITED.findall(unit):
            path = tests / file
            if not path.is_file():
                bad.append(f"{name}: cites {file}, which does not exist")
                continue
            if file not in marks:
                marks[file] = case_marks(path)
            if func and func not in marks[file]:
                bad.append(f"{name}: cites {file}::{func}, which does not exist")
                continue
            cases = [c for f, cs in marks[file].items() if not func or f == func for c in cs]
            if not cases:
                continue  # a file with no test function
            # a sentence about one engine cites the file's cases of that engine, where it has some
            engines = {e for e in ENGINES if e in unit.lower()}
            if len(engines) == 1:
                cases = [c for c in cases if engines <= c] or cases
            if all("extended" in c for c in cases):
                if "extended" not in unit.lower():
                    bad.append(f"{name}: cites {file}{'::' + func if func else ''}, marked "
                               f"extended (not run by CI), without saying so: {unit.strip()!r}")  # fmt: skip
            elif not any(selected(e, c) for e in exprs for c in cases):
                bad.append(f"{name}: cites {file}{'::' + func if func else ''}, which no "
                           f".ci/run step selects: {unit.strip()!r}")  # fmt: skip
    return bad


def test_every_test_a_page_cites_exists_and_runs_in_ci_or_is_called_extended():
    """The docs and the README cite tests as proof: each cited file (and `::test`) exists, and
    CI runs it, but for a test marked `extended` in full, whose citation says "extended" in the
    same sentence or table cell (CI leaves those out, `DRAFTSMITH_CI_EXTENDED=1` runs them)."""
    bad = []
    for page in PAGES:
        bad += citation_problems(page.read_text(), str(page.relative_to(ROOT)))
    assert not bad, "\n".join(bad)


def test_the_citation_check_catches_a_missing_and_an_unsaid_extended_test():
    missing = "Proved by `tests/test_no_such_file.py`."
    gone = "Proved by `tests/test_docs.py::test_no_such_test`."
    unsaid = "CI proves it (`tests/test_vllm.py::test_vllm_sampling_matches_ours`)."
    said = "An extended test proves it (`tests/test_vllm.py::test_vllm_sampling_matches_ours`)."
    cell = "| a | `test_sglang.py` (CI) |\n| b | `test_sglang.py` (extended) |\n"
    ci = "CI runs `tests/test_docs.py` and `test_vllm.py`."
    # test_end_to_end.py's SGLang case is extended, its vLLM case is not
    sglang = "SGLang's counters equal ours (`tests/test_end_to_end.py`)."
    vllm = "vLLM's counters equal ours (`tests/test_end_to_end.py`)."
    assert citation_problems(sglang, "p") and not citation_problems(vllm, "p")
    assert citation_problems(missing, "p") and citation_problems(gone, "p")
    assert citation_problems(unsaid, "p") and not citation_problems(said, "p")
    assert len(citation_problems(cell, "p")) == 1
    assert citation_problems(ci, "p") == []
