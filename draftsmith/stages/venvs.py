"""`draftsmith env venv`: a venv with exactly a pin file's packages, built in place or, with
`--cache`, once per pin file text and interpreter under `$DRAFTSMITH_VENV_CACHE` (default
`~/.cache/draftsmith/venvs/<pins stem>-<key>`), `--out` becoming a symlink to the entry.

A cache entry is one directory with a marker file, `.draftsmith-venv`, written last and holding
the entry's key. Everything that decides between reusing and building happens under an
exclusive flock on `<entry>.lock` beside it, so two projects asking for the same entry at once
get one build: the second waits (saying so) and then reuses it. Before reuse the entry is
checked, not trusted: the marker must hold the key, and the entry's own interpreter must run and
find every pinned distribution at its pinned version with every file its install record lists
(byte-code caches aside). An entry failing any of these is rebuilt, with the reason printed.

The interpreter in the key is the one the venv is built from: the running one, or, when it runs
inside a venv itself (the README's `.venv`), that venv's base interpreter, symlinks resolved. So
the same Python reuses the same entries from any clone's `.venv` or from outside one.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import venv
from pathlib import Path

from draftsmith.runtime.files import atomic_write_bytes, exclusive_lock
from draftsmith.runtime.pins import read_directives, read_pins, stamp_key

COMPLETE = ".draftsmith-venv"  # written last into a cached venv: its key, once pip succeeded

# Runs in the entry's interpreter: standard library only; prints a JSON list of problems.
ENTRY_CHECK = r"""
import json, sys
from importlib import metadata
problems = []
for name, pinned in sorted(json.loads(sys.argv[1]).items()):
    try:
        dist = metadata.distribution(name)
    except metadata.PackageNotFoundError:
        problems.append(f"{name}=={pinned} is not installed")
        continue
    if pinned not in (dist.version, dist.version.split("+", 1)[0]):
        problems.append(f"{name}=={pinned}: {dist.version} is installed")
        continue
    missing = [str(f) for f in dist.files or () if f.suffix != ".pyc"
               and not dist.locate_file(f).exists()]
    if missing:
        problems.append(f"{name}=={pinned}: {len(missing)} of its installed files are missing "
                        f"(first: {missing[0]})")
print(json.dumps(problems))
"""


def pip_install_args(pins_file: Path) -> list[str]:
    """`pip install` arguments for a pin file, honouring its `no-deps` directive."""
    args = ["--no-input"]
    if "no-deps" in read_directives(pins_file):
        read_pins(pins_file)  # the file is the whole closure: every line must be an exact pin
        args.append("--no-deps")
    return [*args, "-r", str(pins_file)]


def build_venv(pins_file: Path, out: Path) -> None:
    """A venv for a role from its pin file (`envs.<role>.python: venv`)."""
    tmp = out.with_name(f".tmp-{out.name}")
    shutil.rmtree(tmp, ignore_errors=True)
    venv.EnvBuilder(with_pip=True, symlinks=True).create(tmp)
    pip = [str(tmp / "bin" / "python"), "-m", "pip", "install", *pip_install_args(pins_file)]
    subprocess.run(pip, check=True, stdout=sys.stderr)
    if out.exists():
        shutil.rmtree(out)
    tmp.rename(out)
    # venvs are not relocatable: rewrite the interpreter path baked into scripts and pyvenv.cfg
    for f in [out / "pyvenv.cfg", *sorted((out / "bin").iterdir())]:
        if f.is_file() and not f.is_symlink():
            data = f.read_bytes()
            if str(tmp).encode() in data:
                f.write_bytes(data.replace(str(tmp).encode(), str(out).encode()))


def venv_cache_root() -> Path:
    default = Path.home() / ".cache" / "draftsmith" / "venvs"
    return Path(os.environ.get("DRAFTSMITH_VENV_CACHE") or default).expanduser()


def base_interpreter() -> str:
    """The interpreter `venv` builds from: this one, or the base of the venv it runs in."""
    return os.path.realpath(getattr(sys, "_base_executable", None) or sys.executable)


def cache_key(pins_file: Path) -> str:
    return stamp_key(pins_file.read_text(), f"{base_interpreter()} {sys.version}", 0)


def marker_problem(marker: Path, key: str) -> str | None:
    """Why `marker` does not show a finished build of `key`; None when it does."""
    try:
        text = marker.read_bytes().decode("ascii").strip()
    except FileNotFoundError:
        return f"no marker {marker} (its build never finished)"
    except OSError as e:
        return f"its marker {marker} cannot be read ({e.strerror or e})"
    except UnicodeDecodeError:
        return f"its marker {marker} is not the key text a finished build writes (garbage bytes)"
    if text != key:
        return f"its marker {marker} holds {text[:40]!r}, not the entry's key {key}"
    return None


def entry_problem(entry: Path, pins_file: Path, pins: dict[str, str]) -> str | None:
    """Why the finished-looking `entry` cannot serve `pins_file` (read as `pins`); None when
    it can."""
    python = entry / "bin" / "python"
    if not python.exists():  # a dangling link counts as missing
        return f"its interpreter {python} is missing"
    try:
        proc = subprocess.run(
            [str(python), "-c", ENTRY_CHECK, json.dumps(pins)],
            capture_output=True,
            text=True,
            timeout=300,
        )
        problems = json.loads(proc.stdout.strip().splitlines()[-1])
    except (OSError, subprocess.TimeoutExpired, IndexError, ValueError) as e:
        return f"its interpreter {python} failed to run the check ({type(e).__name__}: {e})"
    if proc.returncode != 0:
        return f"its interpreter {python} failed to run the check:\n{proc.stderr.strip()[-2000:]}"
    if problems:
        return f"it does not hold the pins of {pins_file}:\n  " + "\n  ".join(problems)
    return None


def cached_venv(pins_file: Path, out: Path, root: Path | None = None) -> Path:
    """`out` as a symlink to the cached venv of this pin file's text and interpreter, built
    first (under the entry's lock) when the cache has no sound one (docstring above)."""
    pins = read_pins(pins_file)  # a line that is not an exact pin: refused before any build
    key = cache_key(pins_file)
    cached = (root or venv_cache_root()) / f"{pins_file.stem}-{key}"
    lock = cached.with_name(f"{cached.name}.lock")
    waiting = f"waiting for another process building {cached} (lock {lock})"
    with exclusive_lock(lock, waiting):
        marker = cached / COMPLETE
        why = marker_problem(marker, key)
        if why is None:
            why = entry_problem(cached, pins_file, pins)
        if why is None:
            print(f"reused {cached} for {pins_file} (same pins and interpreter, checked)",
                  file=sys.stderr)  # fmt: skip
        else:
            if cached.exists():
                print(f"rebuilding {cached} for {pins_file}: {why}", file=sys.stderr)
                marker.unlink(missing_ok=True)
            cached.parent.mkdir(parents=True, exist_ok=True)
            build_venv(pins_file, cached)
            atomic_write_bytes(marker, (key + "\n").encode())
            print(f"built {cached} for {pins_file}", file=sys.stderr)
    if out.is_symlink() or out.is_file():
        out.unlink()
    elif out.exists():
        shutil.rmtree(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.symlink_to(cached, target_is_directory=True)
    return cached
