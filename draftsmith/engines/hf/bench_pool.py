"""The `hf` engine's bench stage: its sets measured in this process, or, on a CPU, spread over
worker processes (bench.workers).

`bench.workers: auto` is one process with all the job's threads. Worker processes finish the
job sooner (two one-thread workers took 0.69x the wall time of one two-thread process on the
default's bench), but each times its prompts while the other decodes beside it on the same
memory bus, and what the neighbour runs meanwhile moves the speedup: on the default's bench
job two workers measured 1.35x on the held-out set, a pass of 1.03 greedy steps, under the
1.11 that no lone pass can go below, where one process measured 1.08x and 1.28
(benchmarks/bench_bench_workers.py, benchmarks/results/bench_workers_<cpu kind>.md). A number
of workers is there for acceptance figures at less wall time; on a GPU there is one process.

Each worker loads the target and the draft, measures its own linear-layer routes at its own
thread count (draftsmith.runtime.gemm) and warms up, then takes prompts from a shared queue
until none is left. A prompt's speculative and plain runs are timed back to back in the same
worker (`bench.measure_prompt`); the set's figures add up every prompt's seconds, so its
tokens/s are those of one process. What is measured is the same as in one process: the same
prompts, seeds and order of the two sides per prompt. A worker's load meter counts the whole
job's processes as its own, so the sibling workers are not taken for other work. A worker that
fails ends the job with its error; the others are stopped.
"""

from __future__ import annotations

import logging
import os
import queue
import traceback
from pathlib import Path

import torch
from tqdm import tqdm

from draftsmith.engines.hf.bench import (
    load_models,
    measure_prompt,
    method_text,
    pass_floor,
    prepare,
    run_set,
    sampling,
    set_measurements,
)
from draftsmith.runtime.hardware import announce, free_memory_bytes
from draftsmith.runtime.load import LoadMeter

log = logging.getLogger("draftsmith.engines.hf")

POLL_S = 5.0  # how often the parent looks at its workers while it waits for a result
WEIGHT_COPIES = 2  # a worker's memory in copies of the target's weights (routes, allocator)


