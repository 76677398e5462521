"""OpenMP wait policy and thread count under contention: the benchmark and training stages at
load 0 and beside busy processes.

    python benchmarks/bench_contention.py --run DIR [--load 0 2] [--policies spin passive ...]

DIR is a finished run of the embedded default (results/target, results/hidden, results/vocab;
e.g. benchmarks/work/default_run after bench_default.py). For every policy and load level it
starts `--load` busy processes (pure-Python loops at normal priority: other users' work), then
in a fresh subprocess with the policy's environment:

- decode: greedy decoding of the first held-out prompts with the target (the benchmark stage's
  inner loop, batch 1, 64 new tokens), tokens/s;
- train: `--train-steps` optimizer steps of the training stage on the run's shards (fresh state
  directory, precision as `train.precision auto` resolves on this CPU), tokens/s of the last
  steps (the first two are warm-up).

Policies: `auto` (what a workflow job does: draftsmith/runtime/threads.py probes the load at start),
`spin` (libgomp's default: spin ~300k iterations, then sleep), `passive`
(OMP_WAIT_POLICY=PASSIVE: sleep at once), `spinN` (GOMP_SPINCOUNT=N), each optionally with
`@T` for T threads instead of the run's (e.g. `passive@1`). The default for jobs is the policy
rules/common.smk exports; this script is how it was chosen.

Writes benchmarks/results/contention_<cpu kind>.{json,md}: per stage, tokens/s per policy and
load, and each loaded figure as a fraction of the same policy's unloaded one, next to the fair
share (the fraction of the cores a job would get if the CPU were shared evenly).
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
sys.path[:0] = [str(ROOT)]

from draftsmith.runtime.files import atomic_write_json, atomic_write_text  # noqa: E402
from draftsmith.runtime.hardware import cpu_facts  # noqa: E402

DECODE = r"""
import json, os, sys, time
import draftsmith  # first: the job's OpenMP policy is chosen before torch loads libgomp
import torch
from draftsmith.runtime.files import set_threads
from draftsmith.data.prompts import prompt_turns
from draftsmith.bench.specdec import greedy_generate, prompt_ids, stop_ids
from draftsmith.targets.model import load_target
set_threads(int(sys.argv[2]))
model, tok = load_target(sys.argv[1], dtype=torch.float32)
rows = [json.loads(l) for l in open(sys.argv[3])][: int(sys.argv[4])]
stops = stop_ids(model, tok)
greedy_generate(model, prompt_ids(tok, prompt_turns(rows[0])), 8, stops)  # warm-up
n, t0 = 0, time.perf_counter()
for r in rows:
    n += len(greedy_generate(model, prompt_ids(tok, prompt_turns(r)), 64, stops))
print(json.dumps({"tokens": n, "seconds": time.perf_counter() - t0,
                  "threads_used": torch.get_num_threads(),
                  "decision": os.environ.get("DRAFTSMITH_OMP_DECISION")}))
"""


def policy_env(policy: str, threads: int) -> tuple[dict, int]:
    """(environment, threads) of a policy name such as `spin`, `passive@1`, `spin20000`."""
    name, _, t = policy.partition("@")
    drop = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "DRAFTSMITH_OMP", "DRAFTSMITH_OMP_DECISION")
    env = {k: v for k, v in os.environ.items() if k not in drop}
    if name == "auto":  # what a workflow job does (draftsmith/runtime/threads.py)
        env["DRAFTSMITH_OMP"] = "auto"
    elif name == "passive":
        env["OMP_WAIT_POLICY"] = "PASSIVE"
    elif name.startswith("spin") and name != "spin":
        env["GOMP_SPINCOUNT"] = name.removeprefix("spin")
    elif name != "spin":
        raise SystemExit(f"unknown policy {policy!r}")
    env["PYTHONPATH"] = str(ROOT)
    return env, int(t) if t else threads


def busy(n: int) -> list[subprocess.Popen]:
    return [
        subprocess.Popen([sys.executable, "-c", "while True: pass"], start_new_session=True)
        for _ in range(n)
    ]


def heldout_file(run: Path, out: Path) -> Path:
    """The held-out prompts of the run's config (what the benchmark stage decodes)."""
    from draftsmith.data.prompts import load_sources

    rows = load_sources(run_config(run)).heldout
    out.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return out


def run_config(run: Path) -> dict:
    import yaml
    from snakemake.utils import validate

    cfg = yaml.safe_load((run / "config.yaml").read_text()) or {}
    validate(cfg, str(ROOT / "draftsmith" / "config" / "config.schema.yaml"), set_default=True)
    return cfg


def run_decode(run: Path, env: dict, threads: int, prompts: Path, n: int) -> float:
    res = subprocess.run(
        [sys.executable, "-c", DECODE, str(run / "results" / "target"), str(threads), str(prompts),
         str(n)],
        env=env, capture_output=True, text=True, check=True,
    )  # fmt: skip
    r = json.loads(res.stdout.strip().splitlines()[-1])
    return r["tokens"] / r["seconds"], r["threads_used"], r["decision"]


