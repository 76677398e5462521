"""Acceptance and throughput against concurrency, greedy and sampled, through the real SGLang
(CPU) and vLLM (CPU) engines.

    python benchmarks/bench_concurrency.py [--project DIR] [--levels 1 4 8 16] [--prompts 16]
        [--max-new-tokens 32] [--temperatures 0 0.7] [--engines sglang vllm]

DIR holds `results/target` and `results/draft` (a finished project). Without it, the tests' tiny
project is trained first under benchmarks/work/concurrency (tests/trained.py's
train_tiny_project: a 6-layer random-weight Llama target and a draft our own pipeline trained
on its greedy outputs, about a minute). Each engine runs its own bench stage function
(`bench_sets`, the bench rule's) in its role's interpreter ($DRAFTSMITH_PYTHON_SGLANG_CPU,
$DRAFTSMITH_PYTHON_VLLM_CPU) on the same prompts: greedy at every level, then sampled at
each of `--temperatures` (0: greedy) at every level. The figures are draftsmith.bench.figures' (per level: tau,
acceptance by position, tokens/s of both sides, median and p90 time per output token, speedup,
outputs against plain greedy at the first level). OMP_NUM_THREADS defaults to 1 here: on
cores shared with other jobs, vLLM's two bound OpenMP threads decoded ~10x slower than one
(measured on this script's tiny target, 1 against 12 tokens/s).

Writes benchmarks/results/concurrency_<CPU kind>.{json,md,png}: the PNG is the report's
concurrency plot (draftsmith.bench.levels) with one curve per engine and mode.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests"), str(ROOT / "benchmarks")]

from bench_job_threads import write_result  # noqa: E402

from draftsmith.bench.levels import HEAD  # noqa: E402
from draftsmith.runtime.files import atomic_path  # noqa: E402

OUT = ROOT / "benchmarks" / "results"
ROLES = {"sglang": "sglang-cpu", "vllm": "vllm-cpu"}
PYTHON = {"sglang": "DRAFTSMITH_PYTHON_SGLANG_CPU", "vllm": "DRAFTSMITH_PYTHON_VLLM_CPU"}
# a KV pool of 8192 tokens on CPU; no --mem-fraction-static 0.1 (config/embedded-sglang.yaml's):
# with other jobs holding the host's memory, SGLang 0.5.23 refused to start under it
# ("Loaded weights leave no GPU memory for the KV cache")
SGLANG = {
    "tp_size": 1,
    "extra_args": ["--max-total-tokens", "8192"],
    "port": 0,
    "startup_timeout": 900,
    "request_timeout": 1800,
    "retries": 2,
}


def texts(n: int) -> list[str]:
    """n prompts: the tests' eight, then word salads of the tiny target's corpus (seed 1, so
    not the training rows, which are seed 0's)."""
    import torch
    from trained import PROMPTS

    from draftsmith.targets.tinymodel import CORPUS

    words = " ".join(CORPUS).split()
    g = torch.Generator().manual_seed(1)
    more = [
        " ".join(words[int(j)] for j in torch.randint(0, len(words), (8,), generator=g))
        for _ in range(max(0, n - len(PROMPTS)))
    ]
    return (PROMPTS + more)[:n]


def engine_cfg(engine: str, args, temperature: float) -> dict:
    bench = {
        "backend": engine,
        "role": ROLES[engine],
        "num_steps": args.num_steps,
        "topk": 1,
        "num_draft_tokens": 0,
        "concurrency": list(args.levels),
        "max_new_tokens": args.max_new_tokens,
        "tau_floor": 1.0,
    }
    if temperature > 0:
        bench.update(temperature=temperature, top_p=1.0, seed=0)
    cfg = {"bench": bench, "target": {"dtype": "float32"}}
    if engine == "sglang":
        cfg["sglang"] = SGLANG
    return cfg


def run(project: Path, engine: str, args, temperature: float) -> dict:
    from trained import run_bench

    python = os.environ.get(PYTHON[engine])
    if not python:
        raise SystemExit(f"{PYTHON[engine]} is not set: the {ROLES[engine]} role's interpreter")
    t0 = time.perf_counter()
    out = run_bench(
        project,
        engine,
        "results/draft",
        engine_cfg(engine, args, temperature),
        python,
        texts=texts(args.prompts),
    )
    fig = out["res"]["s"]
    return {
        "engine": engine,
        "temperature": temperature,
        "wall_seconds": time.perf_counter() - t0,
        "version": out["info"].get("vllm_version") or sglang_version(python),
        "method": out["info"]["method"],
        "engine_notes": out["info"].get("engine_notes", []),
        "levels": fig["by_concurrency"],
    }


def sglang_version(python: str) -> str:
    import subprocess

    code = "import importlib.metadata as m; print(m.version('sglang'))"
    return subprocess.run([python, "-c", code], capture_output=True, text=True).stdout.strip()


def load_avg() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


# the report's per-level columns (draftsmith.bench.levels), with the engine and temperature first
MD_HEAD = ("engine", "temperature", *HEAD[1:])


def md_rows(runs: list[dict]) -> list[str]:
    from draftsmith.bench import levels as benchlevels

    lines = []
    for r in runs:
        fake = {"sets": {r["engine"]: {"by_concurrency": r["levels"]}}}
        for row in benchlevels.rows(fake):
            lines.append("| " + " | ".join([row[0], f"{r['temperature']:g}", *row[1:]]) + " |")
    return lines


def render_md(result: dict) -> str:
    m = result["machine"]
    loads = [x for r in result["runs"] for x in r["load_1min"]]
    lines = [
        f"# Concurrency: acceptance and throughput, SGLang and vLLM on CPU ({m['cpu_kind']})",
        "",
        f"{m['cpu']}, {m['cores']} cores **shared with other jobs** (1-min load "
        f"{min(loads)}-{max(loads)} at the start and end of the runs; this run at "
        f"nice {result.get('nice', 19)}, OMP_NUM_THREADS {result['omp_num_threads']}): absolute tokens/s and "
        "milliseconds are this loaded CPU's; compare ratios and shapes within a row group only.",
        "",
        f"Draft: {result['draft']}. {result['prompts']} prompts, at most "
        f"{result['max_new_tokens']} new tokens, {result['num_steps']} draft tokens per pass "
        f"(chain), float32 target; levels {result['levels']} requests in flight. Engines: "
        + "; ".join(f"{k} {v}" for k, v in result["versions"].items())
        + ".",
        "",
        "| " + " | ".join(MD_HEAD) + " |",
        "|" + "---|" * len(MD_HEAD),
        *md_rows(result["runs"]),
        "",
    ]
    notes = sorted({n for r in result["runs"] for n in r["engine_notes"]})
    lines += [f"- {n}" for n in notes]
    lines += [
        f"- {r['engine']} at temperature {r['temperature']:g}: {r['wall_seconds']:.0f} s wall "
        f"(1-min load {r['load_1min'][0]} -> {r['load_1min'][1]})"
        for r in result["runs"]
    ]
    lines += ["", "![throughput and tau against concurrency](" + result["png"] + ")", ""]
    return "\n".join(lines)


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    from draftsmith.bench import levels as benchlevels

    sets = {
        f"{r['engine']} T={r['temperature']:g}": {"by_concurrency": r["levels"]}
        for r in result["runs"]
    }
    png = benchlevels.plot({"sets": sets})
    with atomic_path(path) as tmp:
        Path(tmp).write_bytes(png)


def merge_other_engines(result: dict, path: Path, engines: list[str], temps: list[float]) -> None:
    """Keep the runs (engine, temperature) not run now from an earlier file with the same
    settings (so engines and temperatures can be measured by separate invocations)."""
    import json

    if not path.is_file():
        return
    old = json.loads(path.read_text())
    same = ("draft", "prompts", "max_new_tokens", "num_steps", "levels")
    if any(old.get(k) != result[k] for k in same):
        return
    kept = [r for r in old["runs"] if r["engine"] not in engines or r["temperature"] not in temps]
    result["runs"] = kept + result["runs"]
    for r in kept:
        result["versions"].setdefault(r["engine"], r["version"])


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--project", type=Path, help="a project with results/target and results/draft")
    ap.add_argument("--levels", type=int, nargs="+", default=[1, 4, 8, 16])
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--num-steps", type=int, default=3)
    ap.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 0.7])
    ap.add_argument("--engines", nargs="+", default=["sglang", "vllm"], choices=sorted(ROLES))
    args = ap.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")

    from draftsmith.runtime.hardware import cpu_facts, cpu_model

    project = args.project
    draft = f"{project}/results/draft" if project else None
    if project is None:
        from trained import train_tiny_project

        project = ROOT / "benchmarks" / "work" / "concurrency"
        if not (project / "results" / "draft" / "model.safetensors").is_file():
            train_tiny_project(project)
        draft = (
            "the tests' tiny project (tests/trained.py: 6-layer random-weight Llama target, "
            "hidden 128, draft trained by our pipeline on its greedy outputs); the embedded "
            "default's draft was not available"
        )
    facts = cpu_facts()
    result = {
        "machine": {"cpu": cpu_model(), "cpu_kind": facts.kind, "cores": os.cpu_count()},
        "draft": draft,
        "prompts": args.prompts,
        "max_new_tokens": args.max_new_tokens,
        "num_steps": args.num_steps,
        "levels": args.levels,
        "omp_num_threads": os.environ["OMP_NUM_THREADS"],
        "nice": os.nice(0),
        "runs": [],
        "versions": {},
    }
    for engine in args.engines:
        for temperature in args.temperatures:
            before = load_avg()
            r = run(project, engine, args, temperature)
            r["load_1min"] = [before[0], load_avg()[0]]
            result["runs"].append(r)
            result["versions"][engine] = r["version"]
            print(f"{engine} T={temperature}: {r['wall_seconds']:.0f} s", flush=True)
    stem = f"concurrency_{facts.kind}"
    merge_other_engines(result, OUT / f"{stem}.json", args.engines, args.temperatures)
    result["png"] = f"{stem}.png"
    plot(result, OUT / f"{stem}.png")
    write_result(stem, result, render_md, OUT)


if __name__ == "__main__":
    main()
