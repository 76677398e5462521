"""The package installs: a wheel built from this checkout, installed without `-e` into a fresh
venv, has every subpackage and its data files, and its `draftsmith` command runs stages."""

from __future__ import annotations

import json
import shutil
import site
import subprocess
import sys
import venv
from pathlib import Path

import pytest
from wf import ROOT


def run(cmd, **kw):
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, **kw)
    assert proc.returncode == 0, f"{cmd}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    """A venv (seeing the packages of the interpreter running the tests: torch and the cpu pins)
    with the wheel."""
    base = tmp_path_factory.mktemp("wheel")
    dist, src = base / "dist", base / "src"
    # from a copy of the tracked files: setuptools builds in the source tree (build/, egg-info)
    files = run(["git", "ls-files"], cwd=ROOT).stdout.split()
    for f in files:
        if (ROOT / f).is_file():
            (src / f).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / f, src / f)
    run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
         "-w", str(dist), str(src)])  # fmt: skip
    (wheel,) = dist.glob("draftsmith-*.whl")
    env_dir = base / "venv"
    venv.create(env_dir, with_pip=True)
    see_this_interpreters_packages(env_dir)
    run([str(env_dir / "bin" / "python"), "-m", "pip", "install", "-q", "--no-deps",
         "--ignore-installed", str(wheel)])  # fmt: skip
    return env_dir


def see_this_interpreters_packages(env_dir: Path) -> None:
    """Put the site directories of the interpreter running the tests (a venv's own, or the
    system's) on `env_dir`'s path, after its own: `system_site_packages` would give it those of
    the base interpreter instead, which in a venv are not where torch and the pins are."""
    dirs = [*site.getsitepackages()]
    if site.ENABLE_USER_SITE and Path(site.getusersitepackages()).is_dir():
        dirs.append(site.getusersitepackages())
    code = "import sysconfig; print(sysconfig.get_paths()['purelib'])"
    own = run([str(env_dir / "bin" / "python"), "-c", code]).stdout.strip()
    (Path(own) / "running-interpreter.pth").write_text("".join(f"{d}\n" for d in dirs))


def test_the_wheel_holds_every_subpackage_and_its_data(installed):
    code = (
        "import json, pkgutil, draftsmith\n"
        "from pathlib import Path\n"
        "root = Path(draftsmith.__file__).parent\n"
        "mods = sorted(m.name for m in pkgutil.walk_packages([str(root)], 'draftsmith.'))\n"
        "data = sorted(str(p.relative_to(root)) for p in root.rglob('*') if p.suffix in"
        " ('.yaml', '.jsonl') or p.parent.name in ('overlay', 'sgl_kernel'))\n"
        "print(json.dumps({'root': str(root), 'mods': mods, 'data': data}))\n"
    )
    out = json.loads(run([str(installed / "bin" / "python"), "-c", code], cwd="/").stdout)
    assert Path(out["root"]).is_relative_to(installed), out["root"]  # not this checkout
    source = ROOT / "draftsmith"
    want = sorted(
        "draftsmith."
        + ".".join(p.relative_to(source).with_suffix("").parts).removesuffix(".__init__")
        for p in source.rglob("*.py")
        if "overlay" not in p.parts and p != source / "__init__.py"
    )
    assert set(want) <= set(out["mods"]), sorted(set(want) - set(out["mods"]))
    for name in ("config/config.schema.yaml", "data/prompts.jsonl",
                 "engines/sglang/cpu/overlay/sitecustomize.py",
                 "engines/sglang/cpu/overlay/sgl_kernel/__init__.py"):  # fmt: skip
        assert name in out["data"], (name, out["data"])


def test_the_console_script_runs_stages_from_the_wheel(installed, tmp_path):
    exe = str(installed / "bin" / "draftsmith")
    top = run([exe, "--help"], cwd=tmp_path).stdout
    assert "usage: draftsmith <command>" in top and "  capture " in top
    run([exe, "tiny-model", "--out", str(tmp_path / "tiny"), "--layers", "4"], cwd=tmp_path)
    config = json.loads((tmp_path / "tiny" / "config.json").read_text())
    assert config["num_hidden_layers"] == 4
    # the schema ships: the config reference is written from it
    doc = run([exe, "config-doc"], cwd=tmp_path).stdout
    assert "| key | type |" in doc and "draft.algorithm" in doc
