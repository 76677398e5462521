"""Range jobs on a small CPU: two-thread jobs one after another, or one-thread jobs side by side.

On a 2-core CPU the workflow can run a range's regenerate or capture job with both cores, one
job at a time, or two range jobs at once with one core each. This benchmark runs the real jobs
of a finished default run (`--from-run`): it takes their shell commands from `snakemake -n -p`
in that run, points their outputs to a scratch folder, and for each stage runs the first two
ranges (a) one after another with `--threads 2` and (b) side by side with `--threads 1` each,
each job a fresh process with the workflow's environment (DRAFTSMITH_OMP=auto,
OMP_NUM_THREADS), today's package. `--reps` rounds, the order of (a) and (b) swapped every
other round, the best wall time of each kept. Reports both wall times, the speed of (b) against
(a), and whether the outputs of (b) equal those of (a) byte for byte (the thread count may
change rounding).

    python benchmarks/bench_job_threads.py [--from-run benchmarks/work/default_run] [--reps 1]

Writes benchmarks/results/job_threads_<cpu kind>.{json,md} (`--name` replaces the stem).
"""

from __future__ import annotations

import argparse
import os
import platform
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from draftsmith.runtime.files import atomic_write_json, atomic_write_text  # noqa: E402
from draftsmith.runtime.hardware import cpu_facts  # noqa: E402

STAGES = {"regenerate": ("--out", "--report"), "capture": ("--out",)}


