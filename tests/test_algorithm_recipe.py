"""docs/architecture.md's recipe for a new algorithm, followed as a stranger would in a copy of
the workflow: an EAGLE-3 variant over four captured layers is its folder, one registry line and
the schema's enum (three files), and `snakemake -n` refuses a config that captures three layers
for it before any job runs, naming the key; with four ids it plans."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from test_algorithm_spec import FOUR_AUX
from wf import ROOT

pytestmark = [pytest.mark.slow, pytest.mark.workflow]

# what the Snakefile reads at parse time (the package, its rules, config and role files)
TREE = ("Snakefile", "rules", "draftsmith", "config.yaml", "config", "envs", "report", "patches")


def copy_workflow(dest: Path) -> Path:
    dest.mkdir()
    for name in TREE:
        src = ROOT / name
        if src.is_dir():
            shutil.copytree(src, dest / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy(src, dest / name)
    return dest


def add_variant(tree: Path) -> list[Path]:
    """The recipe's three edits; returns the files touched."""
    folder = tree / "draftsmith" / "algorithms" / "eagle3x4"
    folder.mkdir()
    (folder / "__init__.py").write_text(FOUR_AUX)
    registry = tree / "draftsmith" / "algorithms" / "__init__.py"
    text = registry.read_text()
    line = '    "dflash": "draftsmith.algorithms.dflash",\n'
    assert line in text
    registry.write_text(
        text.replace(line, line + '    "eagle3x4": "draftsmith.algorithms.eagle3x4",\n')
    )
    schema = tree / "draftsmith" / "config" / "config.schema.yaml"
    text = schema.read_text()
    enum = "enum: [eagle3, eagle3.1, dflash]"
    assert text.count(enum) == 1
    schema.write_text(text.replace(enum, "enum: [eagle3, eagle3.1, dflash, eagle3x4]"))
    return [folder / "__init__.py", registry, schema]


def changed_files(tree: Path) -> list[str]:
    """Files of the copy that differ from the repository's (or are new)."""
    out = []
    for path in sorted(p for p in tree.rglob("*") if p.is_file()):
        rel = path.relative_to(tree)
        orig = ROOT / rel
        if not orig.is_file() or orig.read_bytes() != path.read_bytes():
            out.append(rel.as_posix())
    return out


def dry_run(tree: Path, work: Path, draft: dict, capture: dict) -> subprocess.CompletedProcess:
    cfg = yaml.safe_load((ROOT / "config.yaml").read_text()) or {}
    cfg["draft"] = {**(cfg.get("draft") or {}), **draft}
    cfg["capture"] = {**(cfg.get("capture") or {}), **capture}
    work.mkdir(exist_ok=True)
    (work / "config.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))
    cmd = [sys.executable, "-m", "snakemake", "-s", str(tree / "Snakefile"), "-n"]
    cmd += ["--directory", str(work), "--configfile", str(work / "config.yaml"), "--cores", "1"]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=work)


def test_a_four_layer_variant_is_three_files_and_snakemake_n_refuses_three_ids(tmp_path):
    tree = copy_workflow(tmp_path / "tree")
    touched = add_variant(tree)
    assert changed_files(tree) == sorted(p.relative_to(tree).as_posix() for p in touched)
    assert len(touched) == 3

    proc = dry_run(tree, tmp_path / "work", {"algorithm": "eagle3x4"}, {})
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out[-3000:]
    assert "capture.aux_layer_ids 'auto' (3 layers)" in out and "exactly 4" in out, out[-3000:]
    assert "Job stats" not in out  # refused while parsing: nothing planned, nothing ran

    ids = {"aux_layer_ids": [2, 10, 18, 26]}  # four of the embedded target's 30 layers
    proc = dry_run(tree, tmp_path / "work", {"algorithm": "eagle3x4"}, ids)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    assert "Job stats" in proc.stdout + proc.stderr
