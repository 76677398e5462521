"""OpenMP wait policies under contention: the benchmark and training stages' inner loops at load
0, with load arriving mid-job, and beside busy processes from the start.

    python benchmarks/bench_contention.py                  # 8-10 minutes on 2 idle cores
    python benchmarks/bench_contention.py --quick          # smoke run (~2 min; checks, not figures)
    python benchmarks/bench_contention.py --target DIR     # another target (e.g. a run's
                                                           # results/target: SmolLM2-135M)

One job per stage, policy and scenario, each in a fresh process (libgomp reads its settings once,
when torch loads it):

- decode: our speculative decoder (draftsmith.bench.specdec.speculative_generate, the benchmark
  stage's loop, batch 1, `--new-tokens` per prompt) with an untrained EAGLE-3 draft of the
  target's shapes, over and over; tokens/s;
- train: the training stage's optimizer step (the TTT objective draftsmith.algorithms.eagle3.ttt,
  backward, gradient clipping, AdamW) of an EAGLE-3 draft of the target's shapes on synthetic
  packed batches of `--train-tokens` positions; tokens/s.

The target is a random Llama made in the work directory unless `--target` names one: by default
SmolLM2-135M's width (hidden 576) with 8 layers and a tiny vocabulary, so that a step is made of
as many small parallel regions as the embedded default's. Both loops warm up for two units, then
run for the scenario's window.

Policies: `spin` (libgomp's default: spin up to 300000 iterations, then sleep), `spinN`
(GOMP_SPINCOUNT=N), `passive` (OMP_WAIT_POLICY=PASSIVE), `auto` (what a workflow job does: the
load probe at start, draftsmith/runtime/threads.py, then its choice; DRAFTSMITH_SPINCOUNT in the
environment reaches it as it reaches a job), each optionally `@T` for T threads instead of
`--threads`. Scenarios, with `--load` busy processes (pure-Python loops at the
job's priority: other users' work):

- idle: no load; `--seconds` timed;
- mid: the load starts `--arrive` seconds into the timed window, after the job chose its policy;
  the rate is that of the `--seconds` after the load arrived (and, apart, of the time before);
- busy: the load starts a second before the job, which sees it at its probe; `--seconds` timed.

Each rate is reported as a fraction of the same stage's `spin` rate at idle in the same run, and
that fraction against the fair share: the job's cores if the CPU were shared evenly between its
threads and the busy processes, min(T, C*T/(T+L)) / min(T, C), over its cores at idle.

Writes benchmarks/results/contention_<cpu kind>.{json,md} (with --quick: the work directory).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT)]

from draftsmith.runtime.load import TOLERANCE, machine_busy_seconds, own_cpu_seconds  # noqa: E402

POLICIES = ["spin", "spin1000", "spin10000", "spin30000", "passive", "auto"]
SCENARIOS = ["idle", "mid", "busy"]
STAGES = ["decode", "train"]
OMP_KEYS = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "DRAFTSMITH_OMP", "DRAFTSMITH_OMP_DECISION")
PROMPT = [{"role": "user", "content": "Explain how a binary search works, step by step."}]


# ------------------------------------------------------------------ the job (a fresh process)


def decode_unit(target: Path, new_tokens: int):
    """A function decoding one prompt speculatively, returning the tokens it emitted."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    from draftsmith.bench.specdec import prompt_ids, speculative_generate

    hf_logging.disable_progress_bar()
    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(target)
    draft, aux_ids = untrained_draft(model.config.to_dict())
    ids = prompt_ids(tok, PROMPT)

    def unit() -> int:  # no stop tokens: every unit does the same work
        trace = speculative_generate(model, draft, ids, new_tokens, set(), 2, aux_ids)
        return len(trace.tokens)

    return unit


