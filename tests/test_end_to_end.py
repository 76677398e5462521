"""The embedded default, end to end, exactly as the README runs it; then the same `results/draft`
benchmarked through vLLM and through SGLang, the directory docs/serving.md tells both to serve.

Marked `e2e` (and `slow`): .ci/run runs it after the engine venvs are built. The engine tests
need the vllm-cpu and sglang-cpu role interpreters (DRAFTSMITH_PYTHON_VLLM_CPU,
DRAFTSMITH_PYTHON_SGLANG_CPU): they skip without them, or fail under
DRAFTSMITH_REQUIRE_ENGINES=1. Each reruns only the bench rule of the finished run, with
`bench.backend` set to the engine (an overlay config file), on the default's held-out prompts
and settings (16 prompts, 1 draft token per pass, greedy, 64 new tokens, float32, one request
at a time; HumanEval is left out to keep CI short), and its acceptance must equal the hf
engine's from the default run (trained.assert_same_acceptance: equal up to a float32 near-tie).

DRAFTSMITH_E2E_RUN=DIR reuses a finished default run (a copy of DIR is benched, DIR is left
alone) instead of building one: for working on the engine cases; CI never sets it.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from roles import role_python
from trained import assert_same_acceptance
from wf import ROOT, planned_jobs

pytestmark = [pytest.mark.slow, pytest.mark.workflow, pytest.mark.e2e]

ROLES = {"vllm": "vllm-cpu", "sglang": "sglang-cpu"}
# the server settings of config/embedded-sglang.yaml: a small KV pool on CPU (docs/sglang.md)
SGLANG = {"extra_args": ["--max-total-tokens", "8192", "--mem-fraction-static", "0.1"]}


def snakemake(work: Path, *args: str, timeout: int) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "snakemake", "-s", str(ROOT / "Snakefile"), "--directory"]
    return subprocess.run([*cmd, str(work), *args], capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def default_run(tmp_path_factory):
    """`snakemake --cores all` in a fresh directory with the repository's config.yaml; the hf
    bench report it wrote (read now: the engine tests rerun the bench into the same place)."""
    work = tmp_path_factory.mktemp("e2e") / "run"
    reuse = os.environ.get("DRAFTSMITH_E2E_RUN")
    if reuse:
        shutil.copytree(reuse, work, symlinks=True, ignore=shutil.ignore_patterns(".git"))
    else:
        work.mkdir()
        shutil.copy(ROOT / "config.yaml", work / "config.yaml")
    run = snakemake(work, "--cores", "all", timeout=3600)
    assert run.returncode == 0, run.stderr[-6000:]
    return work, json.loads((work / "results/bench/report.json").read_text())


def test_embedded_default_builds_a_draft_that_speculates(default_run):
    work, report = default_run
    assert report["backend"] == "hf"
    sets = report["sets"]
    assert set(sets) >= {"heldout", "humaneval"}
    for name, s in sets.items():
        assert s["tau"] > 1.05, (name, s["tau"])
    html = snakemake(work, "--report", str(work / "report.html"), timeout=600)
    assert html.returncode == 0, html.stderr[-4000:]
    assert (work / "report.html").stat().st_size > 10_000


@pytest.mark.parametrize(
    "engine",
    [
        pytest.param("vllm", marks=pytest.mark.vllm),
        # SGLang's acceptance on a trained draft is CI's in tests/test_served_matrix.py; this
        # case (a second server start on the default's draft) is beyond CI's time budget
        pytest.param(
            "sglang",
            marks=[
                pytest.mark.sglang,
                pytest.mark.extended(
                    reason="proves: the embedded default's own draft served by SGLang at "
                    "our acceptance on the 135M target; no CI-sized version: a second SGLang "
                    "server pair on the 135M target after the default run, about 10 minutes "
                    "more on 2 cores; CI covers the rest: test_served_matrix.py (SGLang "
                    "serves drafts our pipeline trained at our acceptance)"
                ),
            ],
        ),
    ],
)
def test_engine_serving_results_draft_accepts_as_ours(request, engine):
    """The bench rule rerun with bench.backend = `engine` on the same draft: only the bench
    (and the engine role's environment check) runs, on the same prompts, and the engine's own
    counters give our engine's acceptance, with outputs equal to plain greedy."""
    role = ROLES[engine]
    python = role_python(role)  # before the default run: a missing role skips/fails at once
    work, hf_report = request.getfixturevalue("default_run")
    overlay = {
        "envs": {"cpu": {"python": ""}, role: {"python": python}},
        "bench": {"backend": engine, "role": role, "humaneval_size": 0},
        **({"sglang": SGLANG} if engine == "sglang" else {}),
    }
    (work / f"bench-{engine}.yaml").write_text(yaml.safe_dump(overlay))
    args = ("--configfile", str(work / f"bench-{engine}.yaml"))
    assert planned_jobs(work, args=args) == {
        "validate_env": 1,
        "env_stamp": 1,
        "bench": 1,
        "all": 1,
    }
    draft = work / "results/draft/model.safetensors"
    before = draft.stat().st_mtime_ns
    run = snakemake(work, "--cores", "all", *args, timeout=2400)
    log_file = work / "logs/bench/bench.log"
    log = log_file.read_text() if log_file.is_file() else ""
    assert run.returncode == 0, run.stderr[-6000:] + log[-6000:]
    assert draft.stat().st_mtime_ns == before  # the very draft the hf bench measured

    report = json.loads((work / "results/bench/report.json").read_text())
    assert report["backend"] == engine and set(report["sets"]) == {"heldout"}
    assert report["set_ids"]["heldout"] == hf_report["set_ids"]["heldout"]
    for key in ("num_steps", "max_new_tokens", "heldout_size"):
        assert report["config"]["bench"][key] == hf_report["config"]["bench"][key], key
    theirs, ours = report["sets"]["heldout"], hf_report["sets"]["heldout"]
    assert_same_acceptance(theirs, ours, engine)
    assert theirs["identical_outputs"] == ours["prompts"] == len(report["set_ids"]["heldout"])
    ids = json.loads((work / "results/draft/config.json").read_text())
    sglang_ids = ids["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
    if engine == "vllm":  # vLLM's numbering, read from the top-level key
        vllm_ids = tuple(i + 1 for i in sglang_ids)
        assert report["vllm_aux_layer_ids"] == list(vllm_ids)
        assert f"Using auxiliary layers from speculative config: {vllm_ids}" in log
    print(
        f"{engine}: tau {theirs['tau']:.4f} vs hf {ours['tau']:.4f}, passes "
        f"{theirs['verify_passes']} vs {ours['verify_passes']}, hist {theirs['accept_len_hist']}"
        f" vs {ours['accept_len_hist']}"
    )
