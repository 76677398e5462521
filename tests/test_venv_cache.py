"""`env venv --cache`: one build per pin text and interpreter, reused only when sound, never
half-built, and one build when two processes ask for the same entry at once."""

from __future__ import annotations

import multiprocessing
import os
import shutil
import subprocess
import sys
import time
import venv
from pathlib import Path

import pytest

from draftsmith.runtime.pins import EnvError, read_pins
from draftsmith.stages import venvs


def fake_build(pins_file: Path, out: Path) -> None:
    """A real venv (no pip) holding, for each pin, a one-module distribution with its install
    record: what `pip install` would leave, in milliseconds; like build_venv, it replaces `out`."""
    shutil.rmtree(out, ignore_errors=True)
    venv.EnvBuilder(symlinks=True).create(out)
    site = out / "lib" / f"python{sys.version_info[0]}.{sys.version_info[1]}" / "site-packages"
    for name, version in read_pins(pins_file).items():
        module = name.replace("-", "_")
        (site / module).mkdir()
        (site / module / "__init__.py").write_text(f"VERSION = {version!r}\n")
        info = site / f"{module}-{version}.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
        (info / "RECORD").write_text(
            f"{module}/__init__.py,,\n{info.name}/METADATA,,\n{info.name}/RECORD,,\n"
        )


@pytest.fixture
def builds(monkeypatch):
    """build_venv replaced by `fake_build`, each call recorded."""
    calls: list[Path] = []

    def recorded(pins_file: Path, out: Path) -> None:
        calls.append(out)
        fake_build(pins_file, out)

    monkeypatch.setattr(venvs, "build_venv", recorded)
    return calls


@pytest.fixture
def pins(tmp_path) -> Path:
    path = tmp_path / "role.txt"
    path.write_text("demo-torch==2.13.0\n")
    return path


def test_same_pins_reuse_the_build_and_changed_pins_build_anew(tmp_path, builds, pins):
    root = tmp_path / "cache"
    out = tmp_path / "clone" / ".venvs" / "role"
    first = venvs.cached_venv(pins, out, root)
    assert out.is_symlink() and out.resolve() == first.resolve() and len(builds) == 1
    assert (out / "bin" / "python").exists()
    again = venvs.cached_venv(pins, tmp_path / "other" / "role", root)
    assert again == first and len(builds) == 1  # reused: no second build
    pins.write_text("demo-torch==2.14.0\n")
    changed = venvs.cached_venv(pins, out, root)
    assert changed != first and len(builds) == 2 and out.resolve() == changed.resolve()
    assert first.is_dir()  # the old pins' venv stays for clones that still use them


def test_a_build_that_did_not_finish_is_never_reused(tmp_path, builds, pins):
    root = tmp_path / "cache"
    cached = venvs.cached_venv(pins, tmp_path / "a", root)
    (cached / venvs.COMPLETE).unlink()  # as if pip had died before the marker
    venvs.cached_venv(pins, tmp_path / "a", root)
    assert len(builds) == 2 and (cached / venvs.COMPLETE).is_file()


def test_a_real_directory_at_out_is_replaced_by_the_link(tmp_path, builds, pins):
    out = tmp_path / "role"
    (out / "bin").mkdir(parents=True)
    venvs.cached_venv(pins, out, tmp_path / "cache")
    assert out.is_symlink()


def test_a_garbage_marker_is_named_and_the_entry_rebuilt(tmp_path, builds, pins, capsys):
    root = tmp_path / "cache"
    cached = venvs.cached_venv(pins, tmp_path / "a", root)
    marker = cached / venvs.COMPLETE
    marker.write_bytes(b"\xff\xfe\x00\x9c garbage")
    capsys.readouterr()
    assert venvs.cached_venv(pins, tmp_path / "a", root) == cached
    err = capsys.readouterr().err
    assert f"rebuilding {cached}" in err and str(marker) in err and "garbage" in err
    assert len(builds) == 2 and marker.read_text().strip() == venvs.cache_key(pins)


