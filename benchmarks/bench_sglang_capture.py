"""Capture overhead through the patched SGLang: capture time / plain prefill time, same server.

    DRAFTSMITH_PYTHON_SGLANG_CPU=... $DRAFTSMITH_PYTHON_SGLANG_CPU benchmarks/bench_sglang_capture.py \\
        --target results/target --tokens results/tokens/rows_000000-000064.safetensors

Run with the sglang-cpu (or sglang) role's interpreter. It builds the patched overlay in a temp
dir, starts ONE patched server in capture mode (as `capture.backend: sglang` does), and then, in
alternating order, `--repeats` times each:
  plain    every row of the range as /generate with max_new_tokens=1 and no dump key;
  capture  the same rows with dump keys, through the capture client: wait for each dump, check
           it, cast to bf16 and write the shard (the full per-row work of a capture job).
Both use the same concurrency. The overhead is median(capture) / median(plain) wall time.
A second figure compares the plain prefill of this server with a stock server (the unpatched
install, no capture flags, same radix/chunking settings) to show what capture-only mode itself
costs. Results: benchmarks/results/sglang_capture.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

CPU_ARGS = ["--max-total-tokens", "8192", "--mem-fraction-static", "0.1"]


def plain_pass(url: str, rc, rows: list[int], concurrency: int) -> float:
    from draftsmith.engines.server import http_json

    def one(r):
        body = {
            "input_ids": rc.row_ids(r).tolist(),
            "sampling_params": {"max_new_tokens": 1, "temperature": 0.0},
        }
        http_json(f"{url}/generate", body, timeout=600)

    t0 = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        list(pool.map(one, rows))
    return time.perf_counter() - t0


def capture_pass(sup, tokens, job, out: Path, dump_dir: Path, expect, rows, concurrency) -> float:
    from draftsmith.engines.sglang import capture as sc
    from draftsmith.hidden.writer import ShardWriter

    class Bar:
        def update(self, n):
            pass

    t0 = time.perf_counter()
    with ShardWriter(
        out,
        input_ids=tokens["input_ids"],
        loss_mask=tokens["loss_mask"],
        row_offsets=tokens["row_offsets"],
        hidden_size=expect["hidden_size"],
        dtype="bfloat16",
        manifest={"row_range": [0, len(rows)], "backend": "sglang"},
    ) as writer:
        rc = sc.RowCapture(tokens, writer, dump_dir, expect, job)
        sc.run_rows(sup, rc, rows, concurrency=concurrency, retries=0, bar=Bar())
    seconds = time.perf_counter() - t0
    out.unlink()
    out.with_suffix(".json").unlink()
    return seconds


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--target", type=Path, required=True)
    ap.add_argument("--tokens", type=Path, required=True)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--role", default="sglang-cpu")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "sglang_capture")
    return ap.parse_args()


def build_overlay(work: Path) -> dict:
    """The patched sglang overlay under work; its build record (patch id)."""
    from draftsmith.engines.sglang.patch import build

    (work / "pins.txt").write_text("sglang==0.5.23\n")
    patch_dir = ROOT / "patches" / "sglang-0.5.23"
    return build(
        work / "pins.txt",
        sorted(patch_dir.glob("*.patch")),
        patch_dir / "pristine.sha256",
        work / "overlay",
        work / "patched.json",
    )


def capture_job(role: str) -> dict:
    """What the capture job hands its engine, for this role."""
    from draftsmith.config.settings import stage_job

    cfg = {
        "capture": {"backend": "sglang", "role": role, "dtype": "bfloat16"},
        "target": {"dtype": "float32"},
        "sglang": {
            "tp_size": 1,
            "extra_args": CPU_ARGS if role == "sglang-cpu" else [],
            "port": 0,
            "startup_timeout": 1800,
            "request_timeout": 1800,
            "retries": 0,
        },
    }
    return stage_job(cfg, "capture")


def patched_times(args, spec, tokens, job, work, dump_dir, expect, rows) -> dict:
    """Alternating plain and capture passes on one patched server in capture mode."""
    from draftsmith.engines.server import Supervisor
    from draftsmith.engines.sglang import capture as sc

    n_rows = tokens["row_offsets"].numel() - 1
    times = {"plain": [], "capture": []}
    with Supervisor(spec, retries=0) as sup:
        plain_pass(sup.url, sc.RowCapture(tokens, _Null(), dump_dir, expect, job), rows[:4], 2)
        for i in range(args.repeats):
            order = ("plain", "capture") if i % 2 == 0 else ("capture", "plain")
            for kind in order:
                if kind == "plain":
                    rc = sc.RowCapture(tokens, _Null(), dump_dir, expect, job)
                    t = plain_pass(sup.url, rc, rows, args.concurrency)
                else:
                    out = work / f"rows_000000-{n_rows:06d}.safetensors"
                    t = capture_pass(
                        sup, tokens, job, out, dump_dir, expect, rows, args.concurrency
                    )
                times[kind].append(round(t, 3))
                print(f"{kind:8s} pass {i}: {t:.2f} s", file=sys.stderr, flush=True)
    return times


def stock_spec(job, target: Path, ids: list[int], dump_dir: Path):
    """The stock server: the same launch without the overlay, the dump dir and capture mode."""
    from draftsmith.engines.sglang import capture as sc

    stock = sc.capture_server_spec(job, target, 1, ids, dump_dir, "")
    stock_cmd = stock.command
    block = sc.capture_args(ids)[: 4 + len(ids)]  # aux capture on, convention, the ids

    def command(port):
        argv = stock_cmd(port)
        i = next(i for i in range(len(argv)) if argv[i : i + len(block)] == block)
        return argv[:i] + argv[i + len(block) :]

    stock.command = command
    stock.env = {k: v for k, v in stock.env.items() if k != "DRAFTSMITH_DUMP_DIR"}
    return stock


def stock_times(args, stock, tokens, job, dump_dir, expect, rows) -> list[float]:
    """Plain passes on the stock server."""
    from draftsmith.engines.server import Supervisor
    from draftsmith.engines.sglang import capture as sc

    times = []
    with Supervisor(stock, retries=0) as sup:
        rc = sc.RowCapture(tokens, _Null(), dump_dir, expect, job)
        plain_pass(sup.url, rc, rows[:4], 2)
        for i in range(args.repeats):
            times.append(round(plain_pass(sup.url, rc, rows, args.concurrency), 3))
            print(f"stock    pass {i}: {times[-1]:.2f} s", file=sys.stderr)
    return times


def measure(args, tokens, ids: list[int], hidden: int) -> dict:
    """Seconds of every pass: plain and capture (patched server), stock_plain (stock server)."""
    from draftsmith.engines.sglang import capture as sc

    n_rows = tokens["row_offsets"].numel() - 1
    lengths = (tokens["row_offsets"][1:] - tokens["row_offsets"][:-1]).tolist()
    rows = sorted(range(n_rows), key=lambda r: (-lengths[r], r))
    work = Path(tempfile.mkdtemp(prefix="bench-sglcap-"))
    record = build_overlay(work)
    job = capture_job(args.role)  # what the capture job hands its engine
    dump_dir = Path(tempfile.mkdtemp(prefix="draftsmith-dump-", dir=sc.dump_root()))
    try:
        spec = sc.capture_server_spec(job, args.target, 1, ids, dump_dir, str(work / "overlay"))
        expect = {
            "patch": record["patch_id"],
            "hidden_size": hidden,
            "layer_inputs": [i + 1 for i in ids],
        }
        times = patched_times(args, spec, tokens, job, work, dump_dir, expect, rows)
        stock = stock_spec(job, args.target, ids, dump_dir)
        times["stock_plain"] = stock_times(args, stock, tokens, job, dump_dir, expect, rows)
    finally:
        shutil.rmtree(dump_dir, ignore_errors=True)
        shutil.rmtree(work, ignore_errors=True)
    return times


def render_md(result: dict) -> str:
    """sglang_capture.md from the result (sglang_capture.json)."""
    times = result["seconds"]
    md = [
        "# Capture overhead through the patched SGLang (`benchmarks/bench_sglang_capture.py`)",
        "",
        f"{result['rows']} rows, {result['tokens']} tokens, hidden {result['hidden_size']}, "
        f"concurrency {result['concurrency']}, "
        f"median of {result['repeats']} alternating passes, "
        f"load average {result['load_average']}.",
        "",
        "| figure | value |",
        "|---|---|",
        f"| capture / plain prefill, same patched server | {result['capture_overhead']} |",
        f"| plain prefill: capture-mode server / stock server | "
        f"{result['capture_mode_vs_stock_prefill']} |",
        f"| capture / stock-server prefill | {result['capture_vs_stock_prefill']} |",
        f"| capture throughput | {result['capture_tokens_per_second']} tokens/s |",
        f"| seconds (plain / capture / stock) | {times['plain']} / {times['capture']} / "
        f"{times['stock_plain']} |",
        "",
    ]
    return "\n".join(md)


def main() -> None:
    args = parse_args()

    from draftsmith.config.checks import aux_layer_ids
    from draftsmith.stages.capture import read_tokens
    from draftsmith.targets.model import target_config

    tokens = read_tokens(args.tokens)
    text_cfg = target_config(args.target)
    hidden, n_layers = int(text_cfg["hidden_size"]), int(text_cfg["num_hidden_layers"])
    ids = aux_layer_ids("auto", n_layers)
    times = measure(args, tokens, ids, hidden)
    med = {k: statistics.median(v) for k, v in times.items()}
    n_tokens = tokens["input_ids"].numel()
    result = {
        "target": str(args.target),
        "tokens_file": str(args.tokens),
        "rows": tokens["row_offsets"].numel() - 1,
        "tokens": n_tokens,
        "hidden_size": hidden,
        "aux_layer_ids": ids,
        "concurrency": args.concurrency,
        "repeats": args.repeats,
        "seconds": times,
        "median_seconds": med,
        "capture_overhead": round(med["capture"] / med["plain"], 3),
        "capture_mode_vs_stock_prefill": round(med["plain"] / med["stock_plain"], 3),
        "capture_vs_stock_prefill": round(med["capture"] / med["stock_plain"], 3),
        "dump_bytes_per_token_float32": 4 * hidden * 4,
        "capture_tokens_per_second": round(n_tokens / med["capture"], 1),
        "load_average": os.getloadavg(),
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(result, indent=2) + "\n")
    text = render_md(result)
    args.out.with_suffix(".md").write_text(text)
    print(text)


class _Null:
    """Stands in for a ShardWriter where only RowCapture's token views are used."""

    path = Path("rows_000000-000000.safetensors")
    manifest = {"row_range": [0, 0]}


if __name__ == "__main__":
    main()