def worker_count(
    requested, device: str, threads: int, prompts: int, need: int | None, free: int | None
) -> tuple[int, str]:
    """(worker processes, why) for bench.workers `requested` ("auto" or a number) on a job of
    `threads` threads with `prompts` prompts; `need`: bytes one worker holds, `free`: bytes the
    machine can give (None: unknown). Each worker gets threads // workers threads.

    auto is one process: workers side by side time each side while a neighbour decodes, and
    what it runs moves the speedup (the module's docstring). A number asks for that many, at
    most one per thread and per prompt, fewer where the free memory holds fewer copies of the
    target."""
    threads = max(1, threads)
    if device != "cpu":
        return 1, f"one process on {device}"
    if requested == "auto":
        return 1, f"auto: one process with the job's {threads} thread(s)"
    n = min(int(requested), threads, max(1, prompts))
    why = f"bench.workers {requested} ({n} for {threads} threads and {prompts} prompts)"
    if need and free is not None and free // need < n:
        n = max(1, free // need)
        why += f"; {free / 2**30:.1f} GiB free holds {n} x {need / 2**30:.1f} GiB"
    return n, why


def weight_bytes(target_dir: Path, dtype: str) -> int:
    """Bytes of the target's weights in `dtype` (read from the safetensors headers only)."""
    from safetensors import safe_open

    size = torch.empty((), dtype=getattr(torch, dtype)).element_size()
    total = 0
    for path in sorted(Path(target_dir).glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            for key in f.keys():
                total += size * int(torch.Size(f.get_slice(key).get_shape()).numel())
    return total


def worker_main(spec: dict, tasks, results) -> None:
    """One worker process: load, route, warm up, then measure prompts from `tasks` (None ends),
    sending ("ready", index, facts), ("prompt", set, i, record, seconds), ("done", index,
    {set: meter state}) or ("error", index, text) to `results`."""
    from draftsmith.runtime.files import init_logging

    init_logging("draftsmith.engines.hf")
    index = spec["index"]
    try:
        # the parent logged the job's wait policy (inherited); this process's thread count:
        torch.set_num_threads(spec["threads"])
        algorithm = spec["algorithm"]
        model, tokenizer, drafter = load_models(
            Path(spec["target"]), Path(spec["draft"]), spec["dtype"], "cpu", algorithm
        )
        bench = spec["bench"]
        facts = prepare(model, tokenizer, drafter, bench, "cpu", spec["warm_row"], algorithm)
        aux_ids = facts["aux_ids"]
        results.put(("ready", index, facts))
        meters: dict[str, LoadMeter] = {}
        for name, i, row in iter(tasks.get, None):
            meter = meters.setdefault(name, LoadMeter(job=spec["job_pid"]))
            record, seconds = measure_prompt(
                model, tokenizer, drafter, row, i, bench, aux_ids, meter, algorithm
            )
            results.put(("prompt", name, i, record, seconds))
        results.put(("done", index, {name: m.state() for name, m in meters.items()}))
    except BaseException as e:  # noqa: BLE001 - every failure goes to the parent, named
        text = str(e) if isinstance(e, SystemExit) else traceback.format_exc()
        results.put(("error", index, text))
        raise SystemExit(1) from None


def next_message(results, procs) -> tuple:
    """The next worker message; SystemExit when a worker ended without saying why."""
    while True:
        try:
            return results.get(timeout=POLL_S)
        except queue.Empty:
            for i, p in enumerate(procs):
                if p.exitcode not in (None, 0):
                    raise SystemExit(
                        f"bench worker {i} ended with exit code {p.exitcode} (killed, e.g. out "
                        "of memory?); set bench.workers 1 to bench in one process"
                    ) from None


def collect(sets: dict, results, procs) -> tuple[dict, dict, dict]:
    """({set: {i: (record, seconds)}}, {set: merged meter}, facts of worker 0) from the
    workers' messages, with a progress bar over every prompt."""
    got: dict[str, dict] = {name: {} for name in sets}
    meters = {name: LoadMeter() for name in sets}
    facts, finished = {}, 0
    bar = tqdm(total=sum(len(rows) for rows in sets.values()), desc="prompts", unit="prompt")
    while finished < len(procs):
        msg = next_message(results, procs)
        if msg[0] == "error":
            raise SystemExit(f"bench worker {msg[1]} failed: {msg[2]}")
        if msg[0] == "ready":
            facts = msg[2] if msg[1] == 0 else facts
        elif msg[0] == "prompt":
            got[msg[1]][msg[2]] = (msg[3], msg[4])
            bar.update(1)
        else:
            finished += 1
            for name, state in msg[2].items():
                meters[name].absorb(state)
    bar.close()
    return got, meters, facts


def run_in_workers(sets: dict, job, target, draft, workers: int, threads: int, spec) -> tuple:
    """(measurements per set, facts of worker 0): the sets measured by `workers` processes of
    threads // workers threads each."""
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")  # a fresh interpreter: libgomp is not fork-safe
    tasks, results = ctx.Queue(), ctx.Queue()
    for name, rows in sets.items():
        for i, row in enumerate(rows):
            tasks.put((name, i, row))
    base = {
        "threads": max(1, threads // workers),
        "target": str(target),
        "draft": str(draft),
        "dtype": job.target.dtype,
        "bench": job.bench,
        "job_pid": os.getpid(),
        "warm_row": next(iter(sets.values()))[0],
        "algorithm": spec,  # the draft's spec (it pickles: its parts travel as module paths)
    }
    procs = [
        ctx.Process(target=worker_main, args=({**base, "index": i}, tasks, results), daemon=True)
        for i in range(workers)
    ]
    for _ in procs:
        tasks.put(None)
    try:
        for p in procs:
            p.start()
        got, meters, facts = collect(sets, results, procs)
    finally:
        for p in procs:
            p.join(timeout=POLL_S)
            if p.is_alive():
                p.terminate()
                p.join()
    measured = {}
    for name, rows in sets.items():
        pairs = [got[name][i] for i in range(len(rows))]
        measured[name] = set_measurements(
            job.bench, [r for r, _ in pairs], [s for _, s in pairs], meters[name].summary()
        )
    return measured, facts


def run_in_process(sets: dict, job, target, draft, device: str, spec) -> tuple:
    """(measurements per set, facts): the sets measured in this process."""
    bench = job.bench
    dtype = job.target.dtype
    model, tokenizer, drafter = load_models(Path(target), Path(draft), dtype, device, spec)
    facts = prepare(model, tokenizer, drafter, bench, device, next(iter(sets.values()))[0], spec)
    measured = {
        name: run_set(model, tokenizer, drafter, rows, bench, facts["aux_ids"], spec)
        for name, rows in sets.items()
    }
    return measured, facts


def bench_sets(sets: dict, job, *, target, draft, spec, threads: int):
    """The bench stage: speculative and greedy generation of every set (`job`: the JobSettings
    of the engine seam, draftsmith.engines; `spec`: the draft's algorithm, resolved once by the
    stage, draftsmith.algorithms.open_draft)."""
    from draftsmith.config.checks import concurrency_levels
    from draftsmith.config.settings import plain
    from draftsmith.runtime.files import set_threads

    bench = job.bench
    if bench.topk != 1:
        raise SystemExit(f"bench.topk {bench.topk}: the hf engine decodes chains (top-k 1)")
    if concurrency_levels(bench.concurrency) != [1]:
        raise SystemExit(
            f"bench.concurrency {plain(bench.concurrency)}: the hf engine runs batch size 1"
        )
    set_threads(threads)
    threads = torch.get_num_threads()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    prompts = sum(len(rows) for rows in sets.values())
    need = WEIGHT_COPIES * weight_bytes(target, job.target.dtype) if device == "cpu" else None
    workers, why = worker_count(bench.workers, device, threads, prompts, need, free_memory_bytes())
    log.info("bench processes: %d (%s)", workers, why)
    cpu = announce(log, "bench timing", job.target.dtype, "target.dtype", device)
    if workers > 1:
        measured, facts = run_in_workers(sets, job, target, draft, workers, threads, spec)
    else:
        measured, facts = run_in_process(sets, job, target, draft, device, spec)
    log.info("aux ids %s; device %s", facts["aux_ids"], device)
    info = {
        "backend": "hf",
        "device": device,
        "threads": threads,
        "workers": workers,
        "aux_layer_ids": facts["aux_ids"],
        "draft_vocab_size": facts["draft_vocab_size"],
        "pass_floor": pass_floor(
            facts["linear_bytes"]["target"], facts["linear_bytes"]["draft"], bench.num_steps, spec
        ),
        "method": method_text(bench, device, threads, spec, workers),
        "cpu": cpu,
        **({"linear_routes": facts["routes"]} if facts["routes"] else {}),
    }
    if sampling(bench) is not None:
        info["sampling"] = sampling(bench)
    return measured, info
