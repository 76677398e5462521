"""EAGLE-3, EAGLE-3.1 and DFlash trained on the same rows with the same budget, several seeds
each: held-out and HumanEval tau, acceptance by position, speedup through the hf engine,
training tokens/s; mean and spread over seeds, ratios against EAGLE-3 of the same run.

    nice -n 19 python benchmarks/bench_algorithms.py [--workdir DIR] [--from-run DIR]
        [--algorithms eagle3 eagle3.1 dflash] [--seeds 0 1 2] [--max-steps N]
        [--heldout N] [--humaneval N] [--max-new-tokens N] [--cores N]
    python benchmarks/bench_algorithms.py --summarize-only      (re-render from the JSON)

1. Copies the repository's tracked files into DIR/base (default benchmarks/work/algorithms)
   and runs `snakemake --cores N` there for the captured shards and the draft vocabulary only
   (results/hidden/*, results/vocab/vocab.safetensors). With --from-run, the results of an
   earlier run of the default (its results/{target,data,tokens,vocab,hidden,env}, .snakemake
   metadata and resources/) are copied in first; Snakemake itself then decides what is up to
   date for this commit, and the JSON records whether it rebuilt anything.
2. Per algorithm and seed (seed-major order, so an interrupted run has every algorithm at the
   first seeds): a copy of the base whose results/ are hard links, then
   `snakemake --cores N results/bench/report.json` with `draft.algorithm`, `train.seed`,
   `train.max_steps` and the bench sizes set on the command line (everything else the
   embedded default's), so training and the benchmark run the workflow's own commands.
   bench.smoke is set: an under-trained draft must not fail the rule's tau gate (the gate is a
   sanity check of a full run, not of this budget).
3. After every run, writes benchmarks/results/algorithms_<CPU kind>.{json,md} (and a PNG at the
   end when matplotlib is importable): per run the figures, per algorithm mean and sample
   standard deviation over seeds, and the ratio of each mean to EAGLE-3's mean of this run.

Training tokens/s is the training loop's own rate (trained tokens / summed step seconds from
results/train/metrics.jsonl: padding not counted, loading and export excluded).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

from bench_job_threads import copy_tracked, fmt, git_info, machine, table  # noqa: E402

from draftsmith.runtime.files import atomic_write_json, atomic_write_text  # noqa: E402

ALGORITHMS = ("eagle3", "eagle3.1", "dflash")
REFERENCE = "eagle3"
# bench.num_steps of every run: the K acceptance is compared at, the same in every results file
BENCH_K = 2
SEEDED = ("target", "data", "tokens", "vocab", "hidden", "env")
# per-run figures that get a mean, a spread and a ratio to EAGLE-3
FIGURES = (
    "heldout_tau",
    "humaneval_tau",
    "heldout_speedup",
    "humaneval_speedup",
    "train_tokens_per_s",
    "final_loss",
)


def mean_sd(values: list[float]) -> dict:
    """Mean, sample standard deviation (None below 2 values), min, max, n."""
    vals = [v for v in values if v is not None]
    if not vals:
        return {"mean": None, "sd": None, "min": None, "max": None, "n": 0}
    sd = statistics.stdev(vals) if len(vals) > 1 else None
    return {
        "mean": statistics.fmean(vals),
        "sd": sd,
        "min": min(vals),
        "max": max(vals),
        "n": len(vals),
    }


def per_position(runs: list[dict], set_name: str) -> list[float] | None:
    """Mean acceptance rate by position over runs (positions all runs have)."""
    rows = [r["sets"][set_name]["accept_rate_by_pos"] for r in runs if set_name in r["sets"]]
    if not rows:
        return None
    width = min(len(a) for a in rows)
    return [statistics.fmean(a[i] for a in rows) for i in range(width)]


def summarize(runs: list[dict]) -> dict:
    """Per algorithm: each figure's mean / spread over seeds, acceptance by position, and the
    ratio of each mean to the reference algorithm's mean (same run)."""
    by_algo: dict[str, list[dict]] = {}
    for r in runs:
        by_algo.setdefault(r["algorithm"], []).append(r)
    out = {}
    for algo, rs in by_algo.items():
        figs = {f: mean_sd([r["figures"].get(f) for r in rs]) for f in FIGURES}
        out[algo] = {
            "seeds": sorted(r["seed"] for r in rs),
            "figures": figs,
            "accept_by_pos": {s: per_position(rs, s) for s in ("heldout", "humaneval")},
        }
    ref = out.get(REFERENCE)
    for s in out.values():
        s["ratio_to_eagle3"] = {
            f: (
                s["figures"][f]["mean"] / ref["figures"][f]["mean"]
                if ref and s["figures"][f]["mean"] is not None and ref["figures"][f]["mean"]
                else None
            )
            for f in FIGURES
        }
    return out


