"""The patched SGLang: the capture patch applied to an overlay of the role's installed package.

    python -m draftsmith sglang-patch --pins envs/sglang-cpu.txt \\
        --patches patches/sglang-0.5.23/*.patch --pristine patches/sglang-0.5.23/pristine.sha256 \\
        --overlay results/sglang/overlay --out results/sglang/patched.json

Run with the capture role's interpreter. It reads the SGLang pin from the pin file, refuses an
installed SGLang of any other version, and refuses an install whose files the patch touches
differ from the pinned wheel's (`pristine.sha256` beside the patches: an already patched or
locally modified install). It then builds `overlay/sglang/` as a mirror of the installed package
(directories real, files symlinked to the install) in which only the files the patches touch are
real copies, applies every `*.patch` there with GNU patch, byte-compiles the patched files, and
records the hash of every patch and patched file in `patched.json`. The capture server runs with
the overlay first on its PYTHONPATH, so it imports the patched modules and everything else from
the install; the install itself is never modified (docs/sglang.md says why).

`load_patched(path)` is what a capture job calls: it re-hashes the overlay's patched files
against the record and refuses a missing, changed or unpatched overlay.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.metadata
import importlib.util
import os
import py_compile
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from draftsmith.runtime.files import atomic_write_json, init_logging, sha256_file

PACKAGE = "sglang"
PATCH_ID_RE = re.compile(r'^PATCH_ID = "([^"]+)"', re.M)


class PatchError(RuntimeError):
    """The installed SGLang cannot be patched, or a recorded overlay no longer matches."""


def pinned_version(pins_file: Path) -> str:
    from draftsmith.runtime.pins import read_pins

    pin = read_pins(pins_file).get(PACKAGE)
    if pin is None:
        raise PatchError(f"{pins_file}: no {PACKAGE}==<version> pin")
    return pin


def rule_inputs(workflow_dir: str | os.PathLike, role: str) -> dict:
    """The inputs of rule patch_sglang for the capture role `role`: its pin file and the
    patches and pristine hashes for its SGLang pin (ValueError, naming the config, when the role
    pins no SGLang or no patch exists for the pin)."""
    from draftsmith.runtime.pins import read_pins

    pins = Path(workflow_dir, "envs", f"{role}.txt")
    pin = read_pins(pins).get(PACKAGE)
    if pin is None:
        raise ValueError(
            f"config: capture.backend sglang, but capture.role {role!r} does not pin sglang in "
            f"{pins}"
        )
    patch_dir = Path(workflow_dir, "patches", f"sglang-{pin}")
    patches = sorted(patch_dir.glob("*.patch"))
    if not patches:
        raise ValueError(
            f"config: capture.backend sglang, but {patch_dir} has no *.patch for the pinned "
            f"SGLang {pin}"
        )
    return {
        "pins": str(pins),
        "patches": [str(p) for p in patches],
        "pristine": str(patch_dir / "pristine.sha256"),
    }


def installed_package() -> tuple[str, Path]:
    """(version, package directory) of this interpreter's SGLang, without importing it."""
    try:
        version = importlib.metadata.version(PACKAGE)
    except importlib.metadata.PackageNotFoundError:
        raise PatchError(f"{sys.executable}: {PACKAGE} is not installed") from None
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise PatchError(f"{sys.executable}: {PACKAGE} {version} has no package directory")
    return version, Path(list(spec.submodule_search_locations)[0]).resolve()


def patch_files(patches: list[Path]) -> list[str]:
    """Files the patches touch, as paths under the package's parent (`sglang/...`)."""
    touched = set()
    for patch in patches:
        lines = patch.read_text().splitlines()
        for old, new in zip(lines, lines[1:], strict=False):
            if old.startswith("--- ") and new.startswith("+++ "):
                rel = new[4:].split("\t")[0].split("/", 1)[-1]
                if not rel.startswith(f"{PACKAGE}/"):
                    raise PatchError(f"{patch}: touches {rel}, outside the {PACKAGE} package")
                touched.add(rel)
    return sorted(touched)


def read_pristine(path: Path) -> dict[str, str]:
    if not path.is_file():
        raise PatchError(f"{path} is missing (the pinned wheel's hashes of the patched files)")
    rows = {}
    for n, line in enumerate(path.read_text().splitlines(), 1):
        parts = line.split()
        if len(parts) != 2:
            raise PatchError(f"{path}:{n}: expected '<sha256>  <path>'")
        rows[parts[1]] = parts[0]
    return rows


def check_install(pkg_dir: Path, pristine: dict[str, str], changed: list[str], created: list[str]):
    """Refuse an install whose to-be-patched files are not the pinned wheel's."""
    root = pkg_dir.parent
    for rel in changed:
        f = root / rel
        if not f.is_file():
            raise PatchError(f"installed {PACKAGE} at {pkg_dir} lacks {rel}")
        if sha256_file(f) != pristine[rel]:
            raise PatchError(
                f"installed {rel} ({f}) differs from the pinned wheel's: an already patched or "
                f"locally modified install; reinstall {PACKAGE} from the pin"
            )
    for rel in created:
        if (root / rel).exists():
            raise PatchError(f"installed {PACKAGE} already has {rel}: an already patched install")