def train_job(run: Path, env: dict, threads: int, work: Path, **train) -> tuple[list, str]:
    """`draftsmith.train.loop` on the run's shards from a fresh state directory, with `train` keys
    overriding the run's train section: (metrics records, the job's log)."""
    cfg = run_config(run)
    tcfg = {**cfg["train"], "checkpoint_every": 0, "checkpoint_seconds": 0, **train}
    sections = {"train": tcfg, "draft": cfg["draft"], "capture": cfg["capture"]}
    state = work / f"state-{time.monotonic_ns()}"
    shards = sorted(str(p) for p in (run / "results" / "hidden").glob("rows_*.safetensors"))
    res = subprocess.run(
        [sys.executable, "-m", "draftsmith", "train-rank", "--cfg", json.dumps(sections), "--shards",
         *shards, "--vocab", str(run / "results/vocab/vocab.safetensors"), "--target",
         str(run / "results/target"), "--out", str(state / "draft"), "--metrics",
         str(state / "metrics.jsonl"), "--state", str(state), "--threads", str(threads),
         "--device", "cpu"],
        env=env, capture_output=True, text=True, check=True,
    )  # fmt: skip
    records = [json.loads(ln) for ln in (state / "metrics.jsonl").read_text().splitlines()]
    return records, res.stderr


def timed_rate(records: list[dict]) -> tuple[float, float]:
    """(tokens/s, seconds per step) of the records after the first two (warm-up)."""
    timed = records[2:]
    seconds = sum(r["tokens"] / r["tokens_per_s"] for r in timed)
    return sum(r["tokens"] for r in timed) / seconds, seconds / len(timed)


def run_train(run: Path, env: dict, threads: int, steps: int, work: Path):
    records, log = train_job(run, env, threads, work, max_steps=steps)
    used = "capped" if "threads capped at" in log else str(threads)
    why = next((ln for ln in log.splitlines() if "threads: OpenMP" in ln), None)
    return timed_rate(records)[0], used, why


def measure(args, prompts: Path) -> list[dict]:
    rows = []
    for load in args.load:
        for policy in args.policies:
            env, threads = policy_env(policy, args.threads)
            procs = busy(load)
            try:
                time.sleep(1.0)
                for stage in args.stages:
                    t0 = time.perf_counter()
                    if stage == "decode":
                        tps, used, why = run_decode(args.run, env, threads, prompts, args.prompts)
                    else:
                        tps, used, why = run_train(
                            args.run, env, threads, args.train_steps, args.work
                        )
                    row = {"stage": stage, "policy": policy, "threads": used, "load": load,
                           "tokens_per_s": tps, "wall_s": time.perf_counter() - t0,
                           "decision": why}  # fmt: skip
                    print(json.dumps(row), flush=True)
                    rows.append(row)
            finally:
                for p in procs:
                    p.kill()
                    p.wait()
    return rows


def render(rows: list[dict], facts: dict, cpus: int) -> str:
    lines = [
        f"# OpenMP policy under contention ({facts['kind']})",
        "",
        f"CPU: {facts['model']}, torch capability {facts['capability']}, {cpus} cores. "
        "Load = busy pure-Python processes at normal priority beside the job. 'of idle' = "
        "tokens/s as a fraction of the same policy at load 0; fair share = cores / (cores + "
        "load) when the job's threads count as one process per core.",
        "",
        "| stage | policy | threads | load | tokens/s | of idle | fair share |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    idle = {(r["stage"], r["policy"]): r["tokens_per_s"] for r in rows if r["load"] == 0}
    for r in rows:
        base = idle.get((r["stage"], r["policy"]))
        frac = f"{r['tokens_per_s'] / base:.2f}" if base else "-"
        fair = f"{cpus / (cpus + r['load']):.2f}"
        lines.append(
            f"| {r['stage']} | {r['policy']} | {r['threads']} | {r['load']} | "
            f"{r['tokens_per_s']:.1f} | {frac} | {fair} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--run", type=Path, required=True, help="a finished run's directory")
    ap.add_argument("--load", type=int, nargs="+", default=[0, 2])
    ap.add_argument("--policies", nargs="+", default=["auto", "spin", "passive", "passive@1"])
    ap.add_argument("--stages", nargs="+", default=["decode", "train"])
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--train-steps", type=int, default=12)
    ap.add_argument("--work", type=Path, default=ROOT / "benchmarks" / "work" / "contention")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    args = ap.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    facts = cpu_facts().as_dict()
    prompts = heldout_file(args.run, args.work / "heldout.jsonl")
    rows = measure(args, prompts)
    name = f"contention_{facts['kind']}"
    record = {"cpu": facts, "cpus": os.cpu_count(), "args": vars(args), "rows": rows}
    atomic_write_json(args.out / f"{name}.json", json.loads(json.dumps(record, default=str)))
    atomic_write_text(args.out / f"{name}.md", render(rows, facts, os.cpu_count()))
    print(f"wrote {args.out / name}.{{json,md}}")


if __name__ == "__main__":
    main()
