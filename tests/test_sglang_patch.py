"""Rule patch_sglang's module: version and install checks, overlay, patched-file hashes.

The refusals run on fake installs (a `sglang` package and its dist-info on PYTHONPATH, with a
patch written by the test), so they need no SGLang. The real capture patch against the pinned
wheel's source is checked with the sglang-cpu role's interpreter (skipped without it).
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import roles

ROOT = Path(__file__).resolve().parents[1]
PATCH_DIR = ROOT / "patches" / "sglang-0.5.23"

ORIGINAL = "def f():\n    return 1\n"
PATCH = """diff -ruN a/sglang/mod.py b/sglang/mod.py
--- a/sglang/mod.py
+++ b/sglang/mod.py
@@ -1,2 +1,2 @@
 def f():
-    return 1
+    return 2
diff -ruN a/sglang/x_dump.py b/sglang/x_dump.py
--- a/sglang/x_dump.py
+++ b/sglang/x_dump.py
@@ -0,0 +1 @@
+PATCH_ID = "test-patch-1"
"""


def fake_install(root: Path, version: str, mod_text: str = ORIGINAL) -> Path:
    pkg = root / "site" / "sglang"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "mod.py").write_text(mod_text)
    (pkg / "data.bin").write_bytes(b"\0\1")
    dist = root / "site" / f"sglang-{version}.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text(f"Metadata-Version: 2.1\nName: sglang\nVersion: {version}\n")
    return root / "site"


def patch_dir(root: Path, pin: str = "0.5.23") -> Path:
    d = root / "patches" / f"sglang-{pin}"
    d.mkdir(parents=True)
    (d / "x.patch").write_text(PATCH)
    sha = hashlib.sha256(ORIGINAL.encode()).hexdigest()
    (d / "pristine.sha256").write_text(f"{sha}  sglang/mod.py\n")
    (root / "pins.txt").write_text(f"sglang=={pin}\n")
    return d


def run_patch(root: Path, site: Path, pdir: Path, python: str = sys.executable):
    env = {**os.environ, "PYTHONPATH": f"{site}:{ROOT}"}
    return subprocess.run(
        [
            python,
            "-m",
            "draftsmith",
            "sglang-patch",
            "--pins",
            str(root / "pins.txt"),
            "--patches",
            *map(str, sorted(pdir.glob("*.patch"))),
            "--pristine",
            str(pdir / "pristine.sha256"),
            "--overlay",
            str(root / "overlay"),
            "--out",
            str(root / "patched.json"),
        ],
        env=env,
        capture_output=True,
        text=True,
        cwd=root,
    )


def test_overlay_patched_files_real_rest_symlinked(tmp_path):
    site = fake_install(tmp_path, "0.5.23")
    proc = run_patch(tmp_path, site, patch_dir(tmp_path))
    assert proc.returncode == 0, proc.stderr
    overlay = tmp_path / "overlay" / "sglang"
    assert (overlay / "mod.py").read_text() == "def f():\n    return 2\n"
    assert not (overlay / "mod.py").is_symlink()
    assert (overlay / "data.bin").is_symlink()
    assert (overlay / "data.bin").resolve() == (site / "sglang" / "data.bin").resolve()
    assert (site / "sglang" / "mod.py").read_text() == ORIGINAL  # the install is untouched
    record = json.loads((tmp_path / "patched.json").read_text())
    assert record["sglang_version"] == "0.5.23" and record["patch_id"] == "test-patch-1"
    assert set(record["files"]) == {"sglang/mod.py", "sglang/x_dump.py"}
    assert len(record["patch_hash"]) == 64

    from draftsmith.engines.sglang.patch import PatchError, load_patched

    cwd = os.getcwd()
    os.chdir(tmp_path)
    try:
        assert load_patched("patched.json")["patch_id"] == "test-patch-1"
        (overlay / "mod.py").write_text(ORIGINAL)  # an unpatched overlay
        with pytest.raises(PatchError, match="unpatched or edited"):
            load_patched("patched.json")
    finally:
        os.chdir(cwd)


def test_refuses_other_version(tmp_path):
    site = fake_install(tmp_path, "0.5.22")
    proc = run_patch(tmp_path, site, patch_dir(tmp_path))
    assert proc.returncode != 0
    assert "has sglang 0.5.22" in proc.stderr and "pins 0.5.23" in proc.stderr
    assert "refusing to patch another version" in proc.stderr
    assert not (tmp_path / "patched.json").exists() and not (tmp_path / "overlay").exists()


def test_refuses_modified_or_already_patched_install(tmp_path):
    site = fake_install(tmp_path, "0.5.23", mod_text="def f():\n    return 2\n")
    proc = run_patch(tmp_path, site, patch_dir(tmp_path))
    assert proc.returncode != 0
    assert "differs from the pinned wheel's" in proc.stderr and "mod.py" in proc.stderr
    assert not (tmp_path / "patched.json").exists()


def test_refuses_missing_sglang(tmp_path):
    (tmp_path / "site").mkdir()
    proc = run_patch(tmp_path, tmp_path / "site", patch_dir(tmp_path))
    assert proc.returncode != 0 and "sglang is not installed" in proc.stderr


def test_refuses_patch_that_does_not_apply(tmp_path):
    site = fake_install(tmp_path, "0.5.23")
    pdir = patch_dir(tmp_path)
    (pdir / "x.patch").write_text(PATCH.replace("-    return 1", "-    return 7"))
    proc = run_patch(tmp_path, site, pdir)
    assert proc.returncode != 0 and "does not apply" in proc.stderr
    assert not (tmp_path / "overlay").exists()


def test_pristine_hashes_cover_every_changed_file():
    """Every file the real patch changes has the pinned wheel's hash; only the dump is new."""
    from draftsmith.engines.sglang.patch import patch_files, read_pristine

    touched = patch_files(sorted(PATCH_DIR.glob("*.patch")))
    pristine = read_pristine(PATCH_DIR / "pristine.sha256")
    assert set(touched) - set(pristine) == {"sglang/srt/draftsmith_dump.py"}
    for model in ("llama", "qwen2", "qwen3", "qwen3_moe", "deepseek_v2", "kimi_k25"):
        assert f"sglang/srt/models/{model}.py" in touched


