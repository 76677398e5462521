"""Staleness in the real Snakefile: the user's target bytes, deleted intermediates, a moved project,
range names. Each test runs `snakemake` inside a copy of the workflow (the default layout, results/
inside it) on the tiny config, whose outputs are placeholders marked up to date with `--touch`, so
`snakemake -n` plans exactly what a real project would rerun, in seconds. A real run with a corrupt
shard is tests/test_workflow_rebuild.py (slow).
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
from safetensors.torch import load_file, save_file
from wf import ROOT, parse_plan, tiny_config

pytestmark = pytest.mark.workflow

R0, R1 = "rows_000000-000016", "rows_000016-000032"  # tiny_config: 40 rows, 8 held out, 16/range
DOWNSTREAM = {  # what a changed target makes stale (data_report reads no target)
    "target_model": 1,
    "regenerate": 2,
    "tokenize": 2,
    "vocab": 1,
    "hidden_plan": 1,
    "capture": 2,
    "train": 1,
    "bench": 1,
}


def outputs() -> list[str]:
    """Every output of the tiny config's DAG but the env stamp and the target."""
    files = [
        "results/data/sources.json",
        "results/vocab/vocab.safetensors",
        "results/hidden/plan.json",
        "results/train/metrics.jsonl",
        "results/train/offline_acceptance.json",
        *(f"results/bench/{n}" for n in ("report.json", "report.md", "summary.html")),
        *(f"results/bench/{n}.png" for n in ("acceptance", "accept_hist", "training")),
    ]
    for r in (R0, R1):
        files += [f"results/data/{r}.jsonl", f"results/data/{r}.report.json"]
        files += [f"results/tokens/{r}.safetensors"]
        files += [f"results/hidden/{r}.safetensors", f"results/hidden/{r}.json"]
    return files