def mirror(pkg_dir: Path, dest: Path, real: set[str]) -> None:
    """dest/<package>: directories recreated, files symlinked, except `real` (copied)."""
    root = pkg_dir.parent
    for dirpath, dirnames, filenames in os.walk(pkg_dir):
        dirnames[:] = [d for d in dirnames if d != "__pycache__"]
        rel_dir = Path(dirpath).relative_to(root)
        (dest / rel_dir).mkdir(parents=True, exist_ok=True)
        for name in filenames:
            if name.endswith(".pyc"):
                continue
            rel = (rel_dir / name).as_posix()
            if rel in real:
                shutil.copyfile(Path(dirpath) / name, dest / rel)
            else:
                os.symlink(Path(dirpath) / name, dest / rel)


def apply_patches(patches: list[Path], dest: Path) -> None:
    for patch in patches:
        proc = subprocess.run(
            ["patch", "-p1", "--forward", "--batch", "--no-backup-if-mismatch", "-d", str(dest)],
            stdin=open(patch, "rb"),
            capture_output=True,
            text=True,
        )
        if proc.returncode != 0:
            raise PatchError(f"{patch} does not apply:\n{proc.stdout}{proc.stderr}")


def combined_hash(hashes: dict[str, str]) -> str:
    h = hashlib.sha256()
    for name in sorted(hashes):
        h.update(f"{name}\0{hashes[name]}\n".encode())
    return h.hexdigest()


def build(pins_file: Path, patches: list[Path], pristine_file: Path, overlay: Path, out: Path):
    """Check the install, build the patched overlay, write the record `out`; return it."""
    pin = pinned_version(pins_file)
    if not patches:
        raise PatchError("no *.patch files given")
    patch_dir = patches[0].parent
    if any(p.parent != patch_dir for p in patches) or patch_dir.name != f"{PACKAGE}-{pin}":
        raise PatchError(
            f"{patch_dir}: the patches for the pinned {PACKAGE} {pin} live in {PACKAGE}-{pin}/"
        )
    version, pkg_dir = installed_package()
    if version != pin:
        raise PatchError(
            f"{sys.executable} has {PACKAGE} {version} (at {pkg_dir}), but {pins_file} pins "
            f"{pin} and {patch_dir}/ is written for {pin} only: refusing to patch another version"
        )
    if overlay.resolve() in pkg_dir.parents:
        raise PatchError(f"{pkg_dir} is inside the overlay {overlay}: drop it from PYTHONPATH")
    patches = sorted(patches)
    touched = patch_files(patches)
    pristine = read_pristine(pristine_file)
    # files with a pristine hash are changed; the others are created by the patch
    changed = [rel for rel in touched if rel in pristine]
    created = [rel for rel in touched if rel not in pristine]
    check_install(pkg_dir, pristine, changed, created)
    overlay.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".tmp-overlay-", dir=overlay.parent))
    try:
        mirror(pkg_dir, staging, set(changed))
        apply_patches(patches, staging)
        files = {}
        for rel in changed + created:
            py_compile.compile(str(staging / rel), doraise=True)
            files[rel] = sha256_file(staging / rel)
        dump_module = next((staging / rel for rel in created if rel.endswith("_dump.py")), None)
        match = PATCH_ID_RE.search(dump_module.read_text()) if dump_module else None
        if match is None:
            raise PatchError(f"{patch_dir}: the patches create no dump module with a PATCH_ID")
        if overlay.exists():
            shutil.rmtree(overlay)
        os.replace(staging, overlay)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    patch_hashes = {p.name: sha256_file(p) for p in patches}
    record = {
        "sglang_version": version,
        "pin": pin,
        "package_dir": str(pkg_dir),
        "overlay": str(overlay),
        "patch_id": match.group(1),
        "patches": patch_hashes,
        "patch_hash": combined_hash(patch_hashes),
        "files": files,
        "pristine": {rel: pristine[rel] for rel in changed},
        "python": sys.executable,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    atomic_write_json(out, record)
    return record


def load_patched(path: str | os.PathLike) -> dict:
    """The record of a built overlay, after checking every patched file is still as recorded."""
    import json

    path = Path(path)
    if not path.is_file():
        raise PatchError(f"{path} is missing: run `snakemake {path}` (rule patch_sglang)")
    record = json.loads(path.read_text())
    overlay = Path(record["overlay"])  # relative paths are relative to the workdir
    for rel, sha in record["files"].items():
        f = overlay / rel
        if not f.is_file() or f.is_symlink():
            raise PatchError(f"{f}: patched file missing from the overlay; rerun patch_sglang")
        if sha256_file(f) != sha:
            raise PatchError(f"{f}: differs from {path} (unpatched or edited); rerun patch_sglang")
    record["overlay_path"] = str(overlay.resolve())
    return record


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(
        prog="python -m draftsmith sglang-patch",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--pins", type=Path, required=True, help="the capture role's pin file")
    ap.add_argument(
        "--patches", type=Path, nargs="+", required=True, help="patches/sglang-<pin>/*.patch"
    )
    ap.add_argument("--pristine", type=Path, required=True, help="the pinned wheel's file hashes")
    ap.add_argument("--overlay", type=Path, required=True, help="results/sglang/overlay")
    ap.add_argument("--out", type=Path, required=True, help="results/sglang/patched.json")
    args = ap.parse_args(argv)
    log = init_logging("draftsmith.engines.sglang.patch")
    try:
        record = build(args.pins, args.patches, args.pristine, args.overlay, args.out)
    except (PatchError, py_compile.PyCompileError, OSError) as e:
        raise SystemExit(f"error: {e}") from None
    log.info(
        "patched %s %s -> %s (%d files, patch %s)",
        PACKAGE,
        record["sglang_version"],
        record["overlay"],
        len(record["files"]),
        record["patch_hash"][:16],
    )
