"""The package's import graph, read from the source (every import statement, at module level and
inside functions alike: a lazy import is still a dependency; a registry's `importlib` load of a
module named by a string counts as an import of it).

Three rules: the subpackages form layers and import only their own or lower ones (LAYERS), no
cycles in `draftsmith/`, and no module imports another's private (`_`) names.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

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
    # a registry: a module that loads modules by name (importlib.import_module) depends on every
    # package module its string constants name
    tree = ast.parse(path.read_text(), filename=str(path))
    if any(
        isinstance(n, ast.Attribute | ast.Name)
        and getattr(n, "attr", getattr(n, "id", "")) == "import_module"
        for n in ast.walk(tree)
    ):
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and node.value in modules and node.value != name:
                found.add(node.value)
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


# subpackage -> its layer: a module may import its own subpackage's modules and those of lower
# layers only. The package's top (draftsmith/__init__, cli, __main__) sits above them all.
LAYERS = {
    "runtime": 0,
    "config": 1,
    "data": 2,
    "targets": 3,
    "hidden": 4,
    "algorithms": 5,
    "interop": 5,
    "train": 6,
    "bench": 6,
    "engines": 7,
    "stages": 8,
}
TOP = 9


def layer_of(name: str, modules: dict[str, Path]) -> tuple[str, int]:
    """(subpackage, layer) of module `name`; the package's own top-level modules are TOP."""
    parts = name.split(".")
    if len(parts) == 1 or (len(parts) == 2 and modules[name].name != "__init__.py"):
        return "(top)", TOP
    return parts[1], LAYERS.get(parts[1], -1)


def layer_violations(graph: dict[str, set[str]], modules: dict[str, Path]) -> list[str]:
    bad = []
    for name, deps in sorted(graph.items()):
        pkg, level = layer_of(name, modules)
        if level < 0:
            bad.append(f"{name}: subpackage {pkg!r} has no layer in LAYERS")
            continue
        for dep in sorted(deps):
            dpkg, dlevel = layer_of(dep, modules)
            if dpkg != pkg and dlevel >= level:
                bad.append(f"{name} ({pkg}, layer {level}) imports {dep} ({dpkg}, layer {dlevel})")
    return bad


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


def test_subpackages_import_only_their_own_or_lower_layers():
    modules = package_modules()
    subpackages = {p.parent.name for p in PACKAGE.glob("*/__init__.py")}
    assert subpackages == set(LAYERS), subpackages ^ set(LAYERS)
    bad = layer_violations(import_graph(), modules)
    assert not bad, "imports against the layers:\n" + "\n".join(bad)


def test_every_subpackage_says_what_it_holds_and_may_import():
    for pkg in LAYERS:
        doc = ast.get_docstring(ast.parse((PACKAGE / pkg / "__init__.py").read_text())) or ""
        assert "May import" in doc, f"draftsmith/{pkg}/__init__.py: say what it may import"


def test_a_planted_upward_import_and_a_registry_load_are_caught(tmp_path):
    """The rule catches a lazy import of a higher layer and a registry's load by name."""
    src = tmp_path / "draftsmith"
    for pkg in ("runtime", "engines", "config"):
        (src / pkg).mkdir(parents=True)
        (src / pkg / "__init__.py").write_text("")
    (src / "runtime" / "a.py").write_text("def f():\n    from draftsmith.engines import b\n")
    (src / "engines" / "b.py").write_text("X = 1\n")
    (src / "config" / "c.py").write_text(
        "import importlib\nM = {'b': 'draftsmith.engines.b'}\n"
        "def g():\n    return importlib.import_module(M['b'])\n"
    )
    files = {
        "draftsmith.runtime": src / "runtime" / "__init__.py",
        "draftsmith.engines": src / "engines" / "__init__.py",
        "draftsmith.config": src / "config" / "__init__.py",
        "draftsmith.runtime.a": src / "runtime" / "a.py",
        "draftsmith.engines.b": src / "engines" / "b.py",
        "draftsmith.config.c": src / "config" / "c.py",
    }
    graph = {name: imports_of(name, path, set(files)) for name, path in files.items()}
    bad = layer_violations(graph, files)
    assert [b.split(" (")[0] + " -> " + b.split(" imports ")[1].split(" (")[0] for b in bad] == [
        "draftsmith.config.c -> draftsmith.engines.b",
        "draftsmith.runtime.a -> draftsmith.engines",
        "draftsmith.runtime.a -> draftsmith.engines.b",
    ], bad


REGISTRY = "draftsmith.algorithms"


def algorithm_modules(modules: dict[str, Path]) -> list[str]:
    """The modules of the algorithms' folders (`draftsmith/algorithms/<folder>/`)."""
    folder = PACKAGE / "algorithms"
    return sorted(n for n, p in modules.items() if p.parent.parent == folder)


def registry_importers(graph: dict[str, set[str]], modules: dict[str, Path]) -> list[str]:
    """The algorithm folders' modules that import the registry (draftsmith.algorithms)."""
    return [n for n in algorithm_modules(modules) if REGISTRY in graph[n]]


def spec_edges() -> dict[str, set[str]]:
    """Each registered algorithm's folder -> the modules of the parts its spec holds (trainer,
    exporter, decoder, estimator): what the registry loads when asked for the algorithm."""
    from draftsmith import algorithms

    roles = ("trainer", "exporter", "decoder", "estimator")
    out = {}
    for name, folder in algorithms.MODULES.items():
        spec = algorithms.get(name)
        out[folder] = {getattr(spec, r).__name__ for r in roles if getattr(spec, r) is not None}
    return out


def test_the_specs_parts_are_edges_of_the_graph():
    """A spec's parts (spec.Part: a module its folder names, imported on first use) are edges
    of the folder: they are modules of the package, and with them the graph still has no
    cycle."""
    graph = import_graph()
    parts = spec_edges()
    assert set(parts) == {m for m in graph if m in parts}, "a registered folder is no module"
    for folder, mods in parts.items():
        assert mods <= set(graph), f"{folder}: its spec's parts {mods - set(graph)} are no modules"
        graph[folder] |= mods
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_no_algorithm_module_imports_the_registry():
    """The registry imports an algorithm's folder when asked for it; a module of the folder
    that imported the registry back would close a cycle (it is given the spec instead)."""
    modules = package_modules()
    assert len(algorithm_modules(modules)) > 10
    bad = registry_importers(import_graph(), modules)
    assert not bad, f"algorithm modules that import {REGISTRY}: {bad}"


@pytest.mark.parametrize(
    "plant", ["import draftsmith.algorithms\n", "from draftsmith import algorithms\n",
              "def f():\n    from draftsmith.algorithms import get\n"],
)  # fmt: skip
def test_a_planted_registry_import_in_an_algorithm_module_fails(tmp_path, plant):
    modules = package_modules()
    name = "draftsmith.algorithms.eagle3.model"
    planted = tmp_path / "model.py"
    planted.write_text(modules[name].read_text() + "\n\n" + plant)
    graph = import_graph()
    assert registry_importers(graph, modules) == []
    graph[name] = imports_of(name, planted, set(modules))
    assert registry_importers(graph, modules) == [name]