@pytest.mark.slow
@pytest.mark.sglang
def test_real_patch_applies_to_pinned_sglang_and_compiles(tmp_path):
    """The capture patch on the role's installed sglang==0.5.23: applies, every patched module
    (deepseek_v2 and kimi_k25 included) compiles and imports its names."""
    python = roles.role_python("sglang-cpu")  # skips, or fails under DRAFTSMITH_REQUIRE_ENGINES=1
    (tmp_path / "pins.txt").write_text("sglang==0.5.23\n")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [
            python,
            "-m",
            "draftsmith",
            "sglang-patch",
            "--pins",
            str(tmp_path / "pins.txt"),
            "--patches",
            *map(str, sorted(PATCH_DIR.glob("*.patch"))),
            "--pristine",
            str(PATCH_DIR / "pristine.sha256"),
            "--overlay",
            str(tmp_path / "overlay"),
            "--out",
            str(tmp_path / "patched.json"),
        ],
        env=env,
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stderr
    record = json.loads((tmp_path / "patched.json").read_text())
    assert record["sglang_version"] == "0.5.23"
    assert record["patch_id"] == "draftsmith-capture-1"
    for model in ("deepseek_v2", "kimi_k25", "llama", "qwen2", "qwen3", "qwen3_moe"):
        assert f"sglang/srt/models/{model}.py" in record["files"]
    # the patched modules compile with the role's Python; the dump module runs there (loaded
    # by path: importing the sglang package needs the CPU compatibility layer)
    check = (
        "import importlib.util, py_compile, sys\n"
        "for f in sys.argv[1:]: py_compile.compile(f, doraise=True)\n"
        "spec = importlib.util.spec_from_file_location('dump', sys.argv[1])\n"
        "d = importlib.util.module_from_spec(spec); spec.loader.exec_module(d)\n"
        "print(d.PATCH_ID)\n"
    )
    overlay = tmp_path / "overlay"
    dump = "sglang/srt/draftsmith_dump.py"
    files = [str(overlay / dump)] + [str(overlay / r) for r in record["files"] if r != dump]
    proc = subprocess.run([python, "-c", check, *files], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "draftsmith-capture-1"
