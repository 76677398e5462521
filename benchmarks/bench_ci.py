"""CI's wall time, step by step, and how many of the machine's cores each step kept busy.

    python benchmarks/bench_ci.py [--rev HEAD] [--cold] [--label NAME]
    python benchmarks/bench_ci.py --log LOG --cpu SAMPLES [--label NAME]

The first form clones this repository at `--rev` into a temporary directory and runs its
`.ci/run` there, as CI does on a clean clone, while sampling the first line of /proc/stat every
5 seconds. Whether the run is cold or warm is decided by the machine: `.ci/run` builds the role
venvs with `python -m draftsmith env venv --cache`, so a machine that has
~/.cache/draftsmith/venvs for the same pin files runs warm: every venv the log names was
"reused", none "built" (the engine venvs' lines are in the clone's .venvs/build.log, appended to
the log here; give a finished run's log with that file appended). `--cold` gives the run an
empty venv cache of its own and no pip cache, as on a fresh machine: every venv is built.

The second form reads a finished run: LOG is what `.ci/run` printed, SAMPLES lines of
`<unix seconds> <first line of /proc/stat>` taken while it ran (the first form writes both).

Steps are `.ci/run`'s `=== [XmYs] name` lines (a background step's start and end lines
included), each timed to the next; busy cores are the machine's, over the step's wall time (a
step that runs beside a background step shares them). Appends a run to
benchmarks/results/ci_<CPU kind>.json (keyed by `--label`) and rewrites the .md beside it.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT)]

from draftsmith.runtime.files import atomic_write_json, atomic_write_text  # noqa: E402
from draftsmith.runtime.hardware import cpu_facts  # noqa: E402

OUT = ROOT / "benchmarks" / "results"
STEP = re.compile(r"^=== (?:.*? at )?\[(\d+)m(\d+)s\]\s*(.*)$")
BG = re.compile(r"^=== (.+?) \(background\) (started|ended) at \[(\d+)m(\d+)s\]")


def sample(path: Path, stop: threading.Event) -> None:
    with open(path, "w") as f:
        while not stop.is_set():
            first = Path("/proc/stat").read_text().split("\n", 1)[0]
            f.write(f"{time.time():.0f} {first}\n")
            f.flush()
            stop.wait(5)


def ci_env(tmp: Path, cold: bool) -> dict:
    """`.ci/run`'s environment: this one without the role interpreters and engine switches a
    developer's shell exports (CI's machine has none), keeping DRAFTSMITH_VENV_CACHE; `cold`: a
    new, empty venv cache and no pip cache, so every role venv is built and downloaded anew."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("DRAFTSMITH_") or k == "DRAFTSMITH_VENV_CACHE"
    }
    if cold:
        env["DRAFTSMITH_VENV_CACHE"] = str(tmp / "venv-cache")
        env["PIP_NO_CACHE_DIR"] = "1"
    return env


def run_ci(rev: str, log: Path, samples: Path, cold: bool = False) -> int:
    """`.ci/run` of a clean clone of `rev`, sampled; its exit code."""
    with tempfile.TemporaryDirectory(prefix="draftsmith-ci-") as tmp:
        clone = Path(tmp) / "repo"
        subprocess.run(["git", "clone", "-q", str(ROOT), str(clone)], check=True)
        subprocess.run(["git", "-C", str(clone), "checkout", "-q", rev], check=True)
        stop = threading.Event()
        sampler = threading.Thread(target=sample, args=(samples, stop), daemon=True)
        sampler.start()
        with open(log, "w") as out:
            rc = subprocess.run(
                [str(clone / ".ci" / "run")],
                stdout=out,
                stderr=subprocess.STDOUT,
                env=ci_env(Path(tmp), cold),
            ).returncode
        stop.set()
        sampler.join()
        build_log = clone / ".venvs" / "build.log"  # the engine venvs' built/reused lines
        with open(log, "a") as out:
            out.write(build_log.read_text() if build_log.exists() else "")
            out.write(f"rc={rc}\n")
    return rc


def read_samples(path: Path) -> list[tuple[float, float, float]]:
    """(unix seconds, busy jiffies, all jiffies) per sample; busy leaves out idle, iowait and
    nice time (processes at a positive nice value: other work run beside CI at nice 19)."""
    rows = []
    for line in path.read_text().splitlines():
        parts = line.split()
        if len(parts) < 9 or parts[1] != "cpu" or not parts[0].isdigit():
            continue
        ticks = [int(x) for x in parts[2:]]
        not_busy = ticks[1] + ticks[3] + ticks[4]  # nice, idle, iowait
        rows.append((float(parts[0]), float(sum(ticks) - not_busy), float(sum(ticks))))
    return rows


def busy_cores(rows, t0: float, start_s: float, end_s: float, cores: int) -> float | None:
    """Mean busy cores of the machine between two offsets from the run's start."""
    inside = [r for r in rows if t0 + start_s <= r[0] <= t0 + end_s]
    if len(inside) < 2:
        return None
    (_, b0, a0), (_, b1, a1) = inside[0], inside[-1]
    return round(cores * (b1 - b0) / (a1 - a0), 2) if a1 > a0 else None


