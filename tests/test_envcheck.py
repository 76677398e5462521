"""validate_env: real interpreters, real messages."""

from __future__ import annotations

import subprocess
import sys

import pytest
from wf import ROOT

from draftsmith.stages.env import EnvError, check, read_pins, same_version

CPU_PINS = ROOT / "envs" / "cpu.txt"


@pytest.fixture(scope="module")
def bare_python(tmp_path_factory) -> str:
    """A real second interpreter without torch."""
    venv = tmp_path_factory.mktemp("bare") / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    return str(venv / "bin" / "python")


def test_interpreter_without_torch_names_role_interpreter_module_and_fix(bare_python):
    with pytest.raises(EnvError) as e:
        check("cpu", CPU_PINS, bare_python, gpus=0)
    msg = str(e.value)
    assert "role 'cpu'" in msg
    assert bare_python in msg
    assert "'torch'" in msg and "No module named 'torch'" in msg
    assert "envs.cpu.python" in msg
    assert str(CPU_PINS) in msg


def test_missing_interpreter(tmp_path):
    with pytest.raises(EnvError, match="does not exist"):
        check("cpu", CPU_PINS, str(tmp_path / "nope" / "python"), gpus=0)


def test_pin_mismatch_lists_every_package(tmp_path):
    pins = tmp_path / "cpu.txt"
    pins.write_text("torch==0.0.1\nsafetensors==0.8.0\nnot-a-real-package-xyz==1.0\n")
    with pytest.raises(EnvError) as e:
        check("cpu", pins, sys.executable, gpus=0)
    msg = str(e.value)
    assert "torch==0.0.1" in msg
    assert "not-a-real-package-xyz==1.0: not installed" in msg
    assert "safetensors" not in msg.split("\n", 1)[1].split("Point")[0]


def test_gpus_required_but_absent():
    pins = read_pins(CPU_PINS)
    assert "torch" in pins
    with pytest.raises(EnvError, match=r"needs 8 GPU\(s\).*sees 0"):
        check("cpu", CPU_PINS, sys.executable, gpus=8)


def test_this_interpreter_passes_and_stamps_versions():
    stamp = check("cpu", CPU_PINS, sys.executable, gpus=0)
    assert stamp["packages"]["torch"]["ok"]
    assert stamp["gpu_count"] == 0
    assert stamp["python"]


def test_pin_files_are_exact_and_conda_files_agree():
    import yaml

    for txt in sorted((ROOT / "envs").glob("*.txt")):
        pins = read_pins(txt)  # raises on anything but name==version
        conda = yaml.safe_load(txt.with_suffix(".yaml").read_text())
        pip = next(d["pip"] for d in conda["dependencies"] if isinstance(d, dict))
        assert {p.split("==")[0].lower().replace("_", "-"): p.split("==")[1] for p in pip} == {
            k: v for k, v in pins.items()
        }, txt
    sglang = read_pins(ROOT / "envs" / "sglang.txt")
    assert sglang["sglang"] == "0.5.23" and sglang["torch"] == "2.14.1"


def test_read_pins_rejects_ranges(tmp_path):
    f = tmp_path / "x.txt"
    f.write_text("torch>=2.0\n")
    with pytest.raises(EnvError, match=r"x.txt:1: 'torch>=2.0' is not an exact pin"):
        read_pins(f)


def test_local_version_label():
    assert same_version("2.13.0+cpu", "2.13.0")
    assert not same_version("2.13.1", "2.13.0")


def test_directives_and_no_deps_install_args(tmp_path):
    from draftsmith.stages.env import pip_install_args, read_directives

    f = tmp_path / "x.txt"
    f.write_text("# a comment\n# draftsmith: no-deps\ntorch==2.13.0\n")
    assert read_directives(f) == {"no-deps"}
    assert pip_install_args(f) == ["--no-input", "--no-deps", "-r", str(f)]
    f.write_text("torch==2.13.0\n")
    assert pip_install_args(f) == ["--no-input", "-r", str(f)]
    f.write_text("# draftsmith: nodeps\ntorch==2.13.0\n")
    with pytest.raises(EnvError, match=r"x.txt:1: unknown directive 'nodeps'"):
        read_directives(f)
    # the sglang-cpu role's file is a whole closure installed without dependency resolution
    assert read_directives(ROOT / "envs" / "sglang-cpu.txt") == {"no-deps"}
    pins = read_pins(ROOT / "envs" / "sglang-cpu.txt")
    assert pins["sglang"] == "0.5.23" and pins["torch"] == "2.13.0"
