"""Every command module prints a useful usage for --help; library modules are listed as such."""

from __future__ import annotations

import importlib
import subprocess
import sys

import pytest
from wf import ROOT

PACKAGE = ROOT / "draftsmith"
# Modules without a command line (imported by the others): a new module must be listed here or
# have a main() that passes the test below.
LIBRARY = {
    "__init__",
    "benchfigures",
    "benchinput",
    "benchlevels",
    "capture_base",
    "checkpoint",
    "common",
    "config",
    "convert_common",
    "convert_speculators",
    "dflash_decode",
    "dflash_export",
    "dflash_model",
    "dflash_train",
    "draft_contract",
    "draft_contract_mla",
    "families",
    "fasttok",
    "finite",
    "gate",
    "hardware",
    "layerids",
    "layout",
    "lifeline",
    "load",
    "mla",
    "model",
    "offline",
    "ports",
    "regenerate_base",
    "repair",
    "sampling",
    "segments",
    "server",
    "serving",
    "settings",
    "shard_writer",
    "specdec",
    "stopping",
    "storage",
    "threads",
    "traindata",
    "ttt",
}
COMMANDS = sorted(
    p.stem
    for p in PACKAGE.glob("*.py")
    if p.stem not in LIBRARY and 'if __name__ == "__main__":' in p.read_text()
)


def test_every_module_is_a_command_or_listed_as_a_library():
    unclassified = {p.stem for p in PACKAGE.glob("*.py")} - LIBRARY - set(COMMANDS)
    assert not unclassified, f"modules without a CLI that are not in LIBRARY: {unclassified}"
    for name in LIBRARY - {"__init__"}:
        assert 'if __name__ == "__main__":' not in (PACKAGE / f"{name}.py").read_text()


@pytest.mark.parametrize("name", COMMANDS)
def test_a_command_runs_its_main_once(name):
    """One `__main__` block per command module: a second one (a merge once left two in train.py)
    runs the whole job again in the same process, and under torchrun the ranks' second runs
    deadlocked in gloo."""
    text = (PACKAGE / f"{name}.py").read_text()
    assert text.count('if __name__ == "__main__":') == 1, f"draftsmith/{name}.py"


@pytest.mark.parametrize("name", COMMANDS)
def test_help_prints_usage_and_the_modules_own_description(name, capsys):
    module = importlib.import_module(f"draftsmith.{name}")
    with pytest.raises(SystemExit) as e:
        module.main(["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith(f"usage: python -m draftsmith.{name} "), out[:200]
    # the module docstring, with its layout kept (examples stay one per line)
    first = module.__doc__.strip().splitlines()[0]
    assert first in out, f"{name}: --help lacks its description {first!r}"
    assert "options:" in out and "-h, --help" in out
    examples = [ln for ln in module.__doc__.splitlines() if "python -m draftsmith." in ln]
    for line in examples:
        assert line.rstrip() in out, f"{name}: example squashed: {line!r}"


def test_configdoc_help_is_usage_not_the_document():
    proc = subprocess.run(
        [sys.executable, "-m", "draftsmith.configdoc", "--help"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=60,
    )
    assert proc.returncode == 0 and proc.stdout.startswith("usage: python -m draftsmith.configdoc")
    assert "| key | type |" not in proc.stdout
    check = subprocess.run(
        [sys.executable, "-m", "draftsmith.configdoc", "--check", "docs/config.md"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=60,
    )
    assert check.returncode == 0, check.stderr
