"""The benchmark: speculative decoding with the trained draft on every benchmark set, the report.

For each set (held-out rows of the data sources, HumanEval, user JSONL files) the engine named by
`bench.backend` (`draftsmith.engines`) generates every prompt twice: with speculative decoding
by the draft and with plain decoding of the target, each side timed with the warm-up excluded,
and returns what it measured (token ids, verification passes, accepted-length histograms,
seconds). `draftsmith.bench.figures` computes every figure from that, the same way for every
engine: the speedup is a ratio measured in one run on one machine, and the outputs are compared
token for token (greedy verification is lossless). Where the engine samples (bench.temperature
> 0) both sides sample: equal in distribution, not token for token. This module loads the sets,
computes the figures, gates, and writes the report and plots.

The sanity gate (`draftsmith.bench.gate`): a set whose tau is under `bench.tau_floor`, or exactly 1.0, fails the rule with
the list of likely causes. Nothing is written then: a broken draft never yields a report that
looks like a result. A smoke test (`bench.smoke: true`: a random-weight or tiny target, a few
training steps) checks the gate the same way but only reports it: report.json's "gate" and the
first lines of report.md and summary.html say that the gate failed and was not enforced.

CLI (rule bench):
    python -m draftsmith bench --cfg <json> --draft results/draft --target results/target
        --metrics results/train/metrics.jsonl --env-stamp results/env/cpu.json
        --threads N --report-json results/bench/report.json --report-md results/bench/report.md
        --summary-html results/bench/summary.html --acceptance results/bench/acceptance.png
        --hist results/bench/accept_hist.png --training results/bench/training.png
summary.html is the table and the plots on one self-contained page (for `snakemake --report`,
which shows HTML inline but offers markdown only as a download).
"""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path

from draftsmith import algorithms
from draftsmith.algorithms.offline import bench_entry as offline_estimate
from draftsmith.algorithms.offline import text as offline_text
from draftsmith.bench.figures import bench_figures, pass_floor_text
from draftsmith.bench.gate import GateError, check_gate, gate, gate_line  # noqa: F401 (re-exported)
from draftsmith.config import settings
from draftsmith.config.settings import BenchSettings, JobSettings
from draftsmith.runtime.files import (
    atomic_path,
    atomic_write_json,
    atomic_write_text,
    command_parser,
    init_logging,
    merge_run,
    parse_cfg,
    sha256_file,
    versions,
)

log = logging.getLogger("draftsmith.stages.bench")

# ---------------------------------------------------------------- benchmark sets


def load_sets(job: JobSettings, skipped: dict | None = None) -> dict[str, list[dict]]:
    """name -> conversations (each {"id", "source", "conversations"}), in report order;
    `skipped`, when given, gets each file set's bad-row counts (draftsmith.bench.inputs). The
    held-out rows come from the data section as given (draftsmith.data.prompts.load_sources)."""
    from draftsmith.data.prompts import SourceError, load_humaneval, load_sources, read_source

    bench = job.bench
    sets: dict[str, list[dict]] = {}
    try:
        if bench.heldout_size:
            heldout = load_sources(job.given).heldout
            if bench.heldout_size > len(heldout):
                raise SystemExit(
                    f"bench.heldout_size={bench.heldout_size} but data.heldout_rows holds "
                    f"only {len(heldout)} rows; raise data.heldout_rows or lower heldout_size"
                )
            sets["heldout"] = heldout[: bench.heldout_size]
        if bench.humaneval_size:
            sets["humaneval"] = load_humaneval(bench.humaneval_size)
        for spec in bench.files:
            name = spec.name
            if not name or name in sets:
                raise SystemExit(f"bench.files: set name {name!r} is empty or used twice")
            rows, report = read_source(
                {"format": spec.format, "path": spec.path, "max_rows": spec.size}
            )
            if not rows:
                raise SystemExit(f"bench.files: {spec.path} has no valid rows ({report})")
            sets[name] = rows
            if skipped is not None:
                skipped[name] = report
    except SourceError as e:
        raise SystemExit(str(e)) from None
    if not sets:
        raise SystemExit("no benchmark set: bench.heldout_size, humaneval_size and files are empty")
    return sets


# ---------------------------------------------------------------- running


# ---------------------------------------------------------------- report


def draft_fingerprint(draft_dir: Path) -> dict:
    return {
        name: sha256_file(draft_dir / name)
        for name in ("config.json", "model.safetensors")
        if (draft_dir / name).is_file()
    }


