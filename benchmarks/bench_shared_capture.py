"""Segment mode through the SGLang capture server: one server per capture job against one per run.

    DRAFTSMITH_PYTHON_SGLANG_CPU=... python benchmarks/bench_shared_capture.py [--epochs 2]

Builds one tiny project (a random 6-layer Llama made here, 32 training rows of the bundled
prompts in ranges of 16, train.segment_rows 16: 2 segments) up to its token files, vocabulary
and patched SGLang, then runs segment mode (`capture.keep` false, `capture.backend` sglang on
the sglang-cpu role) to the draft twice from that point, each in its own copy:

- job: `sglang.shared_server: job`, a server launched by every capture job (epochs x
  segments of them);
- run: `sglang.shared_server: run`, one server for all of them (draftsmith.engines.sharedserver).

For each it records the wall time, the seconds of each job (Snakemake's benchmark files) per
stage, the server launches and the start-up seconds of each (the capture manifests' `server`
record), the CPU seconds the server processes used while no capture job ran (sampled every
second: what a server kept up costs the training between captures), and whether any server
process is left 30 s after the run. Writes benchmarks/results/shared_capture_<CPU kind>.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests"), str(ROOT / "benchmarks")]

from bench_job_threads import write_result  # noqa: E402
from bench_segments import job_seconds  # noqa: E402
from wf import snakemake, tiny_config, write_config  # noqa: E402

from draftsmith.runtime.files import atomic_write_text  # noqa: E402
from draftsmith.runtime.hardware import cpu_facts  # noqa: E402

TIMEOUT = 7200
CPU_SERVER_ARGS = ["--max-total-tokens", "4096", "--mem-fraction-static", "0.1"]


def bench_config(target: Path, python: str, mode: str, epochs: int, rows: int) -> dict:
    return tiny_config(
        target,
        data={"sources": [{"format": "bundled", "max_rows": rows + 8}], "heldout_rows": 8},
        envs={"sglang-cpu": {"python": python}},
        capture={"dtype": "float32", "batch_tokens": 1024, "keep": False, "backend": "sglang",
                 "role": "sglang-cpu", "aux_layer_ids": [1, 2, 4]},
        sglang={"extra_args": CPU_SERVER_ARGS, "shared_server": mode},
        train={"epochs": epochs, "segment_rows": 16, "precision": "fp32"},
    )  # fmt: skip


def server_pids(work: Path) -> list[int]:
    """Live processes of a server (DRAFTSMITH_SERVER in their environment) started in `work`."""
    import psutil

    found = []
    for p in psutil.process_iter(["pid", "cwd", "environ", "status"]):
        env, cwd = p.info["environ"] or {}, p.info["cwd"] or ""
        if (
            "DRAFTSMITH_SERVER" in env
            and cwd.startswith(str(work))
            and p.info["status"] != "zombie"
        ):
            found.append(p.info["pid"])
    return found


class ServerCPU:
    """Sample, every second, the CPU seconds of `work`'s server processes and whether a capture
    job runs; sums the CPU they used in the intervals without a capture job."""

    def __init__(self, work: Path):
        self.work, self.idle_cpu_s, self.idle_wall_s = work, 0.0, 0.0
        self._last: dict[int, float] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _capturing(self) -> bool:
        import psutil

        for p in psutil.process_iter(["cmdline", "cwd"]):
            if "segment-capture" in (p.info["cmdline"] or []) and p.info["cwd"] == str(self.work):
                return True
        return False

    def _run(self) -> None:
        import psutil

        while not self._stop.wait(1.0):
            used = 0.0
            for pid in server_pids(self.work):
                try:
                    t = psutil.Process(pid).cpu_times()
                except psutil.Error:
                    continue
                now = t.user + t.system
                used += now - self._last.get(pid, now)
                self._last[pid] = now
            if not self._capturing():
                self.idle_cpu_s += used
                self.idle_wall_s += 1.0

    def __enter__(self) -> ServerCPU:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def launches(work: Path) -> list[dict]:
    """The `server` record of every capture manifest, in order."""
    out = []
    for m in sorted((work / "results" / "segments").glob("epoch*/*.json")):
        rec = json.loads(m.read_text())
        out.append({"capture": f"{m.parent.name}/{m.stem}", **rec["server"],
                    "bit_identical": (rec["recapture"] or {}).get("bit_identical")})  # fmt: skip
    return out


def run_mode(base: Path, work: Path, mode: str, cfg_args) -> dict:
    shutil.copytree(base, work, symlinks=True)
    write_config(work, bench_config(*cfg_args(mode)))
    shutil.rmtree(work / "benchmarks" / "jobs", ignore_errors=True)
    load0, t0 = os.getloadavg()[0], time.monotonic()
    with ServerCPU(work) as cpu:
        snakemake(work, "--cores", "2", "results/draft", timeout=TIMEOUT)
    wall = time.monotonic() - t0
    deadline = time.monotonic() + 30
    while server_pids(work) and time.monotonic() < deadline:
        time.sleep(1)
    caps = launches(work)
    starts = sorted(
        {(c.get("server_host_pid"), s) for c in caps for s in c["server_startup_seconds"]}
    )
    return {
        "mode": mode,
        "wall_s": round(wall, 1),
        "job_s": {k: round(v, 1) for k, v in job_seconds(work).items()},
        "captures": caps,
        "server_launches": len(starts),
        "startup_s": [s for _, s in starts],
        "server_cpu_s_without_capture": round(cpu.idle_cpu_s, 1),
        "wall_s_without_capture": round(cpu.idle_wall_s, 1),
        "server_processes_left": len(server_pids(work)),
        "load_1min": [round(load0, 2), round(os.getloadavg()[0], 2)],
    }


def rerender(out: Path, name: str, render_fn) -> None:
    """Rewrite `<out>/<name>.md` from its .json (--render)."""
    record = json.loads((out / f"{name}.json").read_text())
    atomic_write_text(out / f"{name}.md", render_fn(record))


def sglang_python() -> str:
    """The sglang-cpu role's interpreter (DRAFTSMITH_PYTHON_SGLANG_CPU), or exit naming it."""
    python = os.environ.get("DRAFTSMITH_PYTHON_SGLANG_CPU", "")
    if not Path(python).is_file():
        raise SystemExit("set DRAFTSMITH_PYTHON_SGLANG_CPU to the sglang-cpu role's interpreter")
    return python


