"""Profiles: what each rule asks for under each profile, read from the dry run's job list.

The workflow profile (profiles/default) is applied after any --profile; these tests pin down
that it no longer overrides the site profile, and that GPU requests follow the config.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from slurmtools import by_rule, dry_run, slurm_python
from wf import ROOT, tiny_config, write_config

pytestmark = pytest.mark.workflow

SITE = ("--profile", str(ROOT / "profiles" / "slurm"))
CPU_RULES = ("target_model", "data_report", "tokenize", "vocab", "validate_env")
GPU_STAGES = ("regenerate", "capture", "train", "bench")


def gpu_config(**sections) -> dict:
    """The production shape: every stage on role sglang (8 GPUs), hf backend."""
    cfg = {
        "envs": {"cpu": {"python": "", "gpus": 0}, "sglang": {"python": "", "gpus": 8}},
        "regenerate": {"role": "sglang"},
        "capture": {"role": "sglang"},
        "train": {"role": "sglang", "nproc": 8},
        "bench": {"role": "sglang"},
    }
    for k, v in sections.items():
        cfg.setdefault(k, {}).update(v)
    return cfg


def write(path: Path, cfg: dict) -> Path:
    path.write_text(yaml.safe_dump(cfg))
    return path


def assert_no_gpus(jobs):
    asking = [(j.rule, j.wildcards, j.gpus()) for j in jobs if j.gpus()]
    assert not asking, asking


def test_workflow_profile_alone_runs_the_rules_own_defaults(tmp_path: Path, tiny_target: Path):
    write_config(tmp_path, tiny_config(tiny_target))
    jobs = by_rule(dry_run(tmp_path))  # no --profile: only profiles/default applies
    assert_no_gpus(sum(jobs.values(), []))
    for rule, threads, mem in (
        ("target_model", 2, "4000"),
        ("regenerate", 1, "6000"),
        ("tokenize", 1, "2000"),
        ("capture", 1, "6000"),
        ("train", 2, "8000"),
        ("bench", 2, "6000"),
    ):
        for j in jobs[rule]:
            assert (j.threads, j.resources["mem_mb"]) == (threads, mem), (rule, j)
    assert "slurm_partition" not in jobs["train"][0].resources
    assert jobs["train"][0].resources["nodes"] == "1"
    assert "--nproc-per-node 1 --nnodes 1" in jobs["train"][0].shell


def test_site_profile_wins_and_a_cpu_config_asks_for_no_gpus(tmp_path: Path, tiny_target: Path):
    write_config(tmp_path, tiny_config(tiny_target))
    jobs = by_rule(dry_run(tmp_path, *SITE, python=slurm_python()))
    assert_no_gpus(sum(jobs.values(), []))
    # the site's threads and memory, not the workflow profile's or the rules' defaults
    train = jobs["train"][0]
    assert (train.threads, train.resources["mem_mb"], train.resources["runtime"]) == (
        16,
        "512000",
        "2880",
    )
    for j in jobs["regenerate"]:
        assert (j.threads, j.resources["mem_mb"], j.resources["runtime"]) == (8, "128000", "600")
    for j in jobs["capture"]:
        assert (j.threads, j.resources["mem_mb"]) == (8, "256000")
    # the small range jobs are batched into group submissions
    assert {j.group for j in jobs["tokenize"]} == {"tokenize_ranges"}
    assert "validate_env_gpu" not in jobs  # no GPU role in this config


def test_gpu_roles_ask_for_the_gpus_their_jobs_use(tmp_path: Path, tiny_target: Path):
    write_config(tmp_path, tiny_config(tiny_target))
    extra = write(tmp_path / "gpu.yaml", gpu_config())
    files = (tmp_path / "config.yaml", extra)
    jobs = by_rule(dry_run(tmp_path, *SITE, python=slurm_python(), configfiles=files))
    for rule in CPU_RULES:
        assert_no_gpus(jobs[rule])
    # validate_env: the cpu role locally, the GPU role on a node with its 8 GPUs
    # (the stamp's wildcards also carry its content key: role=<role>, envkey=<key>)
    assert [j.wildcards.split(",")[0] for j in jobs["validate_env"]] == ["role=cpu"]
    [gpu_env] = jobs["validate_env_gpu"]
    assert (gpu_env.wildcards.split(",")[0], gpu_env.gpus()) == ("role=sglang", 8)
    # hf on a GPU role uses one device; training train.nproc GPUs on each node
    for rule in ("regenerate", "capture", "bench"):
        assert {j.gpus() for j in jobs[rule]} == {1}, rule
        assert all("gres" not in j.resources for j in jobs[rule])
    train = jobs["train"][0]
    assert (train.resources["gres"], train.resources["nodes"]) == ("gpu:8", "1")
    assert "--nproc-per-node 8 --nnodes 1 --cpus-per-node 16" in train.shell


def test_multi_node_training_comes_from_the_site_profile(tmp_path: Path, tiny_target: Path):
    site = tmp_path / "site"
    site.mkdir()
    prof = yaml.safe_load((ROOT / "profiles/slurm/config.yaml").read_text())
    prof["slurm-partition-config"] = str(ROOT / "profiles/slurm/partitions.yaml")
    prof["set-resources"]["train"]["nodes"] = 4
    (site / "config.yaml").write_text(yaml.safe_dump(prof))
    work = tmp_path / "w"
    write_config(work, tiny_config(tiny_target))
    files = (work / "config.yaml", write(tmp_path / "gpu.yaml", gpu_config()))
    jobs = by_rule(dry_run(work, "--profile", str(site), python=slurm_python(), configfiles=files))
    train = jobs["train"][0]
    assert (train.resources["nodes"], train.resources["gres"]) == ("4", "gpu:8")
    assert train.resources["mem_mb"] == "512000"  # the rest of the site's train settings stay
    assert "--nproc-per-node 8 --nnodes 4" in train.shell


def sglang_stages() -> list[str]:
    """The stages whose backend may be sglang in the config schema."""
    props = yaml.safe_load((ROOT / "draftsmith/config/config.schema.yaml").read_text())[
        "properties"
    ]
    return [
        s
        for s in ("regenerate", "capture", "bench")
        if "sglang" in props[s]["properties"].get("backend", {}).get("enum", [])
    ]


def test_sglang_backends_ask_for_the_tp_size(tmp_path: Path, tiny_target: Path):
    stages = sglang_stages()
    assert stages, "the config schema has no sglang backend"
    write_config(tmp_path, tiny_config(tiny_target))
    cfg = gpu_config(sglang={"tp_size": 4}, **{s: {"backend": "sglang"} for s in stages})
    files = (tmp_path / "config.yaml", write(tmp_path / "gpu.yaml", cfg))
    jobs = by_rule(dry_run(tmp_path, *SITE, python=slurm_python(), configfiles=files))
    assert expected_tp(files) == 4
    for rule in stages:
        assert {j.gpus() for j in jobs[rule]} == {4}, rule
    for rule in CPU_RULES:
        assert_no_gpus(jobs[rule])


def expected_tp(files) -> int:
    """The SGLang tp size the config files give (read independently of rules/common.smk)."""
    tp = 1
    for f in files:
        tp = (yaml.safe_load(Path(f).read_text()) or {}).get("sglang", {}).get("tp_size", tp)
    return tp


PRESETS = sorted((ROOT / "config").glob("*sglang*.yaml")) if (ROOT / "config").is_dir() else []


@pytest.mark.parametrize("preset", PRESETS, ids=[p.stem for p in PRESETS])
def test_presets_plan_gpu_jobs_on_gpus_and_cpu_jobs_without(
    tmp_path: Path, tiny_target: Path, preset: Path
):
    cfg = yaml.safe_load(preset.read_text())
    # the preset's model is not on this machine: plan against the tiny target instead
    local = write(tmp_path / "local.yaml", {"target": {"source": "path", "path": str(tiny_target)}})
    jobs = by_rule(dry_run(tmp_path, *SITE, python=slurm_python(), configfiles=(preset, local)))
    for rule in CPU_RULES:
        assert_no_gpus(jobs.get(rule, []))
    envs = cfg.get("envs", {})
    for stage in GPU_STAGES:
        role = cfg.get(stage, {}).get("role", "cpu")
        needs = envs.get(role, {}).get("gpus", 0) > 0
        for j in jobs.get(stage, []):
            assert (j.gpus() > 0) == needs, (preset.name, stage, j.resources)