def job_commands(run: Path, stages=tuple(STAGES), keep: int = 2) -> dict[str, list[str]]:
    """{stage: [shell command of each of the first `keep` jobs, in range order]} from
    `snakemake -n -p` (each from `-m draftsmith` on, its log redirection cut)."""
    out = subprocess.run(
        ["snakemake", "-n", "-p", "--cores", "2", "--forcerun", *stages],
        cwd=run, capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    found: dict[str, list[str]] = {stage: [] for stage in stages}
    for line in out.splitlines():
        m = re.search(rf"-m draftsmith ({'|'.join(stages)}) .*", line)
        if m:
            found[m.group(1)].append(m.group(0).split(" > ")[0])
    return {stage: sorted(cmds)[:keep] for stage, cmds in found.items()}


def retarget(cmd: str, outputs: tuple[str, ...], threads: int, scratch: Path) -> list[str]:
    """The job's argv with this interpreter, `threads` and its `outputs` (the options that name
    them) under `scratch`."""
    argv = shlex.split(cmd)
    for i, arg in enumerate(argv[:-1]):
        if arg in outputs:
            argv[i + 1] = str(scratch / Path(argv[i + 1]).name)
        if arg == "--threads":
            argv[i + 1] = str(threads)
    return [sys.executable, "-P", *argv]  # -P: today's package, not the run's copy in its cwd


def run_jobs(run: Path, argvs: list[list[str]], threads: int, together: bool, logs: Path):
    """Wall seconds of the jobs, all at once or one after another; each job's output goes to
    logs/job<i>.log, as a workflow job's goes to its log."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "DRAFTSMITH_OMP": "auto",
           "OMP_NUM_THREADS": str(threads)}  # fmt: skip
    paths = [logs / f"job{i}.log" for i in range(len(argvs))]
    t0 = time.perf_counter()
    procs = []
    for argv, path in zip(argvs, paths, strict=True):
        with open(path, "w") as out:
            procs.append(subprocess.Popen(argv, cwd=run, env=env, stdout=out,
                                          stderr=subprocess.STDOUT))  # fmt: skip
        if not together:
            procs[-1].wait()
    codes = [p.wait() for p in procs]
    if any(codes):
        raise SystemExit(f"a job failed ({codes}); see {', '.join(map(str, paths))}")
    return time.perf_counter() - t0


def same_outputs(a: Path, b: Path) -> str:
    names = sorted(p.name for p in a.iterdir() if p.suffix in (".jsonl", ".safetensors"))
    same = sum((a / n).read_bytes() == (b / n).read_bytes() for n in names)
    return f"{same}/{len(names)}"


def measure(run: Path, reps: int) -> list[dict]:
    table = []
    for stage, cmds in job_commands(run).items():
        best = {"apart": float("inf"), "together": float("inf")}
        with tempfile.TemporaryDirectory() as tmp:
            dirs = {k: Path(tmp) / k for k in best}
            for d in dirs.values():
                d.mkdir()
            modes = list(best)
            for rep in range(reps):
                for mode in modes if rep % 2 == 0 else modes[::-1]:
                    threads, together = (2, False) if mode == "apart" else (1, True)
                    argvs = [retarget(c, STAGES[stage], threads, dirs[mode]) for c in cmds]
                    seconds = run_jobs(run, argvs, threads, together, dirs[mode])
                    print(f"{stage} {mode}: {seconds:.1f} s", flush=True)
                    best[mode] = min(best[mode], seconds)
            same = same_outputs(dirs["apart"], dirs["together"])
        table.append({"stage": stage, "jobs": len(cmds),
                      "apart_s": round(best["apart"], 1), "together_s": round(best["together"], 1),
                      "speed": round(best["apart"] / best["together"], 3), "identical": same})  # fmt: skip
    return table


def render(result: dict) -> str:
    lines = [
        "# Range jobs: two threads one after another, or one thread side by side",
        "",
        f"CPU {result['cpu']}, {result['cores']} cores; the regenerate and capture jobs of the "
        f"first two ranges of a finished default run, each a fresh process; best of "
        f"{result['reps']} round(s); 1-min load average {result['load_before']:.2f} -> "
        f"{result['load_after']:.2f}. apart: `--threads 2`, one job after the other; together: "
        "`--threads 1`, both jobs at once.",
        "",
        "| stage | jobs | apart s | together s | speed | identical outputs |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for r in result["table"]:
        lines.append(f"| {r['stage']} | {r['jobs']} | {r['apart_s']:.1f} | "
                     f"{r['together_s']:.1f} | {r['speed']:.2f}x | {r['identical']} |")  # fmt: skip
    return "\n".join(lines) + "\n"


def from_run_main(doc: str, measure, render, stem: str, key: str) -> None:
    """The command line of a benchmark of a finished run's jobs (`--from-run`, `--reps`,
    `--name`): `measure(run, reps)` goes under `key` of the result, which is written to
    benchmarks/results/<stem>_<cpu kind>.{json,md} (`render` makes the markdown)."""
    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument("--from-run", type=Path, default=ROOT / "benchmarks/work/default_run")
    ap.add_argument("--reps", type=int, default=1)
    ap.add_argument("--name", default="")
    args = ap.parse_args()
    facts = cpu_facts()
    load_before = os.getloadavg()[0]
    measured = measure(args.from_run.resolve(), args.reps)
    result = {"cpu": facts.describe(), "kind": facts.kind, "cores": os.cpu_count(),
              "reps": args.reps, "load_before": load_before,
              "load_after": os.getloadavg()[0], key: measured}  # fmt: skip
    write_result(args.name or f"{stem}_{facts.kind}", result, render)


def drop_cache(paths) -> None:
    """Evict the files from the page cache (a cold read next)."""
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def copy_tracked(repo: Path, workdir: Path) -> int:
    """Copy the files `git ls-files` lists (working-tree contents) into an empty workdir."""
    if workdir.exists() and any(workdir.iterdir()):
        raise SystemExit(f"{workdir}: not empty; a fresh run needs an empty work directory")
    out = subprocess.run(
        ["git", "-C", str(repo), "ls-files", "-z"], capture_output=True, check=True
    ).stdout
    files = [f for f in out.decode().split("\0") if f and os.path.lexists(repo / f)]
    for rel in files:
        dest = workdir / rel
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(repo / rel, dest, follow_symlinks=False)
    return len(files)


def git_info(repo: Path) -> dict:
    """The commit the run's files came from, and whether tracked files differed from it (the
    results files benchmarks write are not the run's files)."""
    git = ["git", "-C", str(repo)]
    commit = subprocess.run([*git, "rev-parse", "HEAD"], capture_output=True, text=True)
    dirty = subprocess.run(
        [*git, "status", "--porcelain", "-uno", "--", ".", ":(exclude)benchmarks/results"],
        capture_output=True, text=True,
    )  # fmt: skip
    return {"git_commit": commit.stdout.strip(), "git_dirty": bool(dirty.stdout.strip())}


def machine(git: dict) -> dict:
    import torch

    info = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    names = [ln.split(":", 1)[1].strip() for ln in info.splitlines() if ln.startswith("model name")]
    cpu = names[0] if names else platform.processor() or platform.machine()
    facts = cpu_facts().as_dict()
    return {
        "cpu": cpu,
        "cpu_facts": facts,
        "cores": len(os.sched_getaffinity(0)),
        "torch": torch.__version__,
        **git,
    }


def fmt(v, spec: str = ".3f") -> str:
    return "n/a" if v is None else format(v, spec)


def table(header: str, rows: list[str]) -> list[str]:
    return [f"| {header} |", "|---" * (header.count("|") + 1) + "|", *(f"| {r} |" for r in rows)]


def write_result(name: str, result: dict, render, out: Path | None = None) -> None:
    """<out>/<name>.json and .md (`render(result)`, also printed); out: benchmarks/results."""
    out = ROOT / "benchmarks/results" if out is None else out
    atomic_write_json(out / f"{name}.json", result)
    atomic_write_text(out / f"{name}.md", render(result))
    print(render(result))


if __name__ == "__main__":
    from_run_main(__doc__, measure, render, "job_threads", "table")
