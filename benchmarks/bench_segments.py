"""Segment mode against offline training on a tiny config: disk bound and re-capture cost.

    python benchmarks/bench_segments.py [--work DIR] [--segment-rows 16] [--epochs 2]

Builds one tiny project (a random 6-layer Llama made here, 64 training rows of the bundled
prompts, ranges of 16 rows) up to its token files, then runs the capture and training stages
twice from that point, each in its own copy:

- offline: `capture.keep` true with the same `train.segment_rows` (every shard captured once,
  kept; the data order by segment);
- segments: `capture.keep` false (capture and training interleaved, shards deleted per
  segment, every epoch captured again).

For each it records the wall time of the run, the seconds of each job (Snakemake's benchmark
files) summed per stage, and the peak of shard bytes on disk, sampled every 20 ms while the run
goes, shards only: results/hidden/ offline, results/segments/epoch*/ (`DiskPeak`; a peak shorter than that could be missed, but a shard lives until its segment
is trained). It checks the two drafts for bit-identical tensors, and states the load of the
machine during each run (draftsmith.runtime.load). Writes benchmarks/results/segments_<CPU kind>.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import threading
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from bench_job_threads import write_result  # noqa: E402
from wf import snakemake, tiny_config, write_config  # noqa: E402

from draftsmith.runtime.hardware import cpu_facts  # noqa: E402
from draftsmith.runtime.load import machine_busy_seconds, own_cpu_seconds  # noqa: E402

TIMEOUT = 7200  # seconds per snakemake run: shared, loaded cores can be 10x slower than idle
STAGES = {"capture": "capture", "segment_capture": "capture", "train": "train"}
STAGES["segment_train"] = "train"


class DiskPeak:
    """Sample, in a thread, the bytes and count of the shard files `pattern` matches under
    `root` (staging files of a shard being written, `.tmp-<name>.safetensors-*`, included)."""

    def __init__(self, root: Path, pattern: str, every: float = 0.02):
        self.root, self.pattern, self.every = root, pattern, every
        self.peak_bytes = self.peak_files = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _sample(self) -> None:
        total = files = 0
        for p in self.root.glob(self.pattern):
            try:
                total += p.stat().st_size
                files += 1
            except FileNotFoundError:  # deleted between listing and stat
                pass
        self.peak_bytes = max(self.peak_bytes, total)
        self.peak_files = max(self.peak_files, files)

    def _run(self) -> None:
        while not self._stop.is_set():
            self._sample()
            self._stop.wait(self.every)

    def __enter__(self) -> DiskPeak:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self._sample()


def draft_tensors(work: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(work / "results" / "draft" / "model.safetensors"))


def same_tensors(a: dict, b: dict) -> bool:
    import torch

    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def losses(work: Path) -> list[float]:
    path = work / "results" / "train" / "metrics.jsonl"
    return [json.loads(ln)["loss"] for ln in path.read_text().splitlines() if ln.strip()]


def bench_config(target: Path, keep: bool, segment_rows: int, epochs: int) -> dict:
    train = {"epochs": epochs, "segment_rows": segment_rows, "precision": "fp32"}
    return tiny_config(
        target,
        data={
            "sources": [{"format": "bundled", "max_rows": 72}],
            "heldout_rows": 8,
            "rows_per_shard": 16,
            "max_length": 128,
        },
        capture={"dtype": "float32", "batch_tokens": 1024, "keep": keep},
        train={"ttt_steps": 2, "batch_tokens": 256, "checkpoint_every": 0, **train},
    )


def default_config(keep: bool, segment_rows: int) -> dict:
    """The embedded default (every other key the schema's) with segment_rows and keep set."""
    return {
        "target": {"source": "embedded"},
        "capture": {"keep": keep},
        "train": {"segment_rows": segment_rows},
    }


def prepare(work: Path, target: Path, segment_rows: int, epochs: int) -> Path:
    """A project with target, rows, token files and vocabulary built (shared by both modes)."""
    base = work / "base"
    write_config(base, bench_config(target, False, segment_rows, epochs))
    targets = ("results/vocab/vocab.safetensors", "results/hidden/plan.json")
    snakemake(base, "--cores", "2", *targets, timeout=TIMEOUT)
    return base


def job_seconds(work: Path) -> dict[str, float]:
    """Seconds of the capture and train jobs of a run, per stage (Snakemake benchmark files)."""
    out: dict[str, float] = {}
    for rule, stage in STAGES.items():
        for tsv in (work / "benchmarks" / "jobs" / rule).glob("*.tsv"):
            s = float(tsv.read_text().splitlines()[1].split("\t")[0])
            out[stage] = out.get(stage, 0.0) + s
    return out


def heldout(work: Path) -> dict | None:
    """The bench report's held-out figures (default mode builds everything, bench included)."""
    path = work / "results" / "bench" / "report.json"
    if not path.is_file():
        return None
    sets = json.loads(path.read_text()).get("sets", {})
    return {k: {"tau": v.get("tau"), "speedup": v.get("speedup")} for k, v in sets.items()}


def own_package(base: Path, directory: str, names: list[str]) -> list[str]:
    """copytree's ignore: the `draftsmith` package at the top of `base`, nothing else."""
    return ["draftsmith"] if Path(directory) == base and "draftsmith" in names else []


def run_mode(base: Path, work: Path, keep: bool, cfg: dict, targets: tuple[str, ...]) -> dict:
    # not a package copy of the base's own (bench_default.py's work directory is a copy of the
    # repository): a job's `python -m draftsmith ...` would import it before this checkout's
    shutil.copytree(base, work, symlinks=True, ignore=lambda d, names: own_package(base, d, names))
    write_config(work, cfg)
    shutil.rmtree(work / "benchmarks" / "jobs", ignore_errors=True)
    busy0, own0, t0 = machine_busy_seconds(), own_cpu_seconds(), time.monotonic()
    where = ("hidden", "*.safetensors*") if keep else ("segments", "epoch*/*.safetensors*")
    with DiskPeak(work / "results" / where[0], where[1]) as disk:
        snakemake(work, "--cores", "2", *targets, timeout=TIMEOUT)
    wall = time.monotonic() - t0
    busy1, own1 = machine_busy_seconds(), own_cpu_seconds()
    other = None if busy0 is None or busy1 is None else busy1 - busy0 - (own1 - own0)
    plan = json.loads((work / "results" / "hidden" / "plan.json").read_text())
    return {
        "mode": "offline" if keep else "segments",
        "wall_s": round(wall, 1),
        "job_s": {k: round(v, 1) for k, v in job_seconds(work).items()},
        "peak_shard_bytes": disk.peak_bytes,
        "peak_shard_files": disk.peak_files,
        "plan": plan.get("segments", {"offline_bytes": plan["total_bytes"]}),
        "other_cpu_s_per_wall_s": None if other is None else round(max(0.0, other) / wall, 2),
        "heldout": heldout(work),
    }


def render(record: dict) -> str:
    off, seg = record["runs"]
    bound = seg["plan"]
    lines = [
        f"# Segment mode against offline training ({record['cpu']['kind']})",
        "",
        f"CPU: {record['cpu']['model']} ({record['cpu']['describe']}), 2 cores. "
        + (
            "The embedded default (SmolLM2-135M-Instruct, every key the schema's), "
            if record.get("project") == "embedded default"
            else "Tiny random 6-layer Llama (hidden 64), fp32 training, "
        )
        + f"{record['rows']} training rows, "
        f"train.segment_rows {record['segment_rows']} ({bound['segments']} segments), "
        f"{record['epochs']} epochs, `hf` capture. Job seconds are Snakemake's "
        "benchmark files summed per stage; other CPU is the other processes' CPU seconds per "
        "wall second during the run (loaded shared cores: compare within a row, not across hosts).",
        "",
        "| mode | wall s | capture jobs s | train jobs s | peak shard bytes on disk | shard files at once | other CPU |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in record["runs"]:
        lines.append(
            f"| {r['mode']} | {r['wall_s']:.1f} | {r['job_s'].get('capture', 0):.1f} | "
            f"{r['job_s'].get('train', 0):.1f} | {r['peak_shard_bytes']} | "
            f"{r['peak_shard_files']} | {r['other_cpu_s_per_wall_s']} |"
        )
    cap_ratio = seg["job_s"]["capture"] / off["job_s"]["capture"]
    lines += [
        "",
        f"- Peak shard bytes, segments / offline: {seg['peak_shard_bytes']} / "
        f"{off['peak_shard_bytes']} = {seg['peak_shard_bytes'] / off['peak_shard_bytes']:.2f} "
        f"(the plan's bound: {bound['peak_bytes']} of {bound['offline_bytes']} B, two of "
        f"{bound['segments']} segments).",
        f"- Capture seconds, segments / offline: {cap_ratio:.2f}x ({record['epochs']} epochs "
        "capture every row again each epoch; one capture job per range and epoch).",
        f"- Wall time, segments / offline: {seg['wall_s'] / off['wall_s']:.2f}x.",
        f"- Drafts bit-identical: {record['bit_identical']}; training losses equal: "
        f"{record['losses_equal']}.",
    ]
    for r in record["runs"]:
        if r.get("heldout"):
            figures = ", ".join(
                f"{k} tau {v['tau']:.4f} speedup {v['speedup']:.2f}x"
                for k, v in r["heldout"].items()
            )
            lines.append(f"- Held-out bench, {r['mode']}: {figures}.")
    return "\n".join(lines) + "\n"


def tiny_runs(args) -> tuple[Path, list[dict]]:
    """The tiny project: a shared base up to the token files, then both modes from it."""
    from draftsmith.targets.tinymodel import make_tiny_target

    target = args.work / "model"  # kept between invocations: the base resumes where it stopped
    if not (target / "config.json").is_file():
        make_tiny_target(target)
    base = prepare(args.work, target, args.segment_rows, args.epochs)
    runs = [
        run_mode(
            base,
            args.work / mode,
            keep,
            bench_config(target, keep, args.segment_rows, args.epochs),
            ("results/draft",),
        )
        for mode, keep in (("offline", True), ("segments", False))
    ]
    return base, runs


def default_runs(args) -> tuple[Path, list[dict]]:
    """The embedded default from a finished build (benchmarks/bench_default.py's work
    directory): offline re-trains its kept shards in segment order (capture seconds: the
    build's own capture jobs), segment mode captures every segment again each epoch. Both
    build everything, the held-out bench included."""
    base = args.default
    capture_s = job_seconds(base).get("capture", 0.0)
    shards = list((base / "results" / "hidden").glob("*.safetensors"))
    runs = []
    for mode, keep in (("offline", True), ("segments", False)):
        run = run_mode(base, args.work / mode, keep, default_config(keep, args.segment_rows), ())
        if keep:
            run["job_s"]["capture"] = round(capture_s, 1)
            run["peak_shard_bytes"] = sum(p.stat().st_size for p in shards)
            run["peak_shard_files"] = len(shards)
        runs.append(run)
    return base, runs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--work", type=Path, default=ROOT / "benchmarks" / "work" / "segments")
    ap.add_argument("--segment-rows", type=int, default=16)
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--default", type=Path, help="a finished build of the embedded default")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    args = ap.parse_args()
    for mode in ("offline", "segments"):  # the two runs start from the shared base each time
        shutil.rmtree(args.work / mode, ignore_errors=True)
    if args.default:  # the run's own epochs: the schema's default
        schema = yaml.safe_load((ROOT / "draftsmith" / "config" / "config.schema.yaml").read_text())
        args.epochs = schema["properties"]["train"]["properties"]["epochs"]["default"]
    base, runs = default_runs(args) if args.default else tiny_runs(args)
    f = cpu_facts()
    record = {
        "cpu": {**f.as_dict(), "describe": f.describe()},
        "project": "embedded default" if args.default else "tiny",
        "rows": json.loads((base / "results" / "hidden" / "plan.json").read_text())["rows"],
        "segment_rows": args.segment_rows,
        "epochs": args.epochs,
        "runs": runs,
        "bit_identical": same_tensors(
            draft_tensors(args.work / "offline"), draft_tensors(args.work / "segments")
        ),
        "losses_equal": losses(args.work / "offline") == losses(args.work / "segments"),
    }
    name = f"segments{'_default' if args.default else ''}_{record['cpu']['kind']}"
    write_result(name, record, render, args.out)


if __name__ == "__main__":
    main()