def render(record: dict) -> str:
    job, run = (next(r for r in record["runs"] if r["mode"] == m) for m in ("job", "run"))
    lines = [
        f"# One SGLang capture server per run against one per capture job ({record['cpu']['kind']})",
        "",
        f"CPU: {record['cpu']['describe']}, 2 cores shared with "
        f"other work (1-min load average at start/end of each run in the table; figures are "
        f"upper bounds). Segment mode on a tiny random 6-layer Llama, {record['rows']} training "
        f"rows, 2 segments x {record['epochs']} epochs = {record['n_captures']} capture jobs "
        "through the patched SGLang 0.5.23 CPU server (role sglang-cpu). Job seconds: Snakemake's "
        "benchmark files summed per stage; start-up: launch to /health, per server.",
        "",
        "| shared_server | server launches | start-up s each | capture jobs s | train jobs s "
        "| run wall s | server CPU s with no capture running | processes left | load |",
        "|---|---:|---|---:|---:|---:|---:|---:|---|",
    ]
    for r in record["runs"]:
        lines.append(
            f"| {r['mode']} | {r['server_launches']} | {', '.join(f'{s:.0f}' for s in r['startup_s'])} "
            f"| {r['job_s'].get('capture', 0):.0f} | {r['job_s'].get('train', 0):.0f} "
            f"| {r['wall_s']:.0f} | {r['server_cpu_s_without_capture']:.0f} "
            f"(of {r['wall_s_without_capture']:.0f} s) | {r['server_processes_left']} "
            f"| {r['load_1min'][0]}-{r['load_1min'][1]} |"
        )
    saved = job["job_s"]["capture"] - run["job_s"]["capture"]
    lines += [
        "",
        f"- Start-up seconds paid: {sum(run['startup_s']):.0f} s with one server per run, "
        f"{sum(job['startup_s']):.0f} s with one per job; the difference is the start-ups of "
        f"{job['server_launches'] - run['server_launches']} servers.",
        f"- Capture job seconds saved: {saved:.0f} s of {job['job_s']['capture']:.0f} s "
        f"({record['n_captures']} captures, {run['server_launches']} launch instead of "
        f"{job['server_launches']}); run wall time saved: {job['wall_s'] - run['wall_s']:.0f} s.",
        f"- Start-up per server (median): {record['startup_median_s']:.0f} s; a capture's own "
        f"work here is about a second, so start-up is nearly all of a per-job capture.",
        "- Re-captures bit-identical to the first capture in both modes: "
        f"{record['bit_identical']}.",
        "- The server kept up between captures used "
        f"{run['server_cpu_s_without_capture']:.1f} CPU s in {run['wall_s_without_capture']:.0f} "
        "s without a capture job (SGLang's scheduler blocks when idle): training between "
        "captures does not pay for it; the train jobs' seconds differ with the load of the "
        "shared cores (load column).",
    ]
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--work", type=Path, default=ROOT / "benchmarks" / "work" / "shared_capture")
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--rows", type=int, default=32, help="training rows (ranges of 16)")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    ap.add_argument("--render", action="store_true", help="only rewrite the .md from the .json")
    args = ap.parse_args()
    if args.render:
        rerender(args.out, f"shared_capture_{cpu_facts().kind}", render)
        return
    python = sglang_python()
    from draftsmith.targets.tinymodel import make_tiny_target

    for mode in ("job", "run"):
        shutil.rmtree(args.work / mode, ignore_errors=True)
    target = args.work / "model"
    if not (target / "config.json").is_file():
        make_tiny_target(target)

    def cfg_args(mode):
        return target, python, mode, args.epochs, args.rows

    base = args.work / "base"
    write_config(base, bench_config(*cfg_args("job")))
    prep = (
        "results/vocab/vocab.safetensors",
        "results/hidden/plan.json",
        "results/sglang/patched.json",
    )
    snakemake(base, "--cores", "2", *prep, timeout=TIMEOUT)
    # the shared server first: the new path fails, if it does, before the long per-job run
    runs = [run_mode(base, args.work / mode, mode, cfg_args) for mode in ("run", "job")]
    f = cpu_facts()
    starts = sorted(s for r in runs for s in r["startup_s"])
    record = {
        "cpu": {**f.as_dict(), "describe": f.describe()},
        "rows": args.rows,
        "epochs": args.epochs,
        "n_captures": len(runs[0]["captures"]),  # the same in both runs
        "runs": runs,
        "startup_median_s": starts[len(starts) // 2],
        "bit_identical": all(
            c["bit_identical"]
            for r in runs
            for c in r["captures"]
            if c["bit_identical"] is not None
        ),
    }
    name = f"shared_capture_{record['cpu']['kind']}"
    write_result(name, record, render, args.out)


if __name__ == "__main__":
    main()
