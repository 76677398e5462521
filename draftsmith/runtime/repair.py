"""A plain rerun repairs what a job refuses, and a failed rebuild never takes the last good draft.

- `discard_refused_shards(error, shard_paths)`: training found a shard it cannot use (checksum
  mismatch, truncated file, a manifest whose layer ids, target fingerprint or draft vocabulary
  differ). The shard and its manifest are deleted, as `python -m draftsmith shards verify
  --delete` would, so the next `snakemake` sees them missing and rebuilds exactly those ranges
  (then training). Returns the SystemExit the job ends with, naming what was deleted.
- `keep_last_good(out_dir)`: after a successful export, `<out_dir>.last-good/` becomes a copy of
  the draft by hard links (no extra disk: the export writes new files and never rewrites old
  ones). Snakemake deletes `results/draft` before a train job runs and after it fails; the copy
  beside it is no output of any rule, so it outlives both.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from pathlib import Path

log = logging.getLogger("draftsmith.runtime.repair")
LAST_GOOD = ".last-good"


def refused(message: str, shard_paths: list[Path]) -> list[Path]:
    """The shards an error message names (by range name: shard, manifest or tensor messages)."""
    return [p for p in shard_paths if Path(p).stem in message]


def discard_refused_shards(error: Exception, shard_paths: list[Path]) -> SystemExit:
    """Delete the shards (and manifests) `error` names, on rank 0; the exit says what happened."""
    message = str(error)
    bad = refused(message, [Path(p) for p in shard_paths])
    if not bad:
        return SystemExit(
            f"error: {message}\n(`python -m draftsmith shards verify results/hidden --delete`, "
            "then rerun snakemake to rebuild the bad shards)"
        )
    if int(os.environ.get("RANK", "0")) == 0:
        for p in bad:
            p.unlink(missing_ok=True)
            p.with_suffix(".json").unlink(missing_ok=True)
            log.warning("deleted %s and its manifest: the next run rebuilds it", p)
    names = ", ".join(p.name for p in bad)
    return SystemExit(
        f"error: {message}\ndeleted the refused shard(s) {names} and their manifests: the next "
        "plain `snakemake` rebuilds only those ranges, then trains (the last good draft stays in "
        f"results/draft{LAST_GOOD}/)"
    )


def keep_last_good(out_dir: str | os.PathLike) -> Path:
    """Make `<out_dir>.last-good/` a hard-link copy of `out_dir` (replaced atomically)."""
    out = Path(out_dir)
    beside = out.with_name(out.name + LAST_GOOD)
    stage = Path(tempfile.mkdtemp(prefix=f".tmp-{beside.name}-", dir=out.parent))
    try:
        for src in sorted(out.rglob("*")):
            dst = stage / src.relative_to(out)
            if src.is_dir():
                dst.mkdir(exist_ok=True)
                continue
            dst.parent.mkdir(parents=True, exist_ok=True)
            try:
                os.link(src, dst)
            except OSError:  # a file system without hard links
                shutil.copy2(src, dst)
        os.chmod(stage, 0o755)
        old = None
        if beside.exists():
            old = Path(tempfile.mkdtemp(prefix=f".tmp-{beside.name}-old-", dir=out.parent))
            os.replace(beside, old / "x")
        os.replace(stage, beside)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(stage, ignore_errors=True)
        raise
    return beside
