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
keep busy (draftsmith.load) and

- on free cores (other work leaves at least the job's threads free, within TOLERANCE; the
  threads are OMP_NUM_THREADS, which Snakemake sets to the rule's) leaves libgomp's spinning
  default alone;
- on busy cores sets OMP_WAIT_POLICY=PASSIVE and caps the job's threads at the cores left free
  (at least 1): `set_threads` (draftsmith.common) applies the cap.

A user's own OMP_WAIT_POLICY or GOMP_SPINCOUNT always wins (nothing is probed).
The decision is logged by `set_threads` and changes no result: thread counts and wait policies
change speed, not what is computed (the hf engine's kernels are deterministic per thread count
on CPU up to float rounding, which the tests' tolerances already cover; shards and drafts are
compared across runs on the same thread count).
"""

from __future__ import annotations

import json
import os
import sys
import time

from draftsmith.load import TOLERANCE, machine_busy_seconds, own_cpu_seconds

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
        return {"policy": "spin", "cap": 0, "others": None, "why": "load not measurable"}
    free = cpus - others
    if free >= threads - TOLERANCE:
        why = f"{free:.2f} of {cpus} cores free for {threads} threads"
        return {"policy": "spin", "cap": 0, "others": round(others, 2), "why": why}
    cap = max(1, min(threads, int(free + 0.5)))
    return {
        "policy": "passive",
        "cap": cap,
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
        environ["OMP_NUM_THREADS"] = str(decision["cap"])
    environ[DECISION] = json.dumps(decision)
    environ.pop(ENV, None)  # children (torchrun ranks, a server) inherit this decision
    return decision


def thread_cap(environ=os.environ) -> tuple[int, str]:
    """(cap or 0, what was decided) for set_threads."""
    text = environ.get(DECISION)
    if not text:
        return 0, ""
    d = json.loads(text)
    if d["policy"] == "spin":
        return 0, f"OpenMP spinning (libgomp default): {d['why']}"
    return int(d["cap"]), f"OpenMP PASSIVE, threads capped at {d['cap']}: {d['why']}"
