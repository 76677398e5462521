"""CPU threads and OpenMP waiting, chosen for the load a job starts under.

torch on Linux runs its CPU ops on libgomp's thread pool. Between the many small parallel
regions of a decode step or a training step, libgomp's threads spin (about 300k iterations)
before they sleep. On free cores that is the fastest choice: greedy decoding ran 1.7x faster
spinning than with OMP_WAIT_POLICY=PASSIVE. On cores shared with other work it is the slowest by
far: a region ends only when its last thread does, that thread is descheduled for a time slice
whenever another process runs, and the others spin meanwhile, stealing the very cycles it waits
for. With two busy processes beside a 2-thread job on 2 cores, spinning decoding fell to
0.05-0.29 of its free-core speed and ran 4-7x slower than one passive thread
(benchmarks/results/contention_*.md).

So a job looks before it leaps. `prepare()` runs when the package is first imported by a job
(DRAFTSMITH_OMP=auto, which the workflow's shell prefix exports), before torch is imported and
libgomp reads its environment: it measures for `PROBE_S` seconds how many cores other processes
keep busy (draftsmith.runtime.load) and

- on free cores (other work leaves at least the job's threads free, within TOLERANCE; the
  threads are OMP_NUM_THREADS, which Snakemake sets to the rule's) leaves libgomp's spinning
  default alone;
- on busy cores sets OMP_WAIT_POLICY=PASSIVE and keeps the job's thread count.

The thread count is never changed, because it changes results: CPU kernels split their
reductions by thread, so the rounding, and through 370 training steps the default's whole
draft, differs between 1 and 2 threads (weights up to 0.1 apart, measured on AVX512-AMX when
this module still capped the threads under load). The wait policy alone changes speed only, and
it is most of the win: beside two busy processes a 2-thread decode ran at 4.7 tokens/s passive
against 0.9 spinning, and 6.3 at one passive thread (benchmarks/results/contention_*.md). So a
build gives the same bits on one machine whatever else runs beside it.

A user's own OMP_WAIT_POLICY or GOMP_SPINCOUNT always wins (nothing is probed). The decision is
logged by `set_threads` (draftsmith.runtime.files).
"""

from __future__ import annotations

import json
import os
import sys
import time

from draftsmith.runtime.load import TOLERANCE, machine_busy_seconds, own_cpu_seconds

ENV = "DRAFTSMITH_OMP"  # "auto": probe and choose; anything else: leave libgomp alone
DECISION = "DRAFTSMITH_OMP_DECISION"  # JSON of what prepare() chose (read by set_threads)
PROBE_S = 0.3
USER_KEYS = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")  # OMP_NUM_THREADS: Snakemake sets it


def other_cores(seconds: float = PROBE_S) -> float | None:
    """Average cores other processes kept busy over `seconds` (None without /proc/stat)."""
    busy0, own0, t0 = machine_busy_seconds(), own_cpu_seconds(), time.perf_counter()
    if busy0 is None:
        return None
    time.sleep(seconds)
    busy1, own1 = machine_busy_seconds(), own_cpu_seconds()
    return max(0.0, (busy1 - busy0) - (own1 - own0)) / (time.perf_counter() - t0)


def choose(cpus: int, others: float | None, threads: int) -> dict:
    """The policy for a job of `threads` threads on `cpus` cores with `others` cores of other
    work (pure). Other work on cores the job does not use (other jobs of a wide machine) is
    no contention."""
    threads = max(1, min(threads, cpus))
    if others is None:
        return {"policy": "spin", "others": None, "why": "load not measurable"}
    free = cpus - others
    if free >= threads - TOLERANCE:
        why = f"{free:.2f} of {cpus} cores free for {threads} threads"
        return {"policy": "spin", "others": round(others, 2), "why": why}
    return {
        "policy": "passive",
        "others": round(others, 2),
        "why": f"{others:.2f} of {cpus} cores busy with other work",
    }


def prepare(environ=os.environ) -> dict | None:
    """Called once per process before torch is imported (draftsmith/__init__.py)."""
    if environ.get(ENV) != "auto" or any(k in environ for k in USER_KEYS):
        return None
    if "torch" in sys.modules:  # too late: libgomp has read its environment
        return None
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    cpus = cpus or 1
    threads = int(environ.get("OMP_NUM_THREADS") or cpus)  # Snakemake sets the job's threads
    decision = choose(cpus, other_cores(), threads)
    if decision["policy"] == "passive":
        environ["OMP_WAIT_POLICY"] = "PASSIVE"
    environ[DECISION] = json.dumps(decision)
    environ.pop(ENV, None)  # children (torchrun ranks, a server) inherit this decision
    return decision


def policy_note(environ=os.environ) -> str:
    """What prepare() decided, for set_threads's log line ("" when nothing was probed)."""
    text = environ.get(DECISION)
    if not text:
        return ""
    d = json.loads(text)
    if d["policy"] == "spin":
        return f"OpenMP spinning (libgomp default): {d['why']}"
    return f"OpenMP PASSIVE, thread count kept: {d['why']}"