def read_metrics(path: Path) -> list[dict]:
    records = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise SystemExit(f"{path}: line {lineno} is not JSON ({e.msg})") from None
    if not records:
        raise SystemExit(f"{path} has no training records")
    return records


def training_summary(records: list[dict]) -> dict:
    tail = records[-max(1, len(records) // 10) :]  # last 10% of steps
    k = len(tail[-1].get("acc_per_pos", []))
    return {
        "steps": int(records[-1]["step"]),
        "final_loss": sum(r["loss"] for r in tail) / len(tail),
        "final_acc_per_pos": [sum(r["acc_per_pos"][j] for r in tail) / len(tail) for j in range(k)],
    }


def _fmt_list(values: list[float | None]) -> str:
    return " / ".join("n/a" if v is None else f"{v:.2f}" for v in values)


TABLE_HEAD = (
    "set",
    "prompts",
    "tau",
    "tau (SGLang count)",
    "accept rate by position",
    "tok/s spec",
    "tok/s greedy",
    "speedup",
    "pass cost (greedy steps)",
    "identical to greedy",
)


def table_head(report: dict) -> tuple[str, ...]:
    """TABLE_HEAD, its baseline named "sampling" where the run sampled (bench.temperature > 0)."""
    if not report.get("sampling"):
        return TABLE_HEAD
    return tuple(h.replace("greedy", "sampling") for h in TABLE_HEAD)


def table_rows(report: dict) -> list[list[str]]:
    """The summary table, one row per set (shared by report.md and summary.html)."""
    return [
        [
            name,
            str(r["prompts"]),
            f"{r['tau']:.3f}",
            f"{r['tau_sglang']:.3f}",
            _fmt_list(r["accept_rate_by_pos"]),
            f"{r['spec_tokens_per_s']:.1f}",
            f"{r['baseline_tokens_per_s']:.1f}",
            speedup_cell(r),
            f"{r['pass_cost']:.2f}",
            identical_cell(r),
        ]
        for name, r in report["sets"].items()
    ]


def identical_cell(r: dict) -> str:
    """Outputs equal to the baseline's; n/a when sampled (bench.temperature > 0: the outputs are
    equal in distribution, not token for token)."""
    if r["identical_outputs"] is None:
        return "n/a (sampled)"
    return f"{r['identical_outputs']}/{r['prompts']}"


def speedup_cell(r: dict) -> str:
    """The speedup as the table shows it: not called one when the load changed while timing."""
    v = r.get("speedup_verdict", {})
    if v.get("comparable") is False:
        return f"n/a (load changed; {r['speedup']:.2f}x)"
    return f"{r['speedup']:.2f}x" + (" (busy cores)" if v.get("loaded") else "")


def judge_speedups(results: dict, meter_summary: dict, threads: int) -> None:
    """Attach to every set the load its timings saw and whether its speedup is one
    (draftsmith.runtime.load.verdict): per side where the engine timed the sides under a LoadMeter,
    else the whole engine run's load, which cannot tell a change between the sides."""
    from draftsmith.runtime.load import verdict

    for r in results.values():
        if "load" in r:
            r["speedup_verdict"] = verdict(r["load"], "spec", "base", threads)
        else:
            r["load"] = meter_summary
            cores = meter_summary.get("other_work_cores", {}).get("run")
            why = "the engine times both sides itself; other work over the whole run: " + (
                "not measured" if cores is None else f"{cores:.2f} cores"
            )
            r["speedup_verdict"] = {"comparable": None, "why": why}


def load_text(report: dict) -> str:
    return (
        "Load while timing: "
        + "; ".join(
            f"{n}: {r.get('speedup_verdict', {}).get('why', 'not measured')}"
            for n, r in report["sets"].items()
        )
        + "."
    )


def text_blocks(report: dict) -> dict[str, str]:
    """The prose of the report (plain text, shared by report.md and summary.html)."""
    tr = report["training"]
    return {
        "method": report["method"],
        "hist": "; ".join(f"{n}: {r['accept_len_hist']}" for n, r in report["sets"].items()),
        "load": load_text(report),
        "floor": pass_floor_text(report.get("pass_floor")),
        "offline": offline_text(report.get("offline_estimate")),
        "training": (
            f"Training: {tr['steps']} steps{precision_text(tr.get('precision'))}, final loss "
            f"{tr['final_loss']:.3f}, per-position "
            f"accuracy {_fmt_list(tr['final_acc_per_pos'])} (mean of the last 10% of steps)."
        ),
        "provenance": (
            f"Target fingerprint {report['target_fingerprint'][:16]}, draft "
            f"{report['draft_fingerprint'].get('model.safetensors', '?')[:16]}, aux layer ids "
            f"{report['aux_layer_ids']}, draft vocab {report['draft_vocab_size']}; draftsmith "
            f"{report['versions'].get('draftsmith')}, torch {report['versions'].get('torch')}, "
            f"transformers {report['versions'].get('transformers')}."
        ),
    }


def render_md(report: dict, *plots: Path) -> str:
    from draftsmith.bench import levels as benchlevels
    from draftsmith.bench.inputs import input_line

    text = text_blocks(report)
    lines = ["# draftsmith benchmark", ""]
    if gate_line(report):
        lines += [f"**{gate_line(report)}**", ""]
    if report.get("family_warnings"):
        lines += [f"**{FAMILY_HEAD}**", "", *(f"- {w}" for w in report["family_warnings"]), ""]
    lines += [text["method"], ""]
    lines.append("| " + " | ".join(table_head(report)) + " |")
    lines.append("|" + "---|" * len(table_head(report)))
    lines += ["| " + " | ".join(row) + " |" for row in table_rows(report)]
    lines += ["", *benchlevels.markdown(report)]
    lines += [
        *([text["floor"], ""] if text["floor"] else []),
        text["offline"],
        "",
        *([input_line(report["input"]), ""] if "input" in report else []),
        f"Accepted-length histogram (passes accepting 0, 1, ... proposals): {text['hist']}.",
        "",
        text["load"],
        "",
        text["training"],
        "",
        *(f"![{p.stem}]({p.name})" for p in plots),
        "",
        text["provenance"],
        "",
    ]
    return "\n".join(lines)


FAMILY_HEAD = "Before serving (the export's warnings about the target family):"


def family_html(report: dict) -> str:
    import html

    warnings = report.get("family_warnings") or []
    if not warnings:
        return ""
    items = "".join(f"<li>{html.escape(w)}</li>" for w in warnings)
    return f"<p><strong>{html.escape(FAMILY_HEAD)}</strong></p><ul>{items}</ul>"


def render_html(report: dict, *plots: Path, levels_png: bytes | None = None) -> str:
    """One self-contained page: the table, the prose and the plots as data URIs (with the
    concurrency section and its plot where there are several levels: draftsmith.bench.levels)."""
    import base64
    import html

    from draftsmith.bench import levels as benchlevels

    text = {k: html.escape(v) for k, v in text_blocks(report).items()}
    head = "".join(f"<th>{html.escape(h)}</th>" for h in table_head(report))
    body = "".join(
        "<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in row) + "</tr>"
        for row in table_rows(report)
    )
    images = "".join(
        f'<p><img alt="{p.stem}" style="max-width:100%" src="data:image/png;base64,'
        f'{base64.b64encode(p.read_bytes()).decode()}"></p>'
        for p in plots
    )
    style = (
        "body{font-family:sans-serif;max-width:70em;margin:1em auto;line-height:1.4}"
        "table{border-collapse:collapse}td,th{border:1px solid #bbb;padding:.3em .6em}"
        "td{text-align:right}td:first-child{text-align:left}"
    )
    return (
        f"<!doctype html><html><head><meta charset='utf-8'><title>draftsmith benchmark</title>"
        f"<style>{style}</style></head><body><h1>draftsmith benchmark</h1>"
        + (f"<p><strong>{html.escape(gate_line(report))}</strong></p>" if gate_line(report) else "")
        + family_html(report)
        + f"<p>{text['method']}</p><table><tr>{head}</tr>{body}</table>"
        + benchlevels.html(report, levels_png)
        + (f"<p>{text['floor']}</p>" if text["floor"] else "")
        + f"<p>{text['offline']}</p>"
        f"<p>Accepted-length histogram (passes accepting 0, 1, ... proposals): {text['hist']}.</p>"
        f"<p>{text['load']}</p><p>{text['training']}</p>{images}<p><small>{text['provenance']}</small></p>"
        "</body></html>\n"
    )


def _save(fig, path: Path) -> None:
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png", dpi=110, bbox_inches="tight")


def plot_acceptance(sets: dict[str, dict], path: Path) -> None:
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 3.8))
    width = 0.8 / len(sets)
    for s, (name, r) in enumerate(sets.items()):
        xs = [
            j + 1 + (s - (len(sets) - 1) / 2) * width for j in range(len(r["accept_rate_by_pos"]))
        ]
        rates = [0.0 if v is None else v for v in r["accept_rate_by_pos"]]  # unreached: no bar
        ax.bar(xs, rates, width=width, label=f"{name} (tau {r['tau']:.2f})")
        ax.plot(xs, r["reach_rate_by_pos"], "k.", markersize=6)
    ax.set_xlabel("draft position")
    ax.set_ylabel("P(accepted | previous accepted); dots: P(reached)")
    ax.set_title("Acceptance by draft position")
    ax.set_ylim(0, 1)
    ax.set_xticks(range(1, len(next(iter(sets.values()))["accept_rate_by_pos"]) + 1))
    ax.legend(fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    _save(fig, path)
    plt.close(fig)


def plot_hist(sets: dict[str, dict], path: Path) -> None:
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 3.8))
    width = 0.8 / len(sets)
    for s, (name, r) in enumerate(sets.items()):
        hist = r["accept_len_hist"]
        total = sum(hist)
        xs = [a + (s - (len(sets) - 1) / 2) * width for a in range(len(hist))]
        ax.bar(xs, [n / total for n in hist], width=width, label=f"{name} ({total} passes)")
    ax.set_xlabel("draft tokens accepted in a verification pass")
    ax.set_ylabel("fraction of passes")
    ax.set_title("Accepted-length histogram")
    ax.set_xticks(range(len(next(iter(sets.values()))["accept_len_hist"])))
    ax.legend(fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    _save(fig, path)
    plt.close(fig)


def plot_training(records: list[dict], path: Path) -> None:
    import matplotlib.pyplot as plt

    steps = [r["step"] for r in records]
    window = max(1, len(records) // 50)

    def smooth(values):
        return [
            sum(values[max(0, i - window + 1) : i + 1])
            / len(values[max(0, i - window + 1) : i + 1])
            for i in range(len(values))
        ]

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.6))
    ax1.plot(steps, smooth([r["loss"] for r in records]))
    ax1.set_xlabel("step")
    ax1.set_ylabel("loss (TTT-weighted)")
    ax1.set_title("Training loss")
    ax1.grid(alpha=0.3)
    k = len(records[-1].get("acc_per_pos", []))
    for j in range(k):
        ax2.plot(steps, smooth([r["acc_per_pos"][j] for r in records]), label=f"step {j}")
    ax2.set_xlabel("step")
    ax2.set_ylabel("top-1 accuracy vs target")
    ax2.set_title("Training accuracy per TTT position")
    ax2.set_ylim(0, 1)
    ax2.legend(fontsize=7, ncol=2)
    ax2.grid(alpha=0.3)
    _save(fig, path)
    plt.close(fig)


