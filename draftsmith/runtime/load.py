"""How much other work shared the CPU while a figure was measured.

A speedup is a ratio of two timings; it means something only when both sides ran under the same
conditions. On a laptop, a CI runner or a login node other processes come and go, and a greedy
run timed while a compiler ran beside it makes any speculative run look fast. `LoadMeter` times
named phases and, for each, how many cores other processes kept busy on average:

    other work = (busy CPU time of the whole machine, /proc/stat)
               - (CPU time of this process and its descendants, e.g. a server it started)

divided by the phase's wall time. `verdict` compares the phases of a ratio: when the other work
differs by more than `TOLERANCE` cores, or exceeds the machine's spare cores, the figure is not
called a speedup. Where /proc is missing (not Linux), nothing is measured and the verdict says so.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

TOLERANCE = 0.25  # cores of other work by which two phases of one ratio may differ
_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def machine_busy_seconds() -> float | None:
    """CPU seconds all cores spent not idle since boot (user, nice, system, irq, softirq,
    steal); None where /proc/stat is absent."""
    try:
        first = Path("/proc/stat").read_text().split("\n", 1)[0].split()
    except OSError:
        return None
    user, nice, system, _idle, _iowait, irq, softirq, steal = (int(x) for x in first[1:9])
    return (user + nice + system + irq + softirq + steal) / _TICK


def tree_cpu_seconds(root: int) -> float | None:
    """CPU seconds of process `root` and its descendants, read from /proc (None where /proc is
    absent): a job's whole process tree, e.g. its worker processes. A descendant that ended and
    was waited for still counts, in its parent's children's times (cutime, cstime), so a worker
    ending between two reads does not take its seconds out of the tree."""
    parents: dict[int, int] = {}
    seconds: dict[int, float] = {}
    try:
        entries = [e for e in os.listdir("/proc") if e.isdigit()]
    except OSError:
        return None
    for entry in entries:
        try:
            text = Path(f"/proc/{entry}/stat").read_text()
        except OSError:  # ended meanwhile
            continue
        fields = text.rsplit(")", 1)[1].split()  # after the command name, which may hold spaces
        parents[int(entry)] = int(fields[1])
        seconds[int(entry)] = sum(int(f) for f in fields[11:15]) / _TICK  # own + waited children
    if root not in seconds:
        return None
    children: dict[int, list[int]] = {}
    for pid, ppid in parents.items():
        children.setdefault(ppid, []).append(pid)
    total, todo = 0.0, [root]
    while todo:
        pid = todo.pop()
        total += seconds.get(pid, 0.0)
        todo.extend(children.get(pid, []))
    return total


def own_cpu_seconds() -> float:
    """CPU seconds of this process (all threads) and of its live descendants."""
    t = os.times()
    total = t.user + t.system + t.children_user + t.children_system
    try:
        import psutil
    except ImportError:
        return total
    try:
        for child in psutil.Process().children(recursive=True):
            try:
                c = child.cpu_times()
                total += c.user + c.system
            except psutil.Error:
                pass
    except psutil.Error:
        pass
    return total


class LoadMeter:
    """Accumulates, per phase name, wall seconds and other processes' CPU seconds. `job`: the
    pid whose process tree counts as this job's own (a worker process passes its parent's, so
    that its sibling workers are not other work); by default this process and its children."""

    def __init__(self, job: int | None = None) -> None:
        self.wall: dict[str, float] = {}
        self.others: dict[str, float] = {}
        self.measured = machine_busy_seconds() is not None
        self.loadavg_start = _loadavg()
        self.job = job

    def _own(self) -> float:
        if self.job is not None:
            tree = tree_cpu_seconds(self.job)
            if tree is not None:
                return tree
        return own_cpu_seconds()

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        busy0, own0, t0 = machine_busy_seconds(), self._own(), time.perf_counter()
        try:
            yield
        finally:
            wall = time.perf_counter() - t0
            busy1, own1 = machine_busy_seconds(), self._own()
            self.wall[name] = self.wall.get(name, 0.0) + wall
            if busy0 is not None and busy1 is not None:
                # /proc/stat counts in clock ticks and is read a moment apart from our own
                # times: over a short phase on saturated cores the difference can pass the
                # machine's cores, which no other work can use more of
                cap = (os.cpu_count() or 1) * wall
                other = min(cap, max(0.0, (busy1 - busy0) - (own1 - own0)))
                self.others[name] = self.others.get(name, 0.0) + other

    def state(self) -> dict:
        """What `absorb` adds up (a worker process sends it to its parent)."""
        return {"wall": dict(self.wall), "others": dict(self.others), "measured": self.measured}

    def absorb(self, state: dict) -> None:
        """Add another meter's phases (its `state()`) to this one's."""
        for name, wall in state["wall"].items():
            self.wall[name] = self.wall.get(name, 0.0) + wall
        for name, other in state["others"].items():
            self.others[name] = self.others.get(name, 0.0) + other
        self.measured = self.measured and state["measured"]

    def cores(self) -> dict[str, float]:
        """Average cores of other work per phase."""
        return {n: self.others.get(n, 0.0) / w for n, w in self.wall.items() if w > 0}

    def summary(self) -> dict:
        return {
            "measured": self.measured,
            "cpus": os.cpu_count(),
            "other_work_cores": {n: round(c, 3) for n, c in self.cores().items()},
            "loadavg_start": self.loadavg_start,
            "loadavg_end": _loadavg(),
        }


def verdict(summary: dict, a: str, b: str, threads: int) -> dict:
    """Whether the ratio of phases `a` and `b` may be called a speedup, and why (for reports)."""
    cores = summary.get("other_work_cores", {})
    if not summary.get("measured") or a not in cores or b not in cores:
        return {"comparable": None, "why": "other work not measured on this system"}
    ca, cb = cores[a], cores[b]
    spare = max(0.0, (summary.get("cpus") or threads) - threads)
    text = f"other work {ca:.2f} cores during {a}, {cb:.2f} during {b} ({threads} threads used)"
    if abs(ca - cb) > TOLERANCE:
        return {"comparable": False, "why": f"the load changed: {text}"}
    if max(ca, cb) > spare + TOLERANCE:
        return {"comparable": True, "loaded": True, "why": f"measured on busy cores: {text}"}
    return {"comparable": True, "loaded": False, "why": text}


def _loadavg() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None
