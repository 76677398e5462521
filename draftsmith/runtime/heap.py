"""glibc's heap thresholds for a job that allocates large tensors step after step.

By default glibc serves an allocation of 128 KiB or more with a fresh mapping and moves that
threshold up to the largest block freed so far (at most 32 MiB); it also gives the top of the
heap back to the system once more than twice the threshold lies free there. A stage that
allocates tensors of many megabytes per batch (a prefill of thousands of tokens, a training
step) therefore keeps mapping and unmapping memory, and every page of a new mapping faults in
again when the next op writes it. Fixing the thresholds (`settle`) trades resident memory for
those faults; each stage that does so names what it measured:

- training (draftsmith.train.loop.MMAP_THRESHOLD), benchmarks/bench_train_heap.py;
- capture with the hf engine (draftsmith.engines.hf.engine.CAPTURE_HEAP), the same benchmark
  (`--stage capture`).

The settings change where memory comes from, never a result (the benchmark checks the bytes
written). Elsewhere than glibc `settle` does nothing. A user's own glibc tunables
(GLIBC_TUNABLES with a malloc setting) win: nothing is changed then.
"""

from __future__ import annotations

import ctypes
import os

M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3


def settle(mmap_threshold: int, trim_threshold: int | None = None, environ=os.environ) -> bool:
    """Fix glibc's mmap threshold (and the trim threshold, where given) for the rest of the
    process; False where nothing was changed (not glibc, or the user set malloc tunables)."""
    if "glibc.malloc." in environ.get("GLIBC_TUNABLES", ""):
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False  # not glibc
    done = bool(mallopt(M_MMAP_THRESHOLD, int(mmap_threshold)))
    if trim_threshold is not None:
        done = bool(mallopt(M_TRIM_THRESHOLD, int(trim_threshold))) and done
    return done
