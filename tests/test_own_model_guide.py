"""docs/own-model.md, run as written: its `bash` blocks are extracted from the page and run in
order in a fresh HOME, so the guide and what works cannot drift apart."""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path

import pytest
from wf import ROOT

GUIDE = ROOT / "docs" / "own-model.md"


def guide_blocks() -> list[str]:
    return re.findall(r"^```bash\n(.*?)^```$", GUIDE.read_text(), flags=re.S | re.M)


def run_blocks(blocks: list[str], home: Path, timeout: int) -> subprocess.CompletedProcess:
    env = {**os.environ, "HOME": str(home), "REPO": str(ROOT)}
    env.pop("PYTHONPATH", None)  # the guide sets it itself
    script = "set -euo pipefail\n" + "\n".join(blocks)
    proc = subprocess.run(
        ["bash", "-c", script],
        cwd=home,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert proc.returncode == 0, f"guide failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-6000:]}"
    return proc


def test_guide_has_the_steps_a_newcomer_needs():
    blocks = guide_blocks()
    text = "\n".join(blocks)
    for needle in ("--directory", "--configfile", "target:", "format: sharegpt", "--cores"):
        assert needle in text, needle
    assert "smoke: true" in text
    assert "sglang.launch_server" in GUIDE.read_text()
    assert "--speculative-algorithm EAGLE3" in GUIDE.read_text()


def test_guide_sample_data_has_no_system_turn():
    """The try-out's data works with any chat template: Gemma-2's refuses a system turn."""
    text = "\n".join(guide_blocks())
    rows = re.search(r"cat > data/chats.jsonl <<'EOF'\n(.*?)^EOF$", text, flags=re.S | re.M)
    convs = [json.loads(line)["conversations"] for line in rows.group(1).splitlines()]
    assert len(convs) >= 8 and all(t["from"] in ("human", "gpt") for c in convs for t in c)


@pytest.mark.workflow
def test_guide_until_the_dry_run(tmp_path: Path):
    """The fast half: model, data, config and the dry run (what `-n` plans)."""
    blocks = guide_blocks()
    build = next(i for i, b in enumerate(blocks) if "--cores" in b)
    proc = run_blocks(blocks[:build], tmp_path, timeout=300)
    out = proc.stdout + proc.stderr
    assert "regenerate" in out and "bench" in out and "Job stats" in out
    assert (tmp_path / "my-draft" / "models" / "tiny-chat" / "config.json").is_file()


@pytest.mark.slow
@pytest.mark.workflow
def test_guide_end_to_end(tmp_path: Path):
    """Every command of the guide; then the report's captions describe the run, not --config."""
    run_blocks(guide_blocks(), tmp_path, timeout=1800)
    proj = tmp_path / "my-draft"
    report = json.loads((proj / "results" / "bench" / "report.json").read_text())
    assert report["gate"]["smoke"] is True
    md = (proj / "results" / "bench" / "report.md").read_text()
    if not report["gate"]["passed"]:
        assert "SMOKE RUN (bench.smoke: true)" in md.splitlines()[2]
    assert (proj / "results" / "draft" / "config.json").is_file()
    html = (proj / "report.html").read_text(errors="replace")
    assert "Chain of 1 draft token," in html
    # a report built later with another bench.num_steps still describes the run's 1 step
    proc = subprocess.run(
        [
            *("snakemake", "-s", str(ROOT / "Snakefile"), "--directory", str(proj)),
            *("--configfile", str(proj / "my.yaml"), "--report", str(proj / "later.html")),
            *("--config", 'bench={"num_steps": 3}'),
        ],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "HOME": str(tmp_path)},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    later = (proj / "later.html").read_text(errors="replace")
    assert "Chain of 1 draft token," in later and "Chain of 3 draft tokens" not in later
