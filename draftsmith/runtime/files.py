"""Small shared helpers: atomic writes, checksums, the resolved config, provenance.

Nothing here imports torch at module level, so the Snakefile can import the package at
DAG-build time with only the standard library and pyyaml.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import glob
import hashlib
import json
import logging
import os
import platform
import shutil
import sys
import tempfile
import zlib
from pathlib import Path


def init_logging(name: str) -> logging.Logger:
    """Human logs go to stderr (the rule redirects it to its `log:` file)."""
    logging.basicConfig(
        level=logging.INFO,
        format="%(asctime)s %(name)s %(levelname)s %(message)s",
        stream=sys.stderr,
    )
    return logging.getLogger(name)


def command_parser(command: str, doc: str | None, **kwargs) -> argparse.ArgumentParser:
    """The parser of `python -m draftsmith <command>`: its module's docstring `doc` as the
    description, laid out as written."""
    return argparse.ArgumentParser(
        prog=f"python -m draftsmith {command}",
        description=doc,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        **kwargs,
    )


def subcommand_parser(command: str, doc: str | None, dest: str = "cmd"):
    """`command_parser` with a required subcommand (named in `dest`): (parser, its subparsers)."""
    ap = command_parser(command, doc)
    return ap, ap.add_subparsers(dest=dest, required=True)


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextlib.contextmanager
def atomic_path(final_path: str | os.PathLike):
    """Yield a temp path beside `final_path`; on success fsync it and rename it into place.

    A crash leaves only a `.tmp-*` file that no reader takes for the finished artifact.
    """
    final = Path(final_path)
    final.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".tmp-{final.name}-", dir=final.parent)
    os.close(fd)
    tmp_path = Path(tmp)
    try:
        yield tmp_path
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp_path, 0o666 & ~umask)
        with open(tmp_path, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp_path, final)
        fsync_dir(final.parent)
    except BaseException:
        tmp_path.unlink(missing_ok=True)
        raise


@contextlib.contextmanager
def atomic_dir(final_path: str | os.PathLike):
    """Yield an empty staging directory beside `final_path`; on success fsync every file in
    it, replace `final_path` (a directory) with it by one rename, and fsync the parent. On
    failure the staging directory is removed: a reader finds the old directory or the new one,
    never a half-written one."""
    final = Path(final_path)
    final.parent.mkdir(parents=True, exist_ok=True)
    stage = Path(tempfile.mkdtemp(prefix=f".tmp-{final.name}-", dir=final.parent))
    try:
        yield stage
        for p in stage.rglob("*"):
            if p.is_file():
                with open(p, "rb") as f:
                    os.fsync(f.fileno())
        os.chmod(stage, 0o755)
        if final.exists():
            shutil.rmtree(final)
        os.replace(stage, final)
        fsync_dir(final.parent)
    except BaseException:
        shutil.rmtree(stage, ignore_errors=True)
        raise


@contextlib.contextmanager
def exclusive_lock(path: str | os.PathLike, waiting: str = ""):
    """Hold an exclusive flock on `path` (created if absent) for the block. A process that finds
    it held prints `waiting` to stderr and waits; the kernel drops the lock of a process that
    dies, so no lock outlives its holder."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            if waiting:
                print(waiting, file=sys.stderr, flush=True)
            fcntl.flock(f, fcntl.LOCK_EX)
        yield


@contextlib.contextmanager
def flocked(path: str | os.PathLike, how: int):
    """The flock `how` on `path` (created if absent; with LOCK_NB: BlockingIOError when taken),
    released after the block."""
    with open(path, "a+") as f:
        fcntl.flock(f, how)
        try:
            yield f
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def remove_stale_temps(directory: Path, prefix: str) -> None:
    """Delete `prefix*` leftovers of a killed build in `directory` (files or staging dirs).

    Callers name the prefix of one output only (e.g. `.tmp-rows_000000-000128.safetensors-`):
    Snakemake never runs two jobs for the same output at once, so such a file is an orphan.
    """
    for old in sorted(Path(directory).glob(glob.escape(prefix) + "*")):
        logging.getLogger("draftsmith").warning("removing %s, left by an interrupted job", old)
        if old.is_dir() and not old.is_symlink():
            shutil.rmtree(old, ignore_errors=True)
        else:
            old.unlink(missing_ok=True)


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> None:
    with atomic_path(path) as tmp:
        tmp.write_bytes(data)


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    atomic_write_bytes(path, text.encode("utf-8"))