def run_in(repo: Path, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    """`snakemake <args>` inside a copy of the workflow (the default layout: results/ inside)."""
    proc = subprocess.run(
        [sys.executable, "-m", "snakemake", *args],
        cwd=repo,
        capture_output=True,
        text=True,
        timeout=600,
    )
    if check:
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def env_check(repo: Path, role: str = "cpu") -> str:
    """validate_env's keyed output for the role (default interpreter: this one, no GPUs)."""
    from draftsmith.stages.env import stamp_key

    key = stamp_key((repo / "envs" / f"{role}.txt").read_text(), sys.executable, 0)
    return f"results/env/{role}/{key}.json"


def fake_build(repo: Path) -> None:
    """Placeholders for the outputs not there yet, then `--touch` every job: all up to date."""
    for name in ["results/env/cpu.json", env_check(repo), *outputs()]:
        path = repo / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.touch()
    for name in ("results/draft", "results/target", "results/bench/captions"):
        (repo / name).mkdir(exist_ok=True)
    run_in(repo, "--cores", "1", "--touch", "--forceall")  # metadata for every job


def stale(repo: Path, *targets: str) -> dict[str, int]:
    """Jobs `snakemake -n` plans in `repo`, per rule, without the aggregate `all`."""
    proc = run_in(repo, "-n", *targets)
    jobs = parse_plan(proc.stdout + proc.stderr)
    jobs.pop("all", None)
    return jobs


def set_config(repo: Path, cfg: dict) -> None:
    (repo / "config.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))


def rewrite_one_tensor(model: Path) -> None:
    """New values, same names, dtypes and shapes (so the same file size and header)."""
    path = model / "model.safetensors"
    tensors = load_file(path)
    name = sorted(tensors)[0]
    tensors[name] = tensors[name] + 1
    before = path.stat().st_size
    save_file(tensors, path, metadata={"format": "pt"})
    assert path.stat().st_size == before


def copy_workflow(dest: Path) -> Path:
    """A clone-like copy of the workflow, so that results/ sit inside it as in a plain clone."""
    ignore = shutil.ignore_patterns("__pycache__", ".snakemake")
    dest.mkdir(parents=True)
    for name in ("Snakefile", "config.yaml"):
        shutil.copy2(ROOT / name, dest / name)
    for name in ("rules", "draftsmith", "envs", "report", "profiles"):
        shutil.copytree(ROOT / name, dest / name, ignore=ignore)
    return dest


@pytest.fixture(scope="module")
def built(tmp_path_factory, tiny_target: Path) -> Path:
    """A workflow copy on the tiny config whose whole DAG is up to date (placeholders)."""
    repo = copy_workflow(tmp_path_factory.mktemp("built") / "draftsmith")
    set_config(repo, tiny_config(tiny_target))
    fake_build(repo)
    return repo


@pytest.fixture
def project(built: Path, tmp_path: Path) -> Path:
    """A private copy of `built` (cp -a keeps times and .snakemake; see the move test)."""
    return shutil.copytree(built, tmp_path / "draftsmith", symlinks=True)


def users_model(tiny_target: Path, dest: Path) -> Path:
    """The user's own, changeable copy, written an hour ago (mtimes count in whole seconds)."""
    model = shutil.copytree(tiny_target, dest)
    for f in model.iterdir():
        st = f.stat()
        os.utime(f, (st.st_atime - 3600, st.st_mtime - 3600))
    return model


def test_changed_target_bytes_make_everything_downstream_stale(
    project: Path, tmp_path: Path, tiny_target: Path
):
    model = users_model(tiny_target, tmp_path / "model")
    set_config(project, tiny_config(model))
    fake_build(project)
    assert stale(project) == {}
    rewrite_one_tensor(model)  # same shapes, same size: a fine-tuned checkpoint written over it
    assert stale(project) == DOWNSTREAM


@pytest.mark.slow
def test_rebuilt_target_has_a_new_fingerprint_and_config_content_counts(
    project: Path, tmp_path: Path, tiny_target: Path
):
    model = users_model(tiny_target, tmp_path / "model")
    set_config(project, tiny_config(model))
    run_in(project, "--cores", "1", "results/target")  # the real target on the user's copy
    fake_build(project)
    meta = project / "results" / "target" / "draftsmith_target.json"
    before = json.loads(meta.read_text())["fingerprint"]
    rewrite_one_tensor(model)
    run_in(project, "--cores", "1", "results/target")
    assert json.loads(meta.read_text())["fingerprint"] != before
    fake_build(project)
    assert stale(project) == {}
    # config.json edited in place, its mtime put back: the content still counts
    cfg = model / "config.json"
    st = cfg.stat()
    cfg.write_text(json.dumps({**json.loads(cfg.read_text()), "rope_theta": 20000.0}))
    os.utime(cfg, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert stale(project) == DOWNSTREAM


def test_bad_target_path_is_an_error_although_results_target_exists(
    project: Path, tmp_path: Path, tiny_target: Path
):
    empty = tmp_path / "not_a_model"
    empty.mkdir()
    for path, message in [(str(empty), "has no config.json"), ("", "target.path is empty")]:
        set_config(project, tiny_config(tiny_target, target={"source": "path", "path": path}))
        proc = run_in(project, "-n", check=False)
        assert proc.returncode != 0
        assert message in proc.stdout + proc.stderr, proc.stderr[-2000:]


@pytest.mark.parametrize(
    "deleted, expected",
    [
        (f"results/hidden/{R0}.safetensors", {"capture": 1, "train": 1, "bench": 1}),
        (
            f"results/data/{R1}.report.json",
            {"regenerate": 1, "tokenize": 1, "vocab": 1, "hidden_plan": 1, "capture": 1}
            | {"train": 1, "bench": 1},
        ),
        pytest.param(
            "results/vocab/vocab.safetensors",
            {"vocab": 1, "train": 1, "bench": 1},
            marks=pytest.mark.slow,
        ),
        pytest.param("results/hidden/plan.json", {"hidden_plan": 1}, marks=pytest.mark.slow),
        pytest.param("results/draft", {"train": 1, "bench": 1}, marks=pytest.mark.slow),
    ],
)
def test_deleting_an_intermediate_rebuilds_it_and_what_depends_on_it(project, deleted, expected):
    path = project / deleted
    shutil.rmtree(path) if path.is_dir() else path.unlink()
    assert stale(project) == expected


def test_moved_or_copied_project_reruns_nothing(built: Path, tmp_path: Path):
    copied = shutil.copytree(built, tmp_path / "copy", symlinks=True)  # cp -a
    moved = copied.rename(tmp_path / "moved")  # mv
    again = shutil.copytree(moved, tmp_path / "again", symlinks=True)
    for where in (moved, again):
        out = run_in(where, "-n").stdout
        assert "Nothing to be done" in out, out[-3000:]


@pytest.mark.parametrize(
    "target, message",
    [
        ("results/hidden/rows_000000-000004.safetensors", "not a configured range"),
        ("results/data/rows_000032-000048.jsonl", "past the end of the training rows [0, 32)"),
        ("results/tokens/rows_000016-000048.safetensors", "past the end"),
    ],
)
def test_only_configured_ranges_are_targets(built: Path, target, message):
    proc = run_in(built, "-n", target, check=False)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert message in out and f"{R0}, {R1}" in out, out[-3000:]


def test_draft_algorithm_at_its_default_reruns_nothing(project: Path, tiny_target: Path):
    """draft.algorithm written at its default reruns nothing (x-omit-default); eagle3.1 reruns
    exactly the draft's training and the benchmark that reads the draft."""
    cfg = tiny_config(tiny_target)
    set_config(project, tiny_config(tiny_target, draft={**cfg["draft"], "algorithm": "eagle3"}))
    assert stale(project) == {}
    set_config(project, tiny_config(tiny_target, draft={**cfg["draft"], "algorithm": "eagle3.1"}))
    assert stale(project) == {"train": 1, "bench": 1}
