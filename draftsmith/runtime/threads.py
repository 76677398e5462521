"""CPU threads and OpenMP waiting: a policy that holds whatever load comes and goes during a job.

torch on Linux runs its CPU ops on libgomp's thread pool. Between the many small parallel
regions of a decode step or a training step, a libgomp thread that has finished its share waits
for the next region. How it waits is read from the environment once, when torch loads libgomp,
and holds for the whole process:

- spinning (libgomp's default with no wait policy: up to 300000 iterations of a pause loop,
  then sleep) is the fastest on free cores, since the next region starts without a wake-up;
- sleeping at once (OMP_WAIT_POLICY=PASSIVE) costs a wake-up per region on free cores, but on
  cores shared with other processes it is what keeps a job near its fair share: a region ends
  only when its last thread does, that thread loses its core for a time slice whenever another
  process runs, and threads spinning meanwhile take the very cycles it waits for;
- a bounded spin (GOMP_SPINCOUNT=`SPINCOUNT`) sits between them: a wait for the next region
  of the same step, which comes soon, ends while still spinning, as with the default; a wait
  that outlasts the bound (its region's last thread lost its core) sleeps and gives its own core
  back. The count trades speed on free cores against the share of the cores kept when load
  arrives, which benchmarks/bench_contention.py measures (`SPINCOUNT`).

Since libgomp reads its settings only at start, a job cannot switch when load arrives later; it
takes, at start, the setting that holds either way. `prepare()` runs when the package is first
imported by a job (DRAFTSMITH_OMP=auto, which the workflow's shell prefix exports), before torch
is imported: it measures for `PROBE_S` seconds how many cores other processes keep busy
(draftsmith.runtime.load) and

- on free cores (other work leaves at least the job's threads free, within TOLERANCE; the
  threads are OMP_NUM_THREADS, which Snakemake sets to the rule's), or where the load cannot be
  measured, sets GOMP_SPINCOUNT to `SPINCOUNT` (DRAFTSMITH_SPINCOUNT, a whole number, replaces
  it): load that arrives later meets threads that give their cores back;
- on busy cores sets OMP_WAIT_POLICY=PASSIVE.

The thread count is never changed, because it changes results: CPU kernels split their
reductions by thread, so the rounding, and through a training run the whole draft, differs
between 1 and 2 threads. The wait policy changes speed only, so a build gives the same bits on
one machine whatever else runs beside it. `benchmarks/bench_contention.py` measures the policies
at load 0, with load arriving mid-job and beside busy processes
(benchmarks/results/contention_<cpu kind>.md).

A user's own OMP_WAIT_POLICY or GOMP_SPINCOUNT always wins (nothing is probed). The decision is
kept in DRAFTSMITH_OMP_DECISION (children such as torchrun ranks inherit it) and logged by
`set_threads` (draftsmith.runtime.files).
"""

from __future__ import annotations

import json
import os
import sys
import time

from draftsmith.runtime.load import TOLERANCE, machine_busy_seconds, own_cpu_seconds

ENV = "DRAFTSMITH_OMP"  # "auto": probe and choose; anything else: leave libgomp alone
DECISION = "DRAFTSMITH_OMP_DECISION"  # JSON of what prepare() chose (read by set_threads)
SPIN_ENV = "DRAFTSMITH_SPINCOUNT"  # replaces SPINCOUNT (a whole number of spin iterations)
PROBE_S = 0.3
# GOMP_SPINCOUNT on free cores (libgomp's default: 300000; PASSIVE: 0). 1000, by measurement
# (benchmarks/results/contention_<kind>.md): at load 0 it keeps 0.93 (decoding) and 1.00
# (training) of the default's speed, where sleeping at once keeps 0.72 and 0.84; when two busy
# processes arrive mid-job it keeps 0.78 and 0.58 of the fair share, where the default keeps
# 0.20 and 0.30 and bounds of 10000 or more about 0.5.
SPINCOUNT = 1000
USER_KEYS = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")  # OMP_NUM_THREADS: Snakemake sets it


def other_cores(seconds: float = PROBE_S) -> float | None:
    """Average cores other processes kept busy over `seconds` (None without /proc/stat)."""
    busy0, own0, t0 = machine_busy_seconds(), own_cpu_seconds(), time.perf_counter()
    if busy0 is None:
        return None
    time.sleep(seconds)
    busy1, own1 = machine_busy_seconds(), own_cpu_seconds()
    return max(0.0, (busy1 - busy0) - (own1 - own0)) / (time.perf_counter() - t0)


def spincount(environ=os.environ) -> int:
    """The bounded spin count: DRAFTSMITH_SPINCOUNT where set, else SPINCOUNT."""
    text = environ.get(SPIN_ENV, "").strip()
    if not text:
        return SPINCOUNT
    if not text.isdigit():
        raise ValueError(f"{SPIN_ENV}={text!r}: expected a whole number of spin iterations")
    return int(text)


def choose(cpus: int, others: float | None, threads: int, spins: int = SPINCOUNT) -> dict:
    """The policy for a job of `threads` threads on `cpus` cores with `others` cores of other
    work (pure): a bounded spin of `spins` iterations, or passive waiting. Other work on cores
    the job does not use (other jobs of a wide machine) is no contention."""
    threads = max(1, min(threads, cpus))
    if others is None:
        return {"policy": "spin", "spincount": spins, "others": None, "why": "load not measurable"}
    free = cpus - others
    if free >= threads - TOLERANCE:
        why = f"{free:.2f} of {cpus} cores free for {threads} threads"
        return {"policy": "spin", "spincount": spins, "others": round(others, 2), "why": why}
    return {
        "policy": "passive",
        "spincount": 0,
        "others": round(others, 2),
        "why": f"{others:.2f} of {cpus} cores busy with other work",
    }


def settings(decision: dict) -> dict[str, str]:
    """The libgomp environment of a decision."""
    if decision["policy"] == "passive":
        return {"OMP_WAIT_POLICY": "PASSIVE"}
    return {"GOMP_SPINCOUNT": str(decision["spincount"])}


def prepare(environ=os.environ) -> dict | None:
    """Called once per process before torch is imported (draftsmith/__init__.py)."""
    if environ.get(ENV) != "auto" or any(k in environ for k in USER_KEYS):
        return None
    if "torch" in sys.modules:  # too late: libgomp has read its environment
        return None
    spins = spincount(environ)
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    cpus = cpus or 1
    threads = int(environ.get("OMP_NUM_THREADS") or cpus)  # Snakemake sets the job's threads
    decision = choose(cpus, other_cores(), threads, spins)
    environ.update(settings(decision))
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
        spins = d.get("spincount")
        return f"OpenMP spin {spins} then sleep (GOMP_SPINCOUNT), thread count kept: {d['why']}"
    return f"OpenMP PASSIVE, thread count kept: {d['why']}"