# ---------------------------------------------------------------- CLI


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = command_parser("bench", __doc__)
    ap.add_argument("--cfg", required=True, help="JSON with the bench, data and target sections")
    ap.add_argument("--draft", required=True, type=Path, help="results/draft")
    ap.add_argument("--target", required=True, type=Path, help="results/target")
    ap.add_argument("--metrics", required=True, type=Path, help="results/train/metrics.jsonl")
    ap.add_argument("--env-stamp", required=True, type=Path, help="results/env/<role>.json")
    ap.add_argument("--offline", type=Path, help="results/train/offline_acceptance.json")
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--run", default="", help="run settings JSON (default: $DRAFTSMITH_RUN)")
    for name in ("report-json", "report-md", "summary-html", "acceptance", "hist", "training"):
        ap.add_argument(f"--{name}", required=True, type=Path, help="output file")
    ap.add_argument("--captions", type=Path, help="results/bench/captions (report captions)")
    return ap.parse_args(argv)


def log_figures(results: dict) -> None:
    """One log line of headline figures per set."""
    for name, r in results.items():
        log.info(
            "%s: tau %.3f (SGLang count %.3f), accept by pos %s, %.1f tok/s vs %.1f greedy, "
            "speedup %.2fx",
            name,
            r["tau"],
            r["tau_sglang"],
            _fmt_list(r["accept_rate_by_pos"]),
            r["spec_tokens_per_s"],
            r["baseline_tokens_per_s"],
            r["speedup"],
        )


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    init_logging("draftsmith.stages.bench")
    cfg = parse_cfg(args.cfg)
    # run settings only for the sections this job was given (not the trainer's train keys,
    # which would hide the draft's own train section from the report and its captions)
    cfg = merge_run(cfg, args.run, sections=tuple(cfg))
    job = settings.stage_job(cfg, "bench")

    import matplotlib

    from draftsmith.bench import levels as benchlevels
    from draftsmith.bench.inputs import screen_sets
    from draftsmith.engines import EngineError, engine, load_tokenizer, stop_guard
    from draftsmith.runtime.load import LoadMeter
    from draftsmith.targets.model import fingerprint

    matplotlib.use("Agg")
    bench = job.bench
    refuse_sampling(bench)  # the Snakefile refuses the same (config.check_config)
    skipped: dict[str, dict] = {}
    sets = load_sets(job, skipped)
    tokenizer = load_tokenizer("bench", job, args.target)
    sets, screened = screen_sets(sets, skipped, args.target, job, tokenizer)
    records = read_metrics(args.metrics)
    try:  # the draft's algorithm, resolved once for every engine
        opened = algorithms.open_draft(args.draft)
    except algorithms.AlgorithmError as e:
        raise SystemExit(str(e)) from None
    try:
        bench_sets = engine("bench", bench.backend)
    except EngineError as e:
        raise SystemExit(str(e)) from None
    log.info("sets: %s; backend %s", {n: len(r) for n, r in sets.items()}, bench.backend)
    meter = LoadMeter()
    with stop_guard("bench", bench.backend), meter.phase("run"):
        measured, info = bench_sets(
            sets, job, target=args.target, draft=args.draft, spec=opened.spec, threads=args.threads
        )
    results = bench_figures(measured)
    judge_speedups(results, meter.summary(), int(info.get("threads") or args.threads or 1))
    log_figures(results)
    verdict = check_gate(results, float(bench.tau_floor))
    if not verdict["passed"]:
        if not bench.smoke:
            raise GateError(verdict["message"])
        log.warning("bench.smoke is true: not enforcing the gate. %s", verdict["message"])
    report = {
        "gate": {**verdict, "smoke": bench.smoke},
        "sets": results,
        "config": {**training_config(args.draft), **cfg},
        **info,
        "target_fingerprint": fingerprint(args.target),
        "draft_fingerprint": draft_fingerprint(args.draft),
        "env_stamp": json.loads(args.env_stamp.read_text()),
        "versions": versions(),
        "training": {**training_summary(records), "precision": draft_precision(args.draft)},
        "family_warnings": family_warnings(args.draft),
        "set_ids": {name: [r["id"] for r in rows] for name, rows in sets.items()},
        "input": screened,
        "offline_estimate": offline_estimate(args.offline, results, bench),
    }
    plot_acceptance(results, args.acceptance)
    plot_hist(results, args.hist)
    plot_training(records, args.training)
    atomic_write_text(args.report_md, render_md(report, args.acceptance, args.hist, args.training))
    levels_png = benchlevels.plot(report) if benchlevels.has_levels(report) else None
    atomic_write_text(
        args.summary_html,
        render_html(report, args.acceptance, args.hist, args.training, levels_png=levels_png),
    )
    atomic_write_json(args.report_json, report)
    if args.captions:
        from draftsmith.bench.captions import write_captions

        write_captions(report, args.captions)


