"""Training and capture speed and resident memory against glibc's heap thresholds.

A training process fixes glibc's M_MMAP_THRESHOLD (draftsmith.train.loop.MMAP_THRESHOLD):
freed tensors at or above it go back to the system, so the heap does not grow with every new
batch shape, but each new one is a fresh mapping whose pages fault in again. This benchmark
runs the real trainer (`python -m draftsmith train-rank`, the command line of a finished
default run's train job, on its shards, target and vocabulary) for `--steps` steps at each
threshold, in a fresh process per run, the thresholds alternating, and reports from each
run's metrics: seconds per step (the first `--skip` steps not counted), peak RSS, and the
anonymous RSS at the middle and the last step (growth between them is what the threshold is
there to stop). The drafts written must be byte-identical: the threshold moves memory, not
results.

With `--stage capture` it does the same for the run's first capture job (`python -m draftsmith
capture` with the hf engine, draftsmith.engines.hf.engine.CAPTURE_HEAP): glibc's own dynamic
thresholds against the fixed ones given as `mmap:trim` MiB pairs, the capture's own timing
(its log line) per run, and the shards must be byte-identical.

    python benchmarks/bench_train_heap.py [--from-run benchmarks/work/default_run]
        [--steps 120] [--reps 1] [--thresholds 4,16,64]    (MiB)
    python benchmarks/bench_train_heap.py --stage capture [--reps 2] [--thresholds 64:256]

Writes benchmarks/results/train_heap_<cpu kind>.{json,md} (capture_heap_<cpu kind> with
--stage capture).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from draftsmith.runtime.files import atomic_write_json, atomic_write_text  # noqa: E402
from draftsmith.runtime.hardware import cpu_facts  # noqa: E402

OUTPUTS = ("--out", "--metrics", "--offline", "--state")


def train_args(run: Path, steps: int, scratch: Path) -> list[str]:
    """The run's train-rank arguments (first line of logs/train.log), its outputs moved under
    `scratch` and train.max_steps set to `steps`."""
    log = run / "logs" / "train.log"
    try:
        line = log.read_text().splitlines()[0]
    except (OSError, IndexError):
        raise SystemExit(
            f"{log}: no train command; run benchmarks/bench_default.py first"
        ) from None
    words = shlex.split(line.split(" -m draftsmith ", 1)[1])
    cfg = json.loads(words[words.index("--cfg") + 1])
    cfg["train"]["max_steps"] = steps
    words[words.index("--cfg") + 1] = json.dumps(cfg)
    for flag in OUTPUTS:
        i = words.index(flag)
        words[i + 1] = str(scratch / flag.strip("-"))
    return words


def one_run(run: Path, threshold: int, steps: int, skip: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        scratch = Path(tmp)
        args = train_args(run, steps, scratch)
        env = {**os.environ, "PYTHONPATH": str(ROOT), "DRAFTSMITH_OMP": "auto"}
        child = [sys.executable, __file__, "--child", str(threshold), "--", *args]
        done = subprocess.run(child, cwd=run, env=env, capture_output=True, text=True)
        if done.returncode:
            raise SystemExit(f"train-rank at {threshold >> 20} MiB failed:\n{done.stderr[-3000:]}")
        recs = [json.loads(x) for x in (scratch / "metrics").read_text().splitlines()]
        recs = [r for r in recs if "tokens_per_s" in r]
        timed = recs[skip:]
        draft = (scratch / "out" / "model.safetensors").read_bytes()
    secs = sum(r["tokens"] / r["tokens_per_s"] for r in timed)
    return {
        "threshold_mib": threshold >> 20,
        "steps": len(recs),
        "s_per_step": secs / len(timed),
        "peak_rss_mb": max(r["peak_rss_mb"] for r in recs),
        "anon_mid_mb": recs[len(recs) // 2]["rss_anon_mb"],
        "anon_last_mb": recs[-1]["rss_anon_mb"],
        "sha256": hashlib.sha256(draft).hexdigest()[:16],
    }


def child(threshold: int, args: list[str]) -> None:
    import draftsmith.train.loop as loop
    from draftsmith.stages.train import main

    loop.MMAP_THRESHOLD = threshold
    main(args[1:] if args[:1] == ["train-rank"] else args)


def report_of(bench: str, facts, args, load: float, runs: list[dict], **extra) -> dict:
    """The results file's fields: what ran where, every run, whether all wrote the same bytes."""
    return {"bench": bench, "cpu": facts.as_dict(), "kind": facts.kind,
            "run": str(args.from_run), **extra, "load_average": [load, os.getloadavg()[0]],
            "runs": runs, "identical": len({r["sha256"] for r in runs}) == 1}  # fmt: skip


def write(report: dict, lines: list[str]) -> None:
    """benchmarks/results/<bench>_<cpu kind>.{json,md}."""
    out = ROOT / "benchmarks" / "results" / f"{report['bench']}_{report['kind']}"
    atomic_write_json(out.with_suffix(".json"), report)
    atomic_write_text(out.with_suffix(".md"), "\n".join(lines) + "\n")
    print("\n".join(lines))


def capture_args(run: Path, out: Path) -> list[str]:
    """The run's first capture command (snakemake.log), its shard written into directory `out`
    under its own name (the range's)."""
    log = run / "snakemake.log"
    lines = log.read_text().splitlines() if log.exists() else []
    found = [x for x in lines if x.startswith("Shell command: $DRAFTSMITH_PY_CAPTURE ")]
    if not found:
        raise SystemExit(f"{log}: no capture command; run benchmarks/bench_default.py first")
    words = shlex.split(found[0].split(" -m draftsmith ", 1)[1].split(" > logs/", 1)[0])
    at = words.index("--out") + 1
    words[at] = str(out / Path(words[at]).name)
    return words


