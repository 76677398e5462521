"""Offline regenerate and capture through SGLang: one server per range job against one per stage.

    DRAFTSMITH_PYTHON_SGLANG_CPU=... python benchmarks/bench_shared_stages.py [--rows 64]

Builds the tiny Kimi-K2.5-shaped checkpoint of the CI workflow (tests/test_workflow_kimi_sglang:
`round_trip_target`, a 5-layer DeepSeek-V3 text model wrapped as Kimi-K2.5, tiktoken tokenizer)
and one project on it (that test's `config()`: regenerate and capture on the patched SGLang CPU
server, role sglang-cpu), with `--rows` bundled prompt rows in `--ranges` row ranges. The
project is prepared once up to what both modes share (the target stage, the env stamps, the
patched SGLang, the data report), then copied (mtimes kept) and run to `hidden` (every shard)
twice, one after the other in this one benchmark run, `--cores 2`:

- job: `sglang.shared_server: job`, a server launched by every regenerate and capture job;
- run: `sglang.shared_server: run` (what `auto` gives), one server per stage for its range
  jobs (draftsmith.engines.sharedserver).

Per stage it records the server launches and the start-up seconds of each (the range reports'
and the capture manifests' server records), the jobs' seconds summed and the stage's span (first
job start to last job end: Snakemake's benchmark files, whose mtime is the job's end); per run
the wall time, the 1-min load average at start and end, and the server processes (and shared
server hosts) left 30 s after the run. Checks that both runs regenerated the same rows and
captured the same shards (token ids exact; states bit-identical, or the largest difference).
Writes benchmarks/results/shared_stages_<CPU kind>.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests"), str(ROOT / "benchmarks")]

from bench_job_threads import write_result  # noqa: E402
from bench_shared_capture import rerender, sglang_python  # noqa: E402
from wf import planned_jobs, snakemake, write_config  # noqa: E402

from draftsmith.runtime.hardware import cpu_facts  # noqa: E402

TIMEOUT = 7200
STAGES = ("regenerate", "capture")
PREP = (
    "results/target",
    "results/env/cpu.json",
    "results/env/sglang-cpu.json",
    "results/sglang/patched.json",
    "results/data/sources.json",
)
STATES = ("aux_hidden_states", "last_hidden_states")


def bench_config(src: Path, prompts: Path, python: str, mode: str, rows: int, ranges: int):
    """The CI workflow's Kimi project (regenerate and capture on SGLang) on `rows` bundled rows
    in `ranges` ranges, with `sglang.shared_server` `mode`."""
    from test_sglang_capture import CPU_SERVER_ARGS
    from test_workflow_kimi_sglang import config

    cfg = config(src, prompts, python, "sglang")
    cfg["data"].update(
        sources=[{"format": "bundled", "max_rows": rows}], rows_per_shard=-(-rows // ranges)
    )
    cfg["sglang"] = {"extra_args": CPU_SERVER_ARGS, "shared_server": mode}
    return cfg


def startups(records: list[dict]) -> list[float]:
    """Start-up seconds of every launch behind a stage's records: a shared host's once, a
    job's own server's each time."""
    hosts: dict = {}
    for r in records:  # the host's record with the most launches (a relaunch adds one)
        pid = r.get("server_host_pid")
        if pid and len(r["server_startup_seconds"]) >= len(
            hosts.get(pid, {}).get("server_startup_seconds", [])
        ):
            hosts[pid] = r
    own = [r for r in records if not r.get("server_host_pid")]
    return [round(s, 1) for r in [*hosts.values(), *own] for s in r["server_startup_seconds"]]


def stage_jobs(work: Path, rule: str) -> dict:
    """A rule's jobs from Snakemake's benchmark files: their seconds summed, and the span from
    the first job's start (end - seconds) to the last one's end (the file's mtime)."""
    ends, starts, total = [], [], 0.0
    for tsv in (work / "benchmarks" / "jobs" / rule).glob("*.tsv"):
        s = float(tsv.read_text().splitlines()[1].split("\t")[0])
        end = tsv.stat().st_mtime
        total, ends, starts = total + s, [*ends, end], [*starts, end - s]
    span = max(ends) - min(starts) if ends else 0.0
    return {"jobs": len(ends), "job_s": round(total, 1), "span_s": round(span, 1)}


def stage_record(work: Path, stage: str) -> dict:
    from test_workflow_kimi_sglang import launches, server_records

    records = server_records(work, stage)
    return {
        **stage_jobs(work, stage),
        "server_launches": launches(records),
        "startup_s": startups(records),
        # a job's own server (shared_server job) records no `server_started_by_this_job`
        "started_by_a_job": sum(bool(r.get("server_started_by_this_job", True)) for r in records),
        "wait_s": [round(r.get("server_wait_seconds") or 0.0, 1) for r in records],
    }


def stage_order(work: Path) -> str:
    """The order in which the run started its regenerate (R) and capture (C) jobs, from its
    Snakemake log (the newest in .snakemake/log: the copy also holds the preparation's)."""
    from bench_default import job_timeline

    logs = sorted((work / ".snakemake" / "log").glob("*.snakemake.log"))
    jobs = job_timeline(logs[-1]) if logs else {}  # in the log's order of job starts
    return "".join(j["rule"][0].upper() for j in jobs.values() if j["rule"] in STAGES)


def hosts_left(work: Path) -> int:
    """Live shared-server hosts (`python -m draftsmith shared-server host`) started in `work`."""
    import psutil

    n = 0
    for p in psutil.process_iter(["cmdline", "cwd", "status"]):
        cmd = p.info["cmdline"] or []
        if "shared-server" in cmd and str(p.info["cwd"] or "").startswith(str(work)):
            n += p.info["status"] != "zombie"
    return n


def run_mode(base: Path, work: Path, mode: str, cfg: dict) -> dict:
    from bench_shared_capture import server_pids

    shutil.copytree(base, work, symlinks=True)
    write_config(work, cfg)
    shutil.rmtree(work / "benchmarks" / "jobs", ignore_errors=True)
    load0, t0 = os.getloadavg()[0], time.monotonic()
    snakemake(work, "--cores", "2", "hidden", timeout=TIMEOUT)
    wall = time.monotonic() - t0
    load1 = os.getloadavg()[0]
    deadline = time.monotonic() + 30
    while (server_pids(work) or hosts_left(work)) and time.monotonic() < deadline:
        time.sleep(1)
    return {
        "mode": mode,
        "wall_s": round(wall, 1),
        "stages": {stage: stage_record(work, stage) for stage in STAGES},
        "order": stage_order(work),
        "server_processes_left": len(server_pids(work)),
        "hosts_left": hosts_left(work),
        "load_1min": [round(load0, 2), round(load1, 2)],
    }


def compare(a: Path, b: Path) -> dict:
    """Rows and shards of two runs: rows equal, token ids equal, states bit-identical (else the
    largest absolute difference)."""
    import torch

    from draftsmith.hidden.shards import open_shard

    rows = sorted((a / "results" / "data").glob("rows_*.jsonl"))
    rows_equal = all(f.read_bytes() == (b / f.relative_to(a)).read_bytes() for f in rows)
    shards = sorted((a / "results" / "hidden").glob("rows_*.safetensors"))
    ids_equal, bitwise, worst = True, True, 0.0
    for f in shards:
        x, y = open_shard(f), open_shard(b / f.relative_to(a))
        for name in ("input_ids", "loss_mask", "row_offsets"):
            ids_equal &= torch.equal(getattr(x, name), getattr(y, name))
        for name in STATES:
            p, q = getattr(x, name), getattr(y, name)
            bitwise &= torch.equal(p, q)
            if p.shape == q.shape:
                worst = max(worst, float((p.float() - q.float()).abs().max()))
    return {"row_files": len(rows), "rows_equal": rows_equal, "shards": len(shards),
            "token_ids_equal": ids_equal, "states_bit_identical": bitwise,
            "states_max_abs_diff": worst}  # fmt: skip


def table(record: dict) -> list[str]:
    lines = [
        "| shared_server | stage | jobs | server launches | start-up s each | job s (sum) "
        "| span s | run wall s | load start-end |",
        "|---|---|---:|---:|---|---:|---:|---:|---|",
    ]
    for r in record["runs"]:
        for stage in STAGES:
            s = r["stages"][stage]
            starts = ", ".join(f"{x:.0f}" for x in s["startup_s"])
            lines.append(
                f"| {r['mode']} | {stage} | {s['jobs']} | {s['server_launches']} | {starts} "
                f"| {s['job_s']:.0f} | {s['span_s']:.0f} | {r['wall_s']:.0f} "
                f"| {r['load_1min'][0]}-{r['load_1min'][1]} |"
            )
    return lines


def notes(record: dict) -> list[str]:
    job, run = (next(r for r in record["runs"] if r["mode"] == m) for m in ("job", "run"))
    eq = record["equal"]
    out = []
    for stage in STAGES:
        j, r = job["stages"][stage], run["stages"][stage]
        out.append(
            f"- {stage}: {j['server_launches']} launches ({sum(j['startup_s']):.0f} s of "
            f"start-up) with one server per job, {r['server_launches']} "
            f"({sum(r['startup_s']):.0f} s) with one per stage; job seconds "
            f"{j['job_s']:.0f} -> {r['job_s']:.0f}, span {j['span_s']:.0f} -> {r['span_s']:.0f} s."
        )
    states = (
        "bit-identical"
        if eq["states_bit_identical"]
        else f"not bit-identical, largest difference {eq['states_max_abs_diff']:.2e}"
    )
    out += [
        f"- Run wall time: {job['wall_s']:.0f} s per job, {run['wall_s']:.0f} s per stage "
        f"(saved {job['wall_s'] - run['wall_s']:.0f} s).",
        f"- Both runs: regenerated rows equal ({eq['row_files']} files): {eq['rows_equal']}; "
        f"{eq['shards']} shards, token ids, masks and offsets equal: {eq['token_ids_equal']}; "
        f"aux and final states {states}.",
        "- Order of the job starts (R regenerate, C capture): "
        + "; ".join(f"{r['mode']} {r.get('order', '?')}" for r in record["runs"]) + ".",
        "- Server processes / shared-server hosts left 30 s after each run: "
        + ", ".join(f"{r['mode']} {r['server_processes_left']} / {r['hosts_left']}"
                    for r in record["runs"]) + ".",
    ]  # fmt: skip
    return out


def render(record: dict) -> str:
    cpu = record["cpu"]
    lines = [
        f"# One SGLang server per stage against one per range job ({cpu['kind']})",
        "",
        f"Produced by `benchmarks/bench_shared_stages.py`. CPU: {cpu['describe']}; 2 cores "
        "shared with other work, so the figures are upper bounds "
        "(1-min load average at the start and end of each run in the table). The tiny "
        "Kimi-K2.5-shaped checkpoint of the CI workflow (tests/test_workflow_kimi_sglang.py) "
        f"on {record['rows']} bundled prompt rows in {record['ranges']} row ranges, regenerated "
        "and captured through the patched SGLang CPU server (role sglang-cpu), `snakemake "
        "--cores 2 hidden` in two copies of one prepared project (target, env stamps, patched "
        "SGLang built once), `shared_server: job` then `run`, one after the other. Start-up: "
        "launch to /health per server; job seconds: Snakemake's benchmark files summed per "
        "stage; span: first job start to last job end of the stage.",
        "",
        *table(record),
        "",
        *notes(record),
    ]
    return "\n".join(lines) + "\n"


def prepare(args, python: str) -> dict:
    """The tiny checkpoint, the prompts file the config names, and the base project built up to
    what both modes share; returns the config maker's arguments per mode."""
    from test_workflow_kimi_sglang import round_trip_target
    from trained import PROMPTS

    src = args.work / "src"
    if not (src / "config.json").is_file():
        round_trip_target(src)
    prompts = args.work / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    cfgs = {
        m: bench_config(src, prompts, python, m, args.rows, args.ranges) for m in ("job", "run")
    }
    base = args.work / "base"
    shutil.rmtree(base, ignore_errors=True)
    write_config(base, cfgs["job"])
    snakemake(base, "--cores", "2", *PREP, timeout=TIMEOUT)
    plan = planned_jobs(base, "hidden")
    if plan.get("regenerate") != args.ranges or plan.get("capture") != args.ranges:
        raise SystemExit(f"expected {args.ranges} range jobs per stage, planned {plan}")
    return cfgs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--work", type=Path, default=ROOT / "benchmarks" / "work" / "shared_stages")
    ap.add_argument("--rows", type=int, default=64, help="bundled prompt rows")
    ap.add_argument("--ranges", type=int, default=8, help="row ranges (range jobs per stage)")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    ap.add_argument("--render", action="store_true", help="only rewrite the .md from the .json")
    args = ap.parse_args()
    name = f"shared_stages_{cpu_facts().kind}"
    if args.render:
        rerender(args.out, name, render)
        return
    python = sglang_python()
    for mode in ("job", "run"):
        shutil.rmtree(args.work / mode, ignore_errors=True)
    cfgs = prepare(args, python)
    # the per-job servers first, then the shared ones: the same order of load for every run
    runs = [run_mode(args.work / "base", args.work / m, m, cfgs[m]) for m in ("job", "run")]
    f = cpu_facts()
    record = {
        "cpu": {**f.as_dict(), "describe": f.describe()},
        "rows": args.rows,
        "ranges": args.ranges,
        "runs": runs,
        "equal": compare(args.work / "job", args.work / "run"),
    }
    write_result(name, record, render, args.out)


if __name__ == "__main__":
    main()