def refuse_sampling(bench: BenchSettings) -> None:
    """bench.temperature > 0 on an engine that benchmarks greedy only (the Snakefile refuses the
    same: config.check_config)."""
    from draftsmith.config.checks import engines_text, honours

    if bench.temperature > 0 and not honours(bench.backend, "bench.temperature"):
        raise SystemExit(
            f"bench.temperature {bench.temperature}: the {bench.backend} engine benchmarks "
            f"greedy only; sampling runs in the {engines_text('bench.temperature', ' or ')} engine"
        )


def training_config(draft_dir: Path) -> dict:
    """The train, draft and capture sections the draft was trained with (its provenance)."""
    from draftsmith.algorithms.export import read_provenance

    cfg = read_provenance(draft_dir).get("config", {})
    return {k: cfg[k] for k in ("train", "draft", "capture") if k in cfg}


def family_warnings(draft_dir: Path) -> list[str]:
    """The export's warnings about the target family, from the draft's provenance: RoPE the
    draft does not carry, engines that cannot serve it as trained or were not checked
    (draftsmith.targets.families, draftsmith.targets.serving); [] for an older draft."""
    from draftsmith.algorithms.export import read_provenance

    family = read_provenance(draft_dir).get("target_family") or {}
    return list(family.get("warnings", []))


def draft_precision(draft_dir: Path) -> dict | None:
    """The precision the draft was trained in, as its provenance records it (resolved from
    train.precision auto on the training machine), or None for an older draft."""
    from draftsmith.algorithms.export import read_provenance

    return read_provenance(draft_dir).get("precision")


def precision_text(p: dict | None) -> str:
    if not p:
        return ""
    cpu = p.get("cpu") or {}
    where = f" on CPU {cpu['kind']}" if cpu.get("kind") else ""
    return f" in {p['resolved']} ({p['configured']}{where})"