def capture_child(setting: str, args: list[str]) -> None:
    """Run the capture with `setting` ("glibc": the thresholds left alone, else "mmap:trim")."""
    import draftsmith.engines.hf.engine as hf
    import draftsmith.runtime.heap as heap
    from draftsmith.cli import main as cli

    if setting == "glibc":
        heap.settle = lambda *a, **k: False
    else:
        hf.CAPTURE_HEAP = tuple(int(x) << 20 for x in setting.split(":"))
    cli(args)


def capture_run(run: Path, setting: str) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        args = capture_args(run, Path(tmp))
        out = Path(args[args.index("--out") + 1])
        env = {**os.environ, "PYTHONPATH": str(ROOT), "DRAFTSMITH_OMP": "auto"}
        cmd = [sys.executable, __file__, "--capture-child", setting, "--", *args]
        done = subprocess.run(cmd, cwd=run, env=env, capture_output=True, text=True)
        if done.returncode:
            raise SystemExit(f"capture with {setting} failed:\n{done.stderr[-3000:]}")
        secs = re.findall(r"tokens, ([0-9.]+) s, sha256", done.stderr)
        if not secs:
            raise SystemExit(f"capture with {setting}: no timing line in its log")
        return {
            "setting": setting,
            "capture_s": float(secs[-1]),
            "sha256": hashlib.sha256(out.read_bytes()).hexdigest()[:16],
        }


def capture_main(args, facts) -> None:
    settings = ["glibc", *args.thresholds.split(",")]
    load = os.getloadavg()[0]
    runs = [capture_run(args.from_run, s) for _ in range(args.reps) for s in settings]
    best = {s: min(r["capture_s"] for r in runs if r["setting"] == s) for s in settings}
    report = report_of("capture_heap", facts, args, load, runs)
    lines = [
        "# Capture speed against glibc's heap thresholds",
        "",
        f"CPU {facts.describe()}; the default run's first capture job (`{args.from_run.name}`, "
        f"hf engine), a fresh process per run, settings alternating, best of {args.reps}; "
        f"1-min load average {load:.2f} -> {report['load_average'][1]:.2f}. Time: the capture's "
        "own figure (forward passes and shard writing, without start-up and model load). "
        "Baseline: glibc's dynamic thresholds.",
        "",
        "| mmap:trim threshold MiB | capture s | speed vs baseline |",
        "|---|---:|---:|",
    ]
    for s, secs in best.items():
        lines.append(f"| {s} | {secs:.1f} | {best['glibc'] / secs:.2f}x |")
    same = "byte-identical" if report["identical"] else "NOT identical"
    lines += ["", f"Shards written by all runs: {same}."]
    write(report, lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--from-run", type=Path, default=ROOT / "benchmarks/work/default_run")
    ap.add_argument("--steps", type=int, default=120)
    ap.add_argument("--skip", type=int, default=5, help="first steps not timed")
    ap.add_argument("--reps", type=int, default=1)
    ap.add_argument("--thresholds", default="4,16,64", help="MiB, comma-separated")
    ap.add_argument("--stage", choices=["train", "capture"], default="train")
    ap.add_argument("--child", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--capture-child", help=argparse.SUPPRESS)
    args, rest = ap.parse_known_args()
    rest = rest[1:] if rest[:1] == ["--"] else rest
    if args.child is not None:
        return child(args.child, rest)
    if args.capture_child is not None:
        return capture_child(args.capture_child, rest)
    facts = cpu_facts()
    if args.stage == "capture":
        return capture_main(args, facts)
    sizes = [int(x) << 20 for x in args.thresholds.split(",")]
    load = os.getloadavg()[0]
    runs = [one_run(args.from_run, t, args.steps, args.skip) for _ in range(args.reps)
            for t in sizes]  # fmt: skip
    base = min((r for r in runs if r["threshold_mib"] == sizes[0] >> 20),
               key=lambda r: r["s_per_step"])  # fmt: skip
    best = {}
    for r in runs:
        if (
            r["threshold_mib"] not in best
            or r["s_per_step"] < best[r["threshold_mib"]]["s_per_step"]
        ):
            best[r["threshold_mib"]] = r
    report = report_of("train_heap", facts, args, load, runs, steps=args.steps)
    lines = [
        "# Training speed and memory against glibc's mmap threshold",
        "",
        f"CPU {facts.describe()}; the default run's train job (`{args.from_run.name}`), "
        f"{args.steps} steps per run (the first {args.skip} not timed), a fresh process per "
        f"run, thresholds alternating, best of {args.reps}; 1-min load average {load:.2f} -> "
        f"{report['load_average'][1]:.2f}. Baseline: {sizes[0] >> 20} MiB.",
        "",
        "| threshold MiB | s/step | speed vs baseline | peak RSS MB | anon RSS mid -> last MB |",
        "|---:|---:|---:|---:|---|",
    ]
    for mib, r in best.items():
        lines.append(
            f"| {mib} | {r['s_per_step']:.3f} | {base['s_per_step'] / r['s_per_step']:.2f}x | "
            f"{r['peak_rss_mb']:.0f} | {r['anon_mid_mb']:.0f} -> {r['anon_last_mb']:.0f} |"
        )
    same = "byte-identical" if report["identical"] else "NOT identical"
    lines += ["", f"Drafts written by all runs: {same}."]
    write(report, lines)


if __name__ == "__main__":
    main()