def figures_of(report: dict, metrics: list[dict]) -> dict:
    """The per-run figures from results/bench/report.json and results/train/metrics.jsonl."""
    sets = report.get("sets", {})
    step_s = sum(m["tokens"] / m["tokens_per_s"] for m in metrics if m.get("tokens_per_s"))
    tokens = sum(m["tokens"] for m in metrics)
    fig = {
        "train_tokens_per_s": tokens / step_s if step_s else None,
        "final_loss": metrics[-1]["loss"] if metrics else None,
    }
    for name in ("heldout", "humaneval"):
        s = sets.get(name) or {}
        fig[f"{name}_tau"] = s.get("tau")
        fig[f"{name}_speedup"] = s.get("speedup")
    return fig


def last_acc0(metrics: list[dict], last: int = 10) -> float | None:
    """Training top-1 accuracy at draft position 0, mean over the last `last` steps."""
    accs = [m["acc_per_pos"][0] for m in metrics[-last:] if m.get("acc_per_pos")]
    return statistics.fmean(accs) if accs else None


def run_cmd(cmd: list[str], cwd: Path, log: Path) -> float:
    """Run cmd in cwd (output to log); wall seconds; a failure names the log."""
    print("$", " ".join(cmd), f"(in {cwd}, log {log})", flush=True)
    t0 = time.perf_counter()
    with open(log, "a") as f:
        rc = subprocess.run(cmd, cwd=cwd, stdout=f, stderr=subprocess.STDOUT).returncode
    if rc != 0:
        raise SystemExit(f"{' '.join(cmd)} failed ({rc}); see {log}")
    return time.perf_counter() - t0


DATA_TARGETS = ("hidden", "results/vocab/vocab.safetensors")  # rule hidden: shards + plan


def prepare_base(args, base: Path, config: dict | None = None) -> dict:
    """Copy the project, seed it from --from-run, build the shards and vocabulary (`config`:
    sections written into the copy's config.yaml over the embedded default, which every run
    made from the base then reads too)."""
    n = copy_tracked(ROOT, base)
    if config:
        path = base / "config.yaml"
        atomic_write_text(path, path.read_text() + "\n" + yaml.safe_dump(config, sort_keys=False))
    seeded = []
    if args.from_run:
        src = Path(args.from_run)
        for d in SEEDED:
            if (src / "results" / d).exists():
                shutil.copytree(src / "results" / d, base / "results" / d, symlinks=True)
                seeded.append(f"results/{d}")
        for d in (".snakemake", "resources"):
            if (src / d).exists():
                shutil.copytree(src / d, base / d, symlinks=True)
                seeded.append(d)
    log = base / "data.log"
    targets = list(DATA_TARGETS)
    wall = run_cmd(["snakemake", "--cores", str(args.cores), *targets], base, log)
    built = "Nothing to be done" not in log.read_text()
    return {
        "files": n,
        "seeded_from": args.from_run,
        "seeded": seeded,
        "targets": targets,
        "wall_s": wall,
        "rebuilt": built,
        "config": config or {},
    }


