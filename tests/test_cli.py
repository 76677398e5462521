"""The one command line: every rule and spawn calls `python -m draftsmith <command>`, each
command is one module's main() with a useful --help, and no module runs as `-m <module>`."""

from __future__ import annotations

import importlib
import re
import subprocess
import sys

import pytest
from wf import ROOT

from draftsmith.cli import COMMANDS, main

PACKAGE = ROOT / "draftsmith"


def test_no_module_has_its_own_main_block():
    """Commands run through draftsmith.cli only; a `__main__` block would be a second way in
    (and once a module with two of them ran its whole job twice under torchrun)."""
    blocks = [
        str(p.relative_to(ROOT))
        for p in PACKAGE.rglob("*.py")
        if p.name != "__main__.py" and 'if __name__ == "__main__":' in p.read_text()
    ]
    assert not blocks, blocks


def test_every_command_module_exists_and_has_main():
    for name, (module, text) in COMMANDS.items():
        mod = importlib.import_module(f"draftsmith.{module}")
        assert callable(getattr(mod, "main", None)), f"{name}: draftsmith.{module} has no main()"
        assert text and len(text) < 90, name


def test_rules_and_spawns_call_commands_not_module_paths():
    """A rule naming a module path would change its shell command (and rerun its jobs) on the
    next move inside the package."""
    pattern = re.compile(r"-m draftsmith\.|\"-m\",\s*\"draftsmith\.")
    sources = [*ROOT.glob("rules/*.smk"), ROOT / "Snakefile", *PACKAGE.rglob("*.py")]
    sources += [*ROOT.glob("tests/*.py"), *ROOT.glob("benchmarks/*.py"), *ROOT.glob("scripts/*")]
    found = [
        f"{p.relative_to(ROOT)}:{i}"
        for p in sources
        if p.is_file() and p != ROOT / "tests" / "test_cli.py"
        for i, line in enumerate(p.read_text(errors="replace").splitlines(), 1)
        if pattern.search(line)
    ]
    assert not found, found
    used = set()
    for smk in [*ROOT.glob("rules/*.smk"), ROOT / "Snakefile"]:
        used |= set(re.findall(r"-m draftsmith ([a-z-]+)", smk.read_text()))
    assert used, "no rule calls the CLI"
    assert used <= set(COMMANDS), used - set(COMMANDS)


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_help_prints_usage_and_the_modules_own_description(name, capsys):
    module = importlib.import_module(f"draftsmith.{COMMANDS[name][0]}")
    with pytest.raises(SystemExit) as e:
        main([name, "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith(f"usage: python -m draftsmith {name}"), out[:200]
    # the module docstring, with its layout kept (examples stay one per line)
    first = module.__doc__.strip().splitlines()[0]
    assert first in out, f"{name}: --help lacks its description {first!r}"
    assert "options:" in out and "-h, --help" in out
    examples = [ln for ln in module.__doc__.splitlines() if "python -m draftsmith " in ln]
    for line in examples:
        assert line.rstrip() in out, f"{name}: example squashed: {line!r}"


def test_top_level_help_lists_every_command_and_unknown_is_refused():
    out = subprocess.run(
        [sys.executable, "-m", "draftsmith", "--help"], capture_output=True, text=True, cwd=ROOT,
        timeout=60,
    )  # fmt: skip
    assert out.returncode == 0
    for name in COMMANDS:
        assert f"  {name} " in out.stdout, name
    bad = subprocess.run(
        [sys.executable, "-m", "draftsmith", "no-such"], capture_output=True, text=True, cwd=ROOT,
        timeout=60,
    )  # fmt: skip
    assert bad.returncode != 0 and "unknown command 'no-such'" in bad.stderr


def test_configdoc_help_is_usage_not_the_document():
    proc = subprocess.run(
        [sys.executable, "-m", "draftsmith", "config-doc", "--help"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=60,
    )
    assert proc.returncode == 0 and proc.stdout.startswith("usage: python -m draftsmith config-doc")
    assert "| key | type |" not in proc.stdout
    check = subprocess.run(
        [sys.executable, "-m", "draftsmith", "config-doc", "--check", "docs/config.md"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=60,
    )
    assert check.returncode == 0, check.stderr