def untrained_draft(cfg: dict):
    """(a seeded EAGLE-3 draft of the target's shapes, its aux layer ids)."""
    import torch

    from draftsmith.algorithms.eagle3.model import DraftConfig, Eagle3Draft

    layers = int((cfg.get("text_config") or cfg)["num_hidden_layers"])
    aux_ids = [1, layers // 2 - 1, layers - 4] if layers >= 8 else [0, layers // 2, layers - 1]
    vocab = int((cfg.get("text_config") or cfg)["vocab_size"])
    torch.manual_seed(0)
    draft = Eagle3Draft(DraftConfig.from_target_config(cfg, min(vocab, 8192), aux_ids)).eval()
    return draft, aux_ids


def train_unit(target: Path, tokens: int, steps: int = 4):
    """A function running one training step on a synthetic packed batch, returning its tokens."""
    import torch

    from draftsmith.algorithms.eagle3.ttt import TTTObjective

    cfg = json.loads((target / "config.json").read_text())
    draft, aux_ids = untrained_draft(cfg)
    draft.train()
    c = draft.config
    objective = TTTObjective(draft, steps)
    opt = torch.optim.AdamW(draft.parameters(), lr=1e-4, weight_decay=0.0)
    gen = torch.Generator().manual_seed(0)
    h = c.target_hidden_size
    aux = torch.randn(1, tokens, len(aux_ids) * h, generator=gen)
    embeds = torch.randn(1, tokens + steps + 1, h, generator=gen) * 0.1
    pos = torch.arange(tokens)[None]
    seg = torch.zeros(1, tokens, dtype=torch.long)
    masks = torch.ones(steps, 1, tokens, dtype=torch.bool)
    for j in range(steps):  # step j predicts the token at t + j + 1: inside the row
        masks[j, :, tokens - j - 1 :] = False
    teacher = torch.log_softmax(torch.randn(1, tokens, c.draft_vocab_size, generator=gen), -1)

    def unit() -> int:
        ce, _ = objective(aux, embeds, pos, seg, masks, teacher)
        loss = ce.sum() / (tokens * steps)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(draft.parameters(), 1.0)
        opt.step()
        return tokens

    return unit


def job(args) -> None:
    """The measured process: prints a `ready` line after warm-up, then one line per unit."""
    import draftsmith  # noqa: F401  (first: the job's OpenMP policy, before torch loads libgomp)
    from draftsmith.runtime.files import set_threads
    from draftsmith.runtime.threads import DECISION

    set_threads(args.threads)
    import torch

    if args.job == "decode":
        unit = decode_unit(args.target, args.new_tokens)
    else:
        unit = train_unit(args.target, args.train_tokens)
    unit(), unit()  # warm-up
    ready = time.monotonic()
    env = {k: os.environ.get(k) for k in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    line = {"ready": ready, "threads": torch.get_num_threads(), "env": env}
    print(json.dumps({**line, "decision": os.environ.get(DECISION)}), flush=True)
    while time.monotonic() < ready + args.seconds:
        n = unit()
        print(json.dumps({"t": time.monotonic(), "n": n}), flush=True)


# ------------------------------------------------------------------ the driver


def policy_env(policy: str, threads: int) -> tuple[dict, int]:
    """(environment, threads) of a policy name such as `spin`, `passive@1`, `spin10000`."""
    name, _, t = policy.partition("@")
    env = {k: v for k, v in os.environ.items() if k not in OMP_KEYS}
    if name == "auto":  # what a workflow job does (draftsmith/runtime/threads.py)
        env["DRAFTSMITH_OMP"] = "auto"
    elif name == "passive":
        env["OMP_WAIT_POLICY"] = "PASSIVE"
    elif name.startswith("spin") and name[4:].isdigit():
        env["GOMP_SPINCOUNT"] = name[4:]
    elif name != "spin":
        raise SystemExit(f"unknown policy {policy!r}")
    env["PYTHONPATH"] = str(ROOT)
    threads = int(t) if t else threads
    env["OMP_NUM_THREADS"] = str(threads)  # as Snakemake sets a job's
    return env, threads


def busy(n: int) -> list[subprocess.Popen]:
    return [
        subprocess.Popen([sys.executable, "-c", "while True: pass"], start_new_session=True)
        for _ in range(n)
    ]


def stop(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        p.kill()
        p.wait()


def rate(events: list[dict], start: float, end: float = float("inf")) -> float | None:
    """Units per second of the units that ended after `start` and by `end`, timed from the end
    of the last unit before `start` (the job's `ready` time at the latest)."""
    before = [e["t"] for e in events if e["t"] <= start]
    after = [e for e in events if start < e["t"] <= end]
    if not before or not after:
        return None
    return sum(e["n"] for e in after) / (after[-1]["t"] - before[-1])


def run_one(args, stage: str, policy: str, scenario: str) -> dict:
    """Start the load and the job as the scenario says; the job's rates."""
    env, threads = policy_env(policy, args.threads)
    window = args.seconds + (args.arrive if scenario == "mid" else 0.0)
    cmd = [sys.executable, __file__, "--job", stage, "--target", str(args.target),
           "--threads", str(threads), "--seconds", str(window), "--new-tokens",
           str(args.new_tokens), "--train-tokens", str(args.train_tokens)]  # fmt: skip
    procs = busy(args.load) if scenario == "busy" else []
    arrival: list[float] = []

    def arrive() -> None:
        arrival.append(time.monotonic())
        procs.extend(busy(args.load))

    timer = threading.Timer(args.arrive, arrive)
    busy0, own0, t0 = machine_busy_seconds(), own_cpu_seconds(), time.perf_counter()
    try:
        if procs:
            time.sleep(1.0)  # running before the job starts: its probe sees them
        child = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, text=True)
        lines = []
        for text in child.stdout:
            lines.append(json.loads(text))
            if "ready" in lines[-1] and scenario == "mid":
                timer.start()
        if child.wait() != 0:
            raise SystemExit(f"{stage} {policy} {scenario}: the job failed ({child.returncode})")
    finally:
        timer.cancel()
        if timer.is_alive():
            timer.join()  # a load that is starting now is stopped too
        stop(procs)
    busy1, own1 = machine_busy_seconds(), own_cpu_seconds()
    foreign = None if busy0 is None else max(0.0, busy1 - busy0 - (own1 - own0))
    head, events = lines[0], [{"t": lines[0]["ready"], "n": 0}, *lines[1:]]
    row = {"stage": stage, "policy": policy, "scenario": scenario, "threads": head["threads"],
           "load": 0 if scenario == "idle" else args.load, "env": head["env"],
           "decision": json.loads(head["decision"]) if head["decision"] else None,
           "units": len(events) - 1,
           "other_work": None if foreign is None else foreign / (time.perf_counter() - t0)}  # fmt: skip
    if scenario == "mid":
        if not arrival:
            raise SystemExit(f"{stage} {policy}: the job ended before the load arrived")
        row["before"] = rate(events, head["ready"], arrival[0])
        row["rate"] = rate(events, arrival[0])
    else:
        row["rate"] = rate(events, head["ready"])
    return row


def fair_share(cpus: int, threads: int, load: int) -> float:
    """The job's cores under an even split with `load` busy processes, over its cores at idle."""
    idle = min(threads, cpus)
    return min(threads, cpus * threads / (threads + load)) / idle


def measure(args) -> list[dict]:
    rows, total, t0 = [], len(args.stages) * len(args.policies) * len(args.scenarios), time.time()
    for stage in args.stages:
        for policy in args.policies:
            for scenario in args.scenarios:
                row = run_one(args, stage, policy, scenario)
                rows.append(row)
                done = len(rows)
                left = (time.time() - t0) / done * (total - done)
                shown = f"{row['rate']:.1f}" if row["rate"] is not None else "-"
                print(f"[{done}/{total}] {stage} {policy} {scenario}: {shown} tokens/s "
                      f"(about {left / 60:.1f} min left)", flush=True)  # fmt: skip
    add_ratios(rows, os.cpu_count() or 1)
    return rows


def add_ratios(rows: list[dict], cpus: int) -> None:
    """Each rate against the same stage's `spin` at idle, and that against the fair share."""
    base = {r["stage"]: r["rate"] for r in rows if r["policy"] == "spin" and r["load"] == 0}
    for r in rows:
        b = base.get(r["stage"])
        r["fair_share"] = round(fair_share(cpus, r["threads"], r["load"]), 3)
        ok = b and r["rate"] is not None
        r["of_default"] = round(r["rate"] / b, 3) if ok else None
        r["of_fair"] = round(r["of_default"] / r["fair_share"], 3) if ok else None


def cell(x, fmt: str = "{:.2f}") -> str:
    return "-" if x is None else fmt.format(x)


def chosen(row: dict) -> str:
    d = row.get("decision")
    if not d:
        return ""
    return f" ({d['policy']}{' ' + str(d['spincount']) if d['policy'] == 'spin' else ''})"


def render(rows: list[dict], facts: dict, args) -> str:
    cpus = os.cpu_count()
    lines = [
        f"# OpenMP wait policies under contention ({facts['kind']})",
        "",
        f"CPU: {facts['model']}, torch capability {facts['capability']}, {cpus} cores. "
        f"`{' '.join(args.argv)}`. Target: {args.target_note}. decode: speculative decoding "
        f"(untrained EAGLE-3 draft, 2 proposals, {args.new_tokens} tokens per prompt); train: "
        f"TTT optimizer steps of {args.train_tokens} positions. Load: {args.load} busy "
        f"processes; mid: arriving {args.arrive:g} s into the job, the rate is that of the "
        f"{args.seconds:g} s after ('before': until then). 'of spin idle': the rate over the "
        "same stage's libgomp default at load 0 in this run; 'fair share': the job's share of "
        "its idle cores under an even split; 'of fair': the one over the other (>= 1: at least "
        "the fair share). auto: the policy a workflow job takes (its choice in brackets).",
        "",
        "| stage | policy | scenario | threads | tokens/s | before | of spin idle "
        "| fair share | of fair | other work |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['stage']} | {r['policy']}{chosen(r)} | {r['scenario']} | {r['threads']} | "
            f"{cell(r['rate'], '{:.1f}')} | {cell(r.get('before'), '{:.1f}')} | "
            f"{cell(r['of_default'])} | {r['fair_share']:.2f} | {cell(r['of_fair'])} | "
            f"{cell(r.get('other_work'))} |"
        )
    lines += ["", *summary(rows), *disturbed(rows)]
    return "\n".join(lines) + "\n"


def summary(rows: list[dict]) -> list[str]:
    """Per stage and policy: the idle speed and the worst loaded fraction of the fair share."""
    out = [
        "Per policy: speed at load 0 (of spin idle) and the worst 'of fair' under load.",
        "",
        "| stage | policy | idle: of spin idle | loaded: worst of fair |",
        "|---|---|---:|---:|",
    ]
    for stage in dict.fromkeys(r["stage"] for r in rows):
        for policy in dict.fromkeys(r["policy"] for r in rows):
            mine = [r for r in rows if r["stage"] == stage and r["policy"] == policy]
            idle = next((r["of_default"] for r in mine if r["load"] == 0), None)
            loaded = [r["of_fair"] for r in mine if r["load"] and r["of_fair"] is not None]
            worst = min(loaded) if loaded else None
            out.append(f"| {stage} | {policy} | {cell(idle)} | {cell(worst)} |")
    return out


def disturbed(rows: list[dict]) -> list[str]:
    """A warning where processes other than the benchmark's own kept cores busy."""
    bad = [r for r in rows if (r.get("other_work") or 0.0) > TOLERANCE]
    if not bad:
        return []
    worst = max(r["other_work"] for r in bad)
    return [
        "",
        f"Not a quiet machine: processes other than this benchmark's kept up to {worst:.2f} "
        f"cores busy during {len(bad)} of {len(rows)} jobs ('other work'); those figures do not "
        "show the policies alone.",
    ]


def tiny_target(args) -> Path:
    """The tiny random Llama of `--hidden` and `--layers` in the work directory."""
    from draftsmith.targets.tinymodel import make_tiny_target

    path = args.work / f"target-h{args.hidden}-l{args.layers}"
    if not (path / "config.json").exists():
        make_tiny_target(path, num_layers=args.layers, hidden_size=args.hidden)
    return path


def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--target", type=Path, help="an HF target directory (default: a tiny one)")
    ap.add_argument("--hidden", type=int, default=576, help="the tiny target's hidden size")
    ap.add_argument("--layers", type=int, default=8, help="the tiny target's layers")
    ap.add_argument("--policies", nargs="+", default=POLICIES)
    ap.add_argument("--scenarios", nargs="+", default=SCENARIOS, choices=SCENARIOS)
    ap.add_argument("--stages", nargs="+", default=STAGES, choices=STAGES)
    ap.add_argument("--load", type=int, default=2, help="busy processes")
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--seconds", type=float, default=5.0, help="timed window per job")
    ap.add_argument("--arrive", type=float, default=3.0, help="mid: seconds before the load")
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--train-tokens", type=int, default=512)
    ap.add_argument("--quick", action="store_true", help="a smoke run: short, 3 policies")
    ap.add_argument("--work", type=Path, default=ROOT / "benchmarks" / "work" / "contention")
    ap.add_argument("--out", type=Path, help="default: benchmarks/results (--quick: --work)")
    ap.add_argument("--job", choices=STAGES, help=argparse.SUPPRESS)  # the measured process
    args = ap.parse_args(argv)
    if args.quick:
        args.seconds, args.arrive, args.new_tokens, args.train_tokens = 1.0, 0.5, 8, 64
        args.policies = ["spin", "spin10000", "auto"]
    args.out = args.out or (args.work if args.quick else ROOT / "benchmarks" / "results")
    return args


def main(argv=None) -> None:
    args = parse(argv)
    if args.job:
        return job(args)
    from draftsmith.runtime.files import atomic_write_json, atomic_write_text
    from draftsmith.runtime.hardware import cpu_facts

    args.argv = ["python", "benchmarks/bench_contention.py", *(argv or sys.argv[1:])]
    args.work.mkdir(parents=True, exist_ok=True)
    args.target_note = str(args.target) if args.target else (
        f"tiny random Llama, hidden {args.hidden}, {args.layers} layers")  # fmt: skip
    args.target = (args.target or tiny_target(args)).resolve()
    facts = cpu_facts().as_dict()
    rows = measure(args)
    name = f"contention_{facts['kind']}"
    record = {"cpu": facts, "cpus": os.cpu_count(), "args": vars(args), "rows": rows}
    args.out.mkdir(parents=True, exist_ok=True)
    atomic_write_json(args.out / f"{name}.json", json.loads(json.dumps(record, default=str)))
    atomic_write_text(args.out / f"{name}.md", render(rows, facts, args))
    print(f"wrote {args.out / name}.{{json,md}}")


if __name__ == "__main__":
    main()