def run_config(
    args, algorithm: str, seed: int, draft: dict | None = None, train: dict | None = None
) -> list[str]:
    """The --config overrides of one run: only algorithm and seed differ between runs (and
    `draft` and `train`, more keys of those sections, for benchmarks/bench_training_choices.py's
    variants)."""
    train = {**(train or {}), "seed": seed, "max_steps": args.max_steps}
    bench = {
        "heldout_size": args.heldout,
        "humaneval_size": args.humaneval,
        "max_new_tokens": args.max_new_tokens,
        "num_steps": args.num_steps,
        "smoke": True,
    }
    return [
        f"draft={json.dumps({'algorithm': algorithm, **(draft or {})})}",
        f"train={json.dumps(train)}",
        f"bench={json.dumps(bench)}",
    ]


def one_run(
    args,
    base: Path,
    algorithm: str,
    seed: int,
    draft: dict | None = None,
    label: str = "",
    train: dict | None = None,
) -> dict:
    """Train and benchmark one (algorithm, seed) in a copy of the base sharing its results
    (`draft`, `train`: more keys of those sections; `label`: the work directory's name before
    the seed)."""
    work = Path(args.workdir) / f"{label or algorithm}_s{seed}"
    if work.exists():
        shutil.rmtree(work)
    work.mkdir(parents=True)
    for entry in base.iterdir():
        if entry.name == "results":
            shutil.copytree(entry, work / "results", copy_function=os.link)
        elif entry.is_dir():
            shutil.copytree(entry, work / entry.name, symlinks=True)
        else:
            shutil.copy2(entry, work / entry.name, follow_symlinks=False)
    cfg = run_config(args, algorithm, seed, draft, train)
    load0 = os.getloadavg()[0]
    wall = run_cmd(
        ["snakemake", "--cores", str(args.cores), "results/bench/report.json", "--config", *cfg],
        work,
        work / "run.log",
    )
    report = json.loads((work / "results/bench/report.json").read_text())
    lines = (work / "results/train/metrics.jsonl").read_text().splitlines()
    metrics = [json.loads(ln) for ln in lines if ln.strip()]
    keys = (
        "prompts",
        "tau",
        "tau_sglang",
        "accept_rate_by_pos",
        "speedup",
        "spec_tokens_per_s",
        "baseline_tokens_per_s",
        "identical_outputs",
        "load",
        "speedup_verdict",
    )
    sets = {k: {x: s.get(x) for x in keys} for k, s in report.get("sets", {}).items()}
    return {
        "algorithm": algorithm,
        "seed": seed,
        "config": cfg,
        "wall_s": wall,
        "loadavg_1min_before": load0,
        "loadavg_1min_after": os.getloadavg()[0],
        "train_steps": len(metrics),
        "threads": thread_choices(work),
        "work": str(work),
        "figures": figures_of(report, metrics),
        "train_acc0_last": last_acc0(metrics),
        "sets": sets,
        "method": report.get("method"),
    }


def thread_choices(work: Path) -> dict:
    """What each job chose for its threads at start (draftsmith.runtime.threads logs one line: spinning
    on free cores, or passive with fewer threads under other load): per stage, the line."""
    out = {}
    for stage, log in (("train", "logs/train.log"), ("bench", "logs/bench/bench.log")):
        path = work / log
        lines = path.read_text().splitlines() if path.is_file() else []
        found = [ln.split("threads: ", 1)[1] for ln in lines if "INFO threads: " in ln]
        out[stage] = found[0] if found else None
    return out


def verdict(x: dict) -> str:
    """The bench's verdict on its held-out speedup: comparable, or why not (load changed)."""
    v = (x["sets"].get("heldout") or {}).get("speedup_verdict") or {}
    if not v:
        return "n/a"
    return ("yes" if v.get("comparable") else "no") + f" ({v.get('why', '')})"