def atomic_write_json(path: str | os.PathLike, obj) -> None:
    atomic_write_text(path, json.dumps(obj, indent=2, sort_keys=False) + "\n")


def file_digests(path: str | os.PathLike, chunk: int = 1 << 22) -> tuple[str, str]:
    """(sha256, crc32 as 8 hex digits) of a file, in one read."""
    h, crc = hashlib.sha256(), 0
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
            crc = zlib.crc32(block, crc)
    return h.hexdigest(), f"{crc:08x}"


def crc32_buffer(buf, chunk: int = 1 << 26) -> str:
    """crc32 (8 hex digits) of a bytes-like object, e.g. a memory map, read in chunks."""
    view, crc = memoryview(buf).cast("B"), 0
    for a in range(0, len(view), chunk):
        crc = zlib.crc32(view[a : a + chunk], crc)
    return f"{crc:08x}"


def sha256_file(path: str | os.PathLike, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def read_json_object(path, error: type[Exception] = ValueError, what: str = "JSON object") -> dict:
    """The JSON object in file `path`; `error` naming the file (as a `what`) where it cannot be
    read, is not JSON or is not an object."""
    try:
        obj = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:  # UnicodeDecodeError, JSONDecodeError: ValueErrors
        raise error(f"{path}: not a readable {what} ({e})") from None
    if not isinstance(obj, dict):
        raise error(f"{path}: not a {what} (a JSON {type(obj).__name__}, not an object)")
    return obj


def parse_cfg(text: str) -> dict:
    """The config sections a rule passes as `--cfg` (JSON, schema-validated at parse time)."""
    try:
        cfg = json.loads(text)
    except json.JSONDecodeError as e:
        raise SystemExit(f"--cfg is not valid JSON: {e}") from None
    if not isinstance(cfg, dict):
        raise SystemExit("--cfg must be a JSON object of config sections")
    return cfg


RUN_ENV = "DRAFTSMITH_RUN"


def merge_run(cfg: dict, text: str | None = None, sections=None) -> dict:
    """Merge the run settings into the config sections of `--cfg`.

    Run settings never change a result (a server's port, timeouts and retries), so rules keep
    them out of `params` (changing one makes no output stale): jobs get them as the JSON of the
    environment variable DRAFTSMITH_RUN (rules/common.smk sets it), or of `--run` by hand.
    `sections` limits the merge to those sections (default: all).
    """
    text = text or os.environ.get(RUN_ENV, "")
    if not text:
        return cfg
    run = parse_cfg(text)
    for section, values in run.items():
        if sections is not None and section not in sections:
            continue
        if not isinstance(values, dict):
            raise SystemExit(f"--run: section {section!r} must be an object")
        cfg[section] = {**cfg.get(section, {}), **values}
    return cfg


def set_threads(n: int | None) -> None:
    """Apply the rule's thread count to torch (threads come from profiles, not config) and log
    the wait policy the job chose for the load it started under (draftsmith.runtime.threads)."""
    from draftsmith.runtime.threads import policy_note

    why = policy_note()
    if why:
        logging.getLogger("draftsmith").info("threads: %s", why)
    if n:
        import torch

        torch.set_num_threads(int(n))


def versions() -> dict:
    """Provenance for reports and manifests."""
    from importlib.metadata import PackageNotFoundError, version

    out = {"python": platform.python_version(), "executable": sys.executable}
    for name in ("torch", "transformers", "safetensors", "snakemake", "sglang"):
        try:
            out[name] = version(name)
        except PackageNotFoundError:  # absent packages are simply not recorded
            continue
    from draftsmith import __version__

    out["draftsmith"] = __version__
    return out