def parse_log(text: str) -> tuple[list[dict], list[dict], int | None, bool]:
    """Foreground steps (name, start s), background steps (name, start s, end s), the exit
    code, and whether the role venvs were reused (warm)."""
    steps, background, rc = [], {}, None
    for line in text.splitlines():
        if m := BG.match(line):
            name, what, mins, secs = m.groups()
            background.setdefault(name, {"step": name})[what] = int(mins) * 60 + int(secs)
        elif m := STEP.match(line):
            steps.append({"step": m.group(3), "start_s": int(m.group(1)) * 60 + int(m.group(2))})
        elif line.startswith("rc="):
            rc = int(line[3:])
    warm = "reused /" in text and "built " not in text
    return steps, list(background.values()), rc, warm


def summarize(log: Path, samples: Path, label: str) -> dict:
    steps, background, rc, warm = parse_log(log.read_text())
    rows = read_samples(samples)
    cores = os.cpu_count() or 1
    t0 = rows[0][0] if rows else 0.0
    total = steps[-1]["start_s"] if steps and steps[-1]["step"] == "done" else None
    for i, s in enumerate(steps):
        end = steps[i + 1]["start_s"] if i + 1 < len(steps) else s["start_s"]
        s["seconds"] = end - s["start_s"]
        s["busy_cores"] = busy_cores(rows, t0, s["start_s"], end, cores)
    for b in background:
        b["seconds"] = b.get("ended", 0) - b.get("started", 0)
    return {
        "label": label,
        "rc": rc,
        "warm": warm,
        "total_s": total,
        "busy_cores_overall": busy_cores(rows, t0, 0, total or 0, cores) if total else None,
        "steps": [s for s in steps if s["step"] != "done"],
        "background": background,
    }


def render(data: dict) -> str:
    m = data["machine"]
    lines = [
        f"# CI wall time by step ({m['cpu_kind']})",
        "",
        f"`.ci/run` on a clean clone, {m['cores']} cores, CPU {m['cpu']} (kind {m['cpu_kind']}). "
        "Written by `benchmarks/bench_ci.py`. Warm: the role venvs came from "
        "~/.cache/draftsmith/venvs (no pip install). Busy cores: the whole machine's mean over "
        "the step (other processes at nice 0 included, niced ones left out); a step beside a "
        "background step shares them.",
    ]
    for run in data["runs"]:
        total = run["total_s"]
        lines += [
            "",
            f"## {run['label']} ({'warm' if run['warm'] else 'cold'}, exit code {run['rc']}, "
            f"total {total} s = {total / 60:.1f} min, mean busy cores "
            f"{run['busy_cores_overall']})"
            if total
            else f"## {run['label']} (did not finish, exit code {run['rc']})",
            "",
            "| step | start s | seconds | busy cores |",
            "|---|---:|---:|---:|",
        ]
        lines += [
            f"| {s['step']} | {s['start_s']} | {s['seconds']} | {s['busy_cores']} |"
            for s in run["steps"]
        ]
        lines += [
            f"| {b['step']} (background) | {b.get('started')} | {b['seconds']} | - |"
            for b in run["background"]
        ]
        if run.get("note"):
            lines += ["", run["note"]]
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rev", default="HEAD")
    ap.add_argument("--log", type=Path)
    ap.add_argument("--cpu", type=Path, help="the samples of a finished run (with --log)")
    ap.add_argument(
        "--cold", action="store_true", help="an empty venv cache and no pip cache (with --rev)"
    )
    ap.add_argument("--label", default="")
    ap.add_argument("--note", default="", help="a sentence printed under the run's table")
    args = ap.parse_args()
    facts = cpu_facts()
    if args.log is None:
        work = Path(tempfile.mkdtemp(prefix="draftsmith-ci-out-"))
        args.log, args.cpu = work / "log.txt", work / "cpu.txt"
        rev = subprocess.run(
            ["git", "-C", str(ROOT), "rev-parse", "--short", args.rev],
            capture_output=True, text=True, check=True,
        ).stdout.strip()  # fmt: skip
        args.label = args.label or rev
        print(f"running .ci/run of {rev}; log {args.log}", flush=True)
        run_ci(rev, args.log, args.cpu, cold=args.cold)
    run = summarize(args.log, args.cpu, args.label or args.log.parent.name)
    run["note"] = args.note
    stem = OUT / f"ci_{facts.kind}"
    path = stem.with_suffix(".json")
    data = json.loads(path.read_text()) if path.exists() else {"runs": []}
    data["machine"] = {"cpu": facts.model, "cpu_kind": facts.kind, "cores": os.cpu_count()}
    data["runs"] = [r for r in data["runs"] if r["label"] != run["label"]] + [run]
    atomic_write_json(path, data)
    atomic_write_text(stem.with_suffix(".md"), render(data))
    print(render(data))


if __name__ == "__main__":
    main()