def cell(f: dict, spec: str = ".3f") -> str:
    """mean ± sd [min-max] over seeds."""
    if f["mean"] is None:
        return "n/a"
    if f["sd"] is None:
        return fmt(f["mean"], spec)
    return f"{fmt(f['mean'], spec)} ± {fmt(f['sd'], spec)}"


def merged_note(r: dict) -> list[str]:
    """A paragraph when runs of several invocations were merged (--merge)."""
    others = r.get("merged_data") or []
    if not others:
        return []
    fresh = sum(1 for d in others if not d["rebuilt"])
    return [
        f"The runs come from {len(others) + 1} invocations of this script with this budget, "
        "partly side by side (up to 3 runs at once on the 2 cores), merged with --merge; "
        f"Snakemake found the shards up to date in {fresh} of the other {len(others)} work "
        "directories. Running side by side changes wall times and tokens/s, not tau (greedy "
        "verification of a deterministic draft).",
        "",
    ]


def render_md(r: dict) -> str:
    m, b, s = r["machine"], r["budget"], r["summary"]
    f = m["cpu_facts"]
    lines = [
        f"# Draft algorithms on the same rows: {', '.join(s)} (CPU {f['kind']})",
        "",
        f"CPU {m['cpu']} (kind {f['kind']}), {m['cores']} cores shared with other jobs; torch "
        f"{m['torch']}; commit {m['git_commit'][:12]}{' (dirty)' if m['git_dirty'] else ''}. "
        f"Data: the embedded default's (SmolLM2-135M-Instruct, config.yaml), {r['data_note']}",
        "",
        f"Budget per run (the same for every algorithm): train.max_steps {b['max_steps']} "
        f"(the embedded default's 5 epochs ran {b['default_steps']} steps in "
        "benchmarks/results/default_run_AVX512-AMX.md), every other train/draft/capture key "
        f"at the embedded default; bench: {b['heldout']} held-out and {b['humaneval']} "
        f"HumanEval prompts, {b['max_new_tokens']} new tokens each, hf engine, "
        f"`bench.num_steps` {budget_value(b, 'num_steps')}. Seeds {b['seeds']} (train.seed). "
        f"Runs measured: {len(r['runs'])} of {b['planned']} planned. Machine load (1-min load "
        "average, 2 cores) "
        f"from {r['load_range'][0]:.1f} to {r['load_range'][1]:.1f} during the runs, all jobs at "
        "nice 19: speedups and tokens/s are of a loaded machine and noisier than tau.",
        "",
        *merged_note(r),
        "Mean ± sample standard deviation over seeds (no ± with one seed); ratio = this "
        "algorithm's mean / EAGLE-3's mean in this same run. Final loss is each algorithm's own "
        "objective (EAGLE-3 / 3.1: the training-time-test loss summed over its steps; DFlash: "
        "its weighted block cross-entropy), so it compares seeds, not algorithms. Acceptance at "
        "position k is over the passes whose proposals reached k.",
        "",
    ]
    head = (
        "algorithm | seeds | held-out tau | HumanEval tau | held-out speedup | "
        "HumanEval speedup | train tok/s | final loss | tau ratio (held-out)"
    )
    rows = []
    for algo, a in s.items():
        fg = a["figures"]
        rows.append(
            f"{algo} | {len(a['seeds'])} | {cell(fg['heldout_tau'])} | "
            f"{cell(fg['humaneval_tau'])} | {cell(fg['heldout_speedup'])} | "
            f"{cell(fg['humaneval_speedup'])} | {cell(fg['train_tokens_per_s'], '.0f')} | "
            f"{cell(fg['final_loss'], '.2f')} | {fmt(a['ratio_to_eagle3']['heldout_tau'])}"
        )
    lines += table(head, rows)
    lines += ["", "Ratios to EAGLE-3 (mean / mean):", ""]
    rows = [
        f"{algo} | " + " | ".join(fmt(a["ratio_to_eagle3"][k]) for k in FIGURES)
        for algo, a in s.items()
    ]
    lines += table("algorithm | " + " | ".join(FIGURES), rows)
    lines += position_lines(s, "algorithm")
    lines += ["", "Per run:", ""]
    rows = [
        f"{x['algorithm']} | {x['seed']} | {x['train_steps']} | "
        f"{fmt(x['figures']['heldout_tau'])} | {fmt(x['figures']['humaneval_tau'])} | "
        f"{fmt(x['figures']['heldout_speedup'])} | {fmt(x['figures']['train_tokens_per_s'], '.0f')}"
        f" | {x['wall_s']:.0f} | {x['loadavg_1min_before']:.1f} / {x['loadavg_1min_after']:.1f}"
        f" | {(x.get('threads') or {}).get('train') or 'n/a'} | {verdict(x)}"
        for x in r["runs"]
    ]
    lines += table(
        "algorithm | seed | steps | held-out tau | HumanEval tau | held-out speedup | train tok/s "
        "| wall s (train + bench) | load before / after | training threads (at its start) "
        "| held-out speedup comparable (the bench's own verdict)",
        rows,
    )
    if r["runs"]:
        lines += ["", r["runs"][0]["method"] or ""]
    return "\n".join(lines) + "\n"


