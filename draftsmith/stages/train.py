"""One training rank: the command `draftsmith train` spawns per process (`train-rank`).

    python -m draftsmith train-rank --cfg JSON --shards results/hidden/rows_*.safetensors \
        --vocab results/vocab/vocab.safetensors --target results/target \
        --out results/draft --metrics results/train/metrics.jsonl [--state state/train]

It reads the job's settings, resolves the draft's algorithm once (its spec, which the run
hands to every part: inputs, model, objective, export) and runs `draftsmith.train.loop.train`
under the stop watcher. The run itself is described in draftsmith.train.loop.

May import: every subpackage (a stage command sits on top).
"""

from __future__ import annotations

import os
from contextlib import nullcontext
from pathlib import Path

from draftsmith import algorithms
from draftsmith.config.settings import job as job_settings
from draftsmith.runtime.files import command_parser, init_logging, merge_run, parse_cfg, set_threads
from draftsmith.runtime.stopping import stop_promptly
from draftsmith.train.loop import Progress, bound_cpu_memory, log_stop, recorded, train


def main(argv: list[str] | None = None) -> None:
    ap = command_parser("train-rank", __doc__)
    ap.add_argument("--cfg", required=True, help="JSON of the train, draft and capture sections")
    ap.add_argument("--shards", nargs="+", required=True, type=Path)
    ap.add_argument("--vocab", required=True, type=Path)
    ap.add_argument("--target", required=True, type=Path)
    ap.add_argument("--out", required=True, type=Path, help="the exported draft directory")
    ap.add_argument("--metrics", required=True, type=Path)
    ap.add_argument("--offline", type=Path, help="results/train/offline_acceptance.json")
    ap.add_argument("--state", type=Path, default=Path("state/train"))
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--device", choices=["cpu", "cuda"], help="default: cuda when available")
    args = ap.parse_args(argv)
    init_logging("draftsmith.train.loop")
    cfg = merge_run(parse_cfg(args.cfg), sections=("train",))  # the x-execution train keys
    job = recorded(job_settings(cfg, ("train", "draft", "capture")))
    progress = Progress()
    # under torchrun (WORLD_SIZE > 1) the elastic agent stops its workers itself (SIGTERM, whose
    # default action ends a rank at once)
    single = int(os.environ.get("WORLD_SIZE", "1")) == 1
    guard = (
        stop_promptly("draftsmith.train.loop", lambda sig: log_stop(progress))
        if single
        else nullcontext()
    )
    spec = algorithms.get(job.draft.algorithm)  # resolved once, here, for the whole run
    with guard:
        set_threads(args.threads)
        bound_cpu_memory()
        train(
            job,
            sorted(args.shards),
            args.vocab,
            args.target,
            args.out,
            args.metrics,
            args.state,
            args.device,
            progress,
            args.offline,
            spec=spec,
        )
