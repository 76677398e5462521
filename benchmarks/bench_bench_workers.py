"""The bench job on a CPU: one process with the job's threads, or one-thread worker processes
sharing the prompts (bench.workers).

Takes the bench job of a finished default run (`--from-run`) from `snakemake -n -p`, points its
outputs to a scratch folder and runs it with `--threads 2` twice: bench.workers 1 (one process,
two threads; what `auto` runs) and bench.workers 2 (two processes of one thread,
draftsmith.engines.hf.bench_pool). Each run is a fresh process with the workflow's environment
(DRAFTSMITH_OMP=auto, OMP_NUM_THREADS) and today's package; `--reps` rounds, the order swapped
every other round, the best wall time of each kept. Reports both wall times (the whole job:
imports, loading, routes, warm-up, every prompt, the report), the speed of the workers against
one process, and from each report the tau, tokens/s, speedup and pass cost per set and how many
prompts' outputs are the same both ways (the thread count may change rounding, and through it
a greedy choice).

    python benchmarks/bench_bench_workers.py [--from-run benchmarks/work/default_run] [--reps 1]

Writes benchmarks/results/bench_workers_<cpu kind>.{json,md} (`--name` replaces the stem).
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

from bench_job_threads import from_run_main, job_commands, retarget, run_jobs

OUTPUTS = ("--report-json", "--report-md", "--summary-html", "--acceptance", "--hist",
           "--training", "--captions")  # fmt: skip
MODES = {"one process": 1, "workers": 2}


def bench_argv(cmd: str, workers, scratch: Path) -> list[str]:
    """The bench job's argv with this interpreter, bench.workers `workers`, two threads and its
    outputs under `scratch`."""
    argv = retarget(cmd, OUTPUTS, 2, scratch)
    i = argv.index("--cfg") + 1
    cfg = json.loads(argv[i])
    cfg["bench"]["workers"] = workers
    argv[i] = json.dumps(cfg)
    return argv


def figures(report_json: Path) -> dict:
    report = json.loads(report_json.read_text())
    sets = {
        name: {"tau": r["tau"], "spec_tok_s": r["spec_tokens_per_s"],
               "base_tok_s": r["baseline_tokens_per_s"], "speedup": r["speedup"],
               "pass_cost": r["pass_cost"],
               "outputs": [p["output_ids"] for p in r["per_prompt"]]}
        for name, r in report["sets"].items()
    }  # fmt: skip
    return {"workers": report.get("workers", 1), "threads": report["threads"], "sets": sets}


def measure(run: Path, reps: int) -> dict:
    (cmd,) = job_commands(run, ("bench",), keep=1)["bench"]
    best = {mode: float("inf") for mode in MODES}
    found = {}
    with tempfile.TemporaryDirectory() as tmp:
        for rep in range(reps):
            for mode in list(MODES) if rep % 2 == 0 else list(MODES)[::-1]:
                scratch = Path(tmp) / mode.replace(" ", "_")
                scratch.mkdir(exist_ok=True)
                argv = bench_argv(cmd, MODES[mode], scratch)
                seconds = run_jobs(run, [argv], 2, False, scratch)
                print(f"{mode}: {seconds:.1f} s", flush=True)
                best[mode] = min(best[mode], seconds)
                found[mode] = figures(scratch / "report.json")
    one, pool = found["one process"], found["workers"]
    same = {
        name: sum(a == b for a, b in zip(one["sets"][name]["outputs"], s["outputs"], strict=True))
        for name, s in pool["sets"].items()
    }
    for f in found.values():
        for s in f["sets"].values():
            s["prompts"] = len(s.pop("outputs"))
    return {"seconds": {m: round(s, 1) for m, s in best.items()},
            "speed": round(best["one process"] / best["workers"], 3),
            "runs": found, "same_outputs": same}  # fmt: skip


def render(result: dict) -> str:
    m = result["measured"]
    one, pool = m["runs"]["one process"], m["runs"]["workers"]
    lines = [
        "# The bench job: one two-thread process, or one-thread workers sharing the prompts",
        "",
        f"CPU {result['cpu']}, {result['cores']} cores; the bench job of a finished default run "
        f"with `--threads 2`, a fresh process each way; best of {result['reps']} round(s); 1-min "
        f"load average {result['load_before']:.2f} -> {result['load_after']:.2f}. Wall time of "
        "the whole job (imports, loading, linear-layer routes, warm-up, every prompt, report).",
        "",
        f"- bench.workers 1: {m['seconds']['one process']:.1f} s ({one['workers']} process, "
        f"{one['threads']} threads)",
        f"- bench.workers 2: {m['seconds']['workers']:.1f} s ({pool['workers']} processes, "
        f"{pool['threads']} threads in all): **{m['speed']:.2f}x** as fast",
        "",
        "| set | prompts | tau (1 / 2) | tok/s spec (1 / 2) | tok/s greedy (1 / 2) | "
        "speedup (1 / 2) | pass cost (1 / 2) | same outputs |",
        "|---|---:|---|---|---|---|---|---:|",
    ]
    for name, a in one["sets"].items():
        b = pool["sets"][name]
        lines.append(
            f"| {name} | {a['prompts']} | {a['tau']:.3f} / {b['tau']:.3f} | "
            f"{a['spec_tok_s']:.1f} / {b['spec_tok_s']:.1f} | "
            f"{a['base_tok_s']:.1f} / {b['base_tok_s']:.1f} | "
            f"{a['speedup']:.3f}x / {b['speedup']:.3f}x | "
            f"{a['pass_cost']:.2f} / {b['pass_cost']:.2f} | "
            f"{m['same_outputs'][name]}/{a['prompts']} |"
        )
    lines += ["", "With workers the tokens/s are one process's (one thread), each prompt's two "
              "runs timed back to back in the same worker, while the other worker decodes "
              "beside it. Pass cost: one speculative pass in greedy steps (speedup = tau "
              "(SGLang count) / pass cost). bench.workers auto runs one process."]  # fmt: skip
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    from_run_main(__doc__, measure, render, "bench_workers", "measured")