def position_lines(summary: dict, label: str) -> list[str]:
    """The acceptance rate by draft position of each summarised entry (`label`: its column
    name), per set, as markdown lines."""
    rows = [
        f"{name} | {set_name} | " + ", ".join(fmt(x) for x in a["accept_by_pos"][set_name])
        for name, a in summary.items()
        for set_name in ("heldout", "humaneval")
        if a["accept_by_pos"][set_name]
    ]
    head = ["", "Acceptance rate by draft position (mean over seeds):", ""]
    return head + table(f"{label} | set | accept by position", rows)


def plot(r: dict, path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, ax = plt.subplots(figsize=(6, 3.5))
    for algo, a in r["summary"].items():
        acc = a["accept_by_pos"]["heldout"] or []
        ax.plot(range(1, len(acc) + 1), acc, marker="o", label=algo)
    ax.set_xlabel("draft position")
    ax.set_ylabel("acceptance rate (held-out)")
    ax.set_title(f"acceptance by position, CPU {r['machine']['cpu_facts']['kind']}")
    ax.legend()
    fig.tight_layout()
    tmp = path.with_suffix(".tmp.png")
    fig.savefig(tmp, dpi=100)
    os.replace(tmp, path)
    return True


def write(r: dict, out: Path, name: str) -> None:
    runs = r["runs"]
    r["summary"] = summarize(runs)
    loads = [x for run in runs for x in (run["loadavg_1min_before"], run["loadavg_1min_after"])]
    r["load_range"] = (min(loads), max(loads)) if loads else (0.0, 0.0)
    atomic_write_json(out / f"{name}.json", r)
    atomic_write_text(out / f"{name}.md", render_md(r))


def merge(r: dict, others: list[dict]) -> None:
    """Add the runs of other invocations (same budget, e.g. run side by side with other
    --algorithms / --seeds and --out) that r does not have; planned becomes the union."""
    keys = ("max_steps", "heldout", "humaneval", "max_new_tokens", "num_steps")
    for o in others:
        if any(budget_value(o["budget"], k) != budget_value(r["budget"], k) for k in keys):
            raise SystemExit(f"--merge: another budget ({o['budget']}) than {r['budget']}")
        have = {(x["algorithm"], x["seed"]) for x in r["runs"]}
        r["runs"] += [x for x in o["runs"] if (x["algorithm"], x["seed"]) not in have]
        seeds = sorted({*r["budget"]["seeds"], *o["budget"]["seeds"]})
        r["budget"]["seeds"] = seeds
        r["budget"]["planned"] = len(seeds) * len(ALGORITHMS)
        r.setdefault("merged_data", []).append(o["data"])
    order = {a: i for i, a in enumerate(ALGORITHMS)}
    r["runs"].sort(key=lambda x: (x["seed"], order[x["algorithm"]]))


def budget_value(budget: dict, key: str):
    """A results file's budget entry; files written before `num_steps` was recorded ran the
    workflow's default of then, BENCH_K."""
    return budget.get(key, BENCH_K) if key == "num_steps" else budget[key]


def budget_args(p: argparse.ArgumentParser, work: str) -> None:
    """The options of a seeds-and-budget benchmark over the default's data (this one and
    bench_training_choices.py): `work`, the work directory's name under benchmarks/work."""
    p.add_argument("--workdir", default=str(ROOT / "benchmarks" / "work" / work))
    p.add_argument("--from-run", help="a finished run of the default whose data to reuse")
    p.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    p.add_argument("--max-steps", type=int, default=0, help="train.max_steps (0: all epochs)")
    p.add_argument("--heldout", type=int, default=16)
    p.add_argument("--humaneval", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument(
        "--num-steps",
        type=int,
        default=BENCH_K,
        help=f"bench.num_steps, the K acceptance is compared at (default {BENCH_K}: the "
        "workflow's default 1 caps tau at 2 and shows the first draft position only)",
    )
    p.add_argument("--cores", type=int, default=2)
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    p.add_argument("--summarize-only", action="store_true")


def new_base(args, config: dict | None = None) -> tuple[Path, dict, str]:
    """The base project in an empty `args.workdir`/base: its shards and vocabulary built
    (prepare_base, with `config` over the default), and the sentence that says how."""
    base = Path(args.workdir) / "base"
    if base.exists():
        raise SystemExit(f"{base}: exists; a run starts from an empty work directory")
    base.mkdir(parents=True)
    data = prepare_base(args, base, config)
    note = (
        f"shards and vocabulary by the workflow in {base} ({data['wall_s']:.0f} s; "
        + ("rebuilt by Snakemake" if data["rebuilt"] else "Snakemake found them up to date")
        + (f", seeded from {data['seeded_from']})." if data.get("seeded_from") else ").")
    )
    return base, data, note


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    budget_args(p, "algorithms")
    p.add_argument("--algorithms", nargs="+", default=list(ALGORITHMS), choices=ALGORITHMS)
    p.add_argument(
        "--merge",
        nargs="*",
        default=[],
        help="with --summarize-only: JSON files of "
        "other invocations with the same budget whose runs to add",
    )
    return p.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    from draftsmith.runtime.hardware import cpu_facts

    out, name = Path(args.out), f"algorithms_{cpu_facts().kind}"
    if args.summarize_only:
        r = json.loads((out / f"{name}.json").read_text())
        for x in r["runs"]:  # runs recorded before the thread lines were
            work = Path(args.workdir) / f"{x['algorithm']}_s{x['seed']}"
            x.setdefault("threads", thread_choices(work))
        merge(r, [json.loads(Path(f).read_text()) for f in args.merge])
        write(r, out, name)
        plot(r, out / f"{name}.png")
        return
    base, data, note = new_base(args)
    r = {
        "machine": machine(git_info(ROOT)),
        "data": data,
        "data_note": note,
        "budget": {
            "max_steps": args.max_steps,
            "default_steps": 370,
            "heldout": args.heldout,
            "humaneval": args.humaneval,
            "max_new_tokens": args.max_new_tokens,
            "num_steps": args.num_steps,
            "seeds": args.seeds,
            "planned": len(args.seeds) * len(args.algorithms),
        },
        "runs": [],
    }
    for seed in args.seeds:
        for algo in args.algorithms:
            r["runs"].append(one_run(args, base, algo, seed))
            write(r, out, name)
    write(r, out, name)
    plot(r, out / f"{name}.png")


if __name__ == "__main__":
    main()
