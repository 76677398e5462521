"""In the real Snakefile: settings that change no result stale nothing, a fixed config
typo in an environment reruns nothing downstream, a shard refused by training is rebuilt by the
next plain run. Planning only (`snakemake -n` on placeholders marked up to date, as in
tests/test_workflow_staleness.py), plus the real jobs that matter (validate_env).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import yaml
from test_workflow_staleness import copy_workflow, fake_build, run_in, set_config, stale
from wf import ROOT, tiny_config

from draftsmith.config.checks import execution_keys

pytestmark = pytest.mark.workflow


@pytest.fixture(scope="module")
def built(tmp_path_factory, tiny_target: Path) -> Path:
    """A workflow copy on the tiny config whose whole DAG is up to date (placeholders)."""
    repo = copy_workflow(tmp_path_factory.mktemp("built") / "draftsmith")
    set_config(repo, tiny_config(tiny_target))
    fake_build(repo)
    return repo


@pytest.fixture
def project(built: Path, tmp_path: Path) -> Path:
    return shutil.copytree(built, tmp_path / "draftsmith", symlinks=True)


SCHEMA = yaml.safe_load((ROOT / "draftsmith" / "config" / "config.schema.yaml").read_text())
# a value other than the default for every execution-only key
CHANGED = {
    ("capture", "concurrency"): 7,
    ("capture", "retries"): 5,
    ("train", "checkpoint_every"): 3,
    ("train", "checkpoint_seconds"): 30,
    ("sglang", "port"): 31234,
    ("sglang", "startup_timeout"): 60,
    ("sglang", "request_timeout"): 60,
    ("sglang", "retries"): 0,
    ("sglang", "shared_server"): "job",
    ("sglang", "idle_timeout"): 60,
}


def test_the_schema_marks_the_execution_only_keys():
    marked = {(s, k) for s, keys in execution_keys(SCHEMA).items() for k in keys}
    assert marked == set(CHANGED)


def test_changing_an_execution_only_key_plans_no_job(project, tiny_target):
    """capture.retries/concurrency (read by the sglang backend only), train.checkpoint_every and
    the server's run settings: how a job runs, not what it builds. One key at a time on one
    up-to-date copy (each change is put back by the next: the config is rewritten whole)."""
    assert stale(project) == {}
    planned = {}
    for section, key in sorted(CHANGED):
        cfg = tiny_config(tiny_target)
        cfg[section] = {**cfg.get(section, {}), key: CHANGED[section, key]}
        set_config(project, cfg)
        planned[f"{section}.{key}"] = stale(project)
    assert planned == {name: {} for name in planned}


def test_capture_batch_tokens_still_reruns_the_capture(project, tiny_target):
    """On CPU it no longer changes the stored bits (tests/test_capture_batching.py), but GPU
    kernels may round differently for other batch shapes (the schema's description), so it
    stays a param of the shards."""
    set_config(project, tiny_config(tiny_target, capture={"batch_tokens": 64}))
    assert stale(project) == {"capture": 2, "hidden_plan": 1, "train": 1, "bench": 1}


def test_a_fixed_interpreter_typo_reruns_nothing(project, tiny_target, tmp_path):
    """envs.cpu.python pointing at a broken interpreter fails validate_env, as it should; once
    the config is put back, the published stamp is untouched and no job is planned (main
    deleted results/env/cpu.json and reran all 17 jobs)."""
    stamp = project / "results" / "env" / "cpu.json"
    before = (stamp.read_bytes(), stamp.stat().st_mtime_ns)
    broken = tmp_path / "python3"
    broken.write_text("#!/bin/sh\necho 'no torch here' >&2\nexit 1\n")
    broken.chmod(0o755)
    set_config(project, tiny_config(tiny_target, envs={"cpu": {"python": str(broken)}}))
    proc = run_in(project, "--cores", "1", check=False)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0 and "Error in rule validate_env" in out, out[-3000:]
    assert "Finished jobid" not in out  # nothing ran after it
    set_config(project, tiny_config(tiny_target))
    assert (stamp.read_bytes(), stamp.stat().st_mtime_ns) == before
    assert stale(project) == {}


def test_an_edited_pin_file_still_rechecks_and_reruns_the_role(project):
    pins = project / "envs" / "cpu.txt"
    pins.write_text(pins.read_text() + "\n# a comment\n")
    jobs = stale(project)
    assert jobs["validate_env"] == 1 and jobs["env_stamp"] == 1 and jobs["train"] == 1, jobs
