"""`envcheck venv --cache`: one build per pin text and interpreter, reused, never half-built."""

from __future__ import annotations

from pathlib import Path

import pytest

from draftsmith.stages import env as envcheck


@pytest.fixture
def builds(monkeypatch):
    """build_venv replaced by a recorder that makes a venv-shaped directory."""
    calls: list[Path] = []

    def fake_build(pins_file: Path, out: Path) -> None:
        calls.append(out)
        (out / "bin").mkdir(parents=True, exist_ok=True)
        (out / "bin" / "python").write_text(pins_file.read_text())

    monkeypatch.setattr(envcheck, "build_venv", fake_build)
    return calls


def test_same_pins_reuse_the_build_and_changed_pins_build_anew(tmp_path, builds):
    pins, root = tmp_path / "role.txt", tmp_path / "cache"
    pins.write_text("six==1.17.0\n")
    out = tmp_path / "clone" / ".venvs" / "role"
    first = envcheck.cached_venv(pins, out, root)
    assert out.is_symlink() and out.resolve() == first.resolve() and len(builds) == 1
    assert (out / "bin" / "python").read_text() == "six==1.17.0\n"
    again = envcheck.cached_venv(pins, tmp_path / "other" / "role", root)
    assert again == first and len(builds) == 1  # reused: no second build
    pins.write_text("six==1.16.0\n")
    changed = envcheck.cached_venv(pins, out, root)
    assert changed != first and len(builds) == 2 and out.resolve() == changed.resolve()
    assert first.is_dir()  # the old pins' venv stays for clones that still use them


def test_a_build_that_did_not_finish_is_never_reused(tmp_path, builds):
    pins, root = tmp_path / "role.txt", tmp_path / "cache"
    pins.write_text("six==1.17.0\n")
    cached = envcheck.cached_venv(pins, tmp_path / "a", root)
    (cached / envcheck.COMPLETE).unlink()  # as if pip had died before the marker
    envcheck.cached_venv(pins, tmp_path / "a", root)
    assert len(builds) == 2 and (cached / envcheck.COMPLETE).is_file()


def test_a_real_directory_at_out_is_replaced_by_the_link(tmp_path, builds):
    pins = tmp_path / "role.txt"
    pins.write_text("six==1.17.0\n")
    out = tmp_path / "role"
    (out / "bin").mkdir(parents=True)
    envcheck.cached_venv(pins, out, tmp_path / "cache")
    assert out.is_symlink()
