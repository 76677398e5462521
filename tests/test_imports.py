"""The package's import graph, read from the source (every import statement, at module level and
inside functions alike: a lazy import is still a dependency).

Three rules: no cycles in `draftsmith/`, no module imports another's private (`_`) names, and no
engine (`draftsmith/engines/`) imports a stage CLI
(a module the rules run as `python -m draftsmith.<module>`): the stage CLIs call the engines, so
what both need lives in a lower module that each imports.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "draftsmith"


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def package_modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(PACKAGE.rglob("*.py")) if "overlay" not in p.parts}


def imports_of(name: str, path: Path, modules: set[str]) -> set[str]:
    """The package modules `name` imports anywhere in its file (`from a import b` counts as
    `a.b` when that is a module, else `a`)."""
    is_package = path.name == "__init__.py"
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = name.split(".")
                anchor = anchor if is_package else anchor[:-1]
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            targets = [f"{base}.{alias.name}" for alias in node.names] + [base]
        else:
            continue
        for target in targets:
            while target and target not in modules:
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    # `from draftsmith.x import y` also names `draftsmith` (the package); importing a submodule
    # runs its package's __init__, which is no dependency of the importer's own making.
    found.discard("draftsmith")
    return found


def import_graph() -> dict[str, set[str]]:
    modules = package_modules()
    return {name: imports_of(name, path, set(modules)) for name, path in modules.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle as a path [a, b, ..., a], or None (depth-first search, three colours)."""
    state: dict[str, int] = {}  # 1: on the stack, 2: done
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt) :] + [nxt]
            if nxt not in state:
                cycle = visit(nxt)
                if cycle:
                    return cycle
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state:
            cycle = visit(node)
            if cycle:
                return cycle
    return None


def stage_cli_modules() -> set[str]:
    """The stage CLIs: modules the rules run (`-m draftsmith.<module>` in `rules/*.smk`) that
    hand their stage to an engine (they import the registry, `draftsmith.engines`). Library
    modules that also have a CLI (`tokens`, `target`, `shards`, ...) are not stage CLIs."""
    run: set[str] = set()
    for smk in sorted((ROOT / "rules").glob("*.smk")):
        run.update(re.findall(r"-m (draftsmith(?:\.\w+)+)", smk.read_text()))
    graph = import_graph()
    return {name for name in run if "draftsmith.engines" in graph.get(name, ())}


def test_the_graph_reader_sees_lazy_and_relative_imports(tmp_path):
    src = tmp_path / "draftsmith" / "pkg"
    src.mkdir(parents=True)
    (src / "__init__.py").write_text("from . import a\n")
    (src / "a.py").write_text("def f():\n    from draftsmith.pkg.b import g\n    return g\n")
    (src / "b.py").write_text("import draftsmith.pkg.a\n")
    files = {
        "draftsmith.pkg": src / "__init__.py",
        "draftsmith.pkg.a": src / "a.py",
        "draftsmith.pkg.b": src / "b.py",
    }
    graph = {name: imports_of(name, path, set(files)) for name, path in files.items()}
    assert graph["draftsmith.pkg"] == {"draftsmith.pkg.a"}
    assert graph["draftsmith.pkg.a"] == {"draftsmith.pkg.b"}
    assert graph["draftsmith.pkg.b"] == {"draftsmith.pkg.a"}
    assert find_cycle(graph) == ["draftsmith.pkg.a", "draftsmith.pkg.b", "draftsmith.pkg.a"]


def test_no_import_cycles():
    graph = import_graph()
    assert len(graph) > 20, sorted(graph)
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_no_private_names_imported_across_modules():
    bad = []
    for path in package_modules().values():
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("draftsmith"):
                private = [a.name for a in node.names if a.name.startswith("_")]
                private = [n for n in private if not n.startswith("__")]
                if private:
                    bad.append(f"{path.relative_to(ROOT)}:{node.lineno}: {node.module} {private}")
    assert not bad, "private names imported across modules:\n" + "\n".join(bad)


def test_engines_never_import_a_stage_cli():
    clis = stage_cli_modules()
    assert {"draftsmith.capture", "draftsmith.regenerate", "draftsmith.bench"} <= clis, clis
    bad = {
        name: sorted(deps & clis)
        for name, deps in import_graph().items()
        if name.startswith("draftsmith.engines") and deps & clis
    }
    assert not bad, f"engines importing stage CLIs (move what they need lower): {bad}"