@pytest.mark.parametrize("damage", ["interpreter", "package", "version"])
def test_a_damaged_entry_with_an_intact_marker_is_rebuilt(tmp_path, builds, pins, capsys, damage):
    root = tmp_path / "cache"
    cached = venvs.cached_venv(pins, tmp_path / "a", root)
    site = next(cached.glob("lib/python*/site-packages"))
    if damage == "interpreter":
        (cached / "bin" / "python").unlink()
        want = f"its interpreter {cached / 'bin' / 'python'} is missing"
    elif damage == "package":  # as if someone deleted site-packages/torch
        for f in (site / "demo_torch").iterdir():
            f.unlink()
        (site / "demo_torch").rmdir()
        want = "demo-torch==2.13.0: 1 of its installed files are missing (first: demo_torch/"
    else:
        (site / "demo_torch-2.13.0.dist-info" / "METADATA").write_text(
            "Metadata-Version: 2.1\nName: demo-torch\nVersion: 2.12.0\n"
        )
        want = "demo-torch==2.13.0: 2.12.0 is installed"
    capsys.readouterr()
    venvs.cached_venv(pins, tmp_path / "a", root)
    err = capsys.readouterr().err
    assert f"rebuilding {cached}" in err and want in err, err
    assert len(builds) == 2 and "reused" not in err
    venvs.cached_venv(pins, tmp_path / "a", root)  # the rebuilt entry passes the check
    assert len(builds) == 2 and "reused" in capsys.readouterr().err


def test_a_pin_file_with_a_loose_pin_is_refused_before_any_build(tmp_path, builds):
    pins = tmp_path / "role.txt"
    pins.write_text("demo-torch>=2\n")
    with pytest.raises(EnvError, match="role.txt:1"):
        venvs.cached_venv(pins, tmp_path / "a", tmp_path / "cache")
    assert builds == []


def build_at_once(pins: Path, out: Path, root: Path, log: Path, barrier) -> None:
    """One of two processes asking for the same entry at the same moment (a build of 1 s)."""

    def slow_build(pins_file: Path, dest: Path) -> None:
        with open(log, "a") as f:
            f.write(f"build {dest}\n")
        time.sleep(1.0)
        fake_build(pins_file, dest)

    venvs.build_venv = slow_build  # this child's module only
    barrier.wait()
    venvs.cached_venv(pins, out, root)


def test_two_processes_asking_at_once_get_one_build(tmp_path, pins):
    root, log = tmp_path / "cache", tmp_path / "builds.log"
    ctx = multiprocessing.get_context("fork")
    barrier = ctx.Barrier(2)
    procs = [
        ctx.Process(target=build_at_once, args=(pins, tmp_path / p / "role", root, log, barrier))
        for p in ("project-a", "project-b")
    ]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
    assert [p.exitcode for p in procs] == [0, 0]
    assert len(log.read_text().splitlines()) == 1, log.read_text()
    (entry,) = [p for p in root.iterdir() if p.is_dir()]
    for project in ("project-a", "project-b"):
        assert (tmp_path / project / "role").resolve() == entry.resolve()
    assert not list(root.glob(".tmp-*"))


def test_the_key_is_the_same_from_a_venv_of_this_python(tmp_path, pins):
    """The README's `.venv` (or any venv) of this Python finds the entries this Python built:
    the key names the interpreter a venv is built from, not the venv's own."""
    env_dir = tmp_path / "dotvenv"
    venv.EnvBuilder(symlinks=True).create(env_dir)
    code = (
        "import sys; from pathlib import Path; from draftsmith.stages.venvs import cache_key; "
        "print(cache_key(Path(sys.argv[1])))"
    )
    root = Path(__file__).resolve().parents[1]
    proc = subprocess.run(
        [str(env_dir / "bin" / "python"), "-c", code, str(pins)],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(root)},
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == venvs.cache_key(pins)
