"""The embedded default, end to end, exactly as the README runs it.

Marked `e2e`: about 20-40 minutes on 2 cores, run by hand (`pytest -m e2e`), not in .ci/run,
whose 90-minute budget it would share with the rest.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from wf import ROOT

pytestmark = [pytest.mark.slow, pytest.mark.workflow, pytest.mark.e2e]


def test_embedded_default_builds_a_draft_that_speculates(tmp_path: Path):
    work = tmp_path / "run"
    work.mkdir()
    shutil.copy(ROOT / "config.yaml", work / "config.yaml")
    base = [
        sys.executable,
        "-m",
        "snakemake",
        "-s",
        str(ROOT / "Snakefile"),
        "--directory",
        str(work),
    ]
    run = subprocess.run([*base, "--cores", "all"], capture_output=True, text=True, timeout=3600)
    assert run.returncode == 0, run.stderr[-6000:]
    report = json.loads((work / "results/bench/report.json").read_text())
    sets = report["sets"]
    assert set(sets) >= {"heldout", "humaneval"}
    for name, s in sets.items():
        assert s["tau"] > 1.05, (name, s["tau"])
    html = subprocess.run(
        [*base, "--report", str(work / "report.html")], capture_output=True, text=True, timeout=600
    )
    assert html.returncode == 0, html.stderr[-4000:]
    assert (work / "report.html").stat().st_size > 10_000
