"""Regeneration (rule regenerate): the target rewrites the assistant turns of one row range.

The driver (`regenerate`, turn by turn, and the `generate_fn` seam) lives in
`draftsmith.regenerate_base`, which the engines import too. The engines (`draftsmith.engines`,
chosen by `regenerate.backend`) provide the generation: `hf` generates in-process with
transformers, `sglang` sends the prompts to an SGLang server the job launches. This module reads
the range's rows, asks the engine (or copies the source answers when regeneration is off), and
writes the rows and the report.

CLI (rule regenerate): `python -m draftsmith.regenerate --cfg <json> --range rows_<a>-<b>
--target results/target --out results/data/rows_<a>-<b>.jsonl --report <...>.report.json`.
"""

from __future__ import annotations

import argparse
import json
import logging

from draftsmith.regenerate_base import MissingAnswerError, copy_answers, dropped_ids

log = logging.getLogger("draftsmith.regenerate")


def write_jsonl(path, rows: list[dict]) -> None:
    from draftsmith.common import atomic_path

    with atomic_path(path) as tmp, open(tmp, "w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")


def refused_rows(target: str, rows: list[dict], job) -> tuple[list[dict], list[dict]]:
    """(rows the target's chat template renders, the refused ones named), before any engine
    generates: the tokenizer as the regenerate engine's role loads it (`job`: the JobSettings)."""
    from draftsmith.engines import load_tokenizer
    from draftsmith.tokens import split_refused

    return split_refused(load_tokenizer("regenerate", job, target), rows)


def job_settings(cfg: dict):
    """The regenerate job's typed settings (draftsmith.settings.stage_job). Its `target`
    section may be absent, typed at the schema's defaults then: rules/data.smk passes it only
    through the engine's server settings (rules/common.smk server_cfg: target.dtype and
    trust_remote_code) or, for an engine without them, only while trust_remote_code is on
    (remote_code_cfg), so absent means off; the hf engine reads regenerate.dtype, never
    target.dtype."""
    from draftsmith import settings

    return settings.stage_job(cfg, "regenerate", absent=("target",))


def main(argv: list[str] | None = None) -> None:
    from draftsmith.common import atomic_write_json, init_logging, merge_run, parse_cfg, versions
    from draftsmith.config import parse_range
    from draftsmith.prompts import SourceError, load_sources, rows_for_range
    from draftsmith.tokens import log_refused

    ap = argparse.ArgumentParser(
        prog="python -m draftsmith.regenerate",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--cfg", required=True, help="JSON with the data and regenerate sections")
    ap.add_argument("--range", required=True, help="rows_<a>-<b>")
    ap.add_argument("--target", required=True, help="target HF directory")
    ap.add_argument("--out", required=True, help="results/data/rows_<a>-<b>.jsonl")
    ap.add_argument("--report", required=True, help="results/data/rows_<a>-<b>.report.json")
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--run", default="", help="run settings JSON (default: $DRAFTSMITH_RUN)")
    args = ap.parse_args(argv)
    init_logging("draftsmith.regenerate")
    cfg = merge_run(parse_cfg(args.cfg), args.run)
    job = job_settings(cfg)
    a, b = parse_range(args.range)
    try:
        rows = rows_for_range(load_sources(cfg), a, b)
    except SourceError as e:
        raise SystemExit(str(e)) from None
    report = {"range": args.range, "rows": len(rows), "enabled": bool(job.regenerate.enabled)}
    rows, refused = refused_rows(args.target, rows, job)
    if refused:  # rows the chat template refuses (e.g. a system turn): skipped, named, counted
        log_refused(f"{args.range} ({args.target})", refused)
        report.update(refused_rows=len(refused), refused=refused[:20])
    if not report["enabled"]:
        try:
            out = copy_answers(rows)
        except MissingAnswerError as e:
            raise SystemExit(str(e)) from None
        log.info(
            "%s: regeneration off, %d rows copied with their source answers", args.range, len(out)
        )
    else:
        from draftsmith.engines import EngineError, engine, stop_guard

        try:
            regenerate_rows = engine("regenerate", job.regenerate.backend)
        except EngineError as e:
            raise SystemExit(str(e)) from None
        with stop_guard("regenerate", job.regenerate.backend):
            out, figures = regenerate_rows(
                rows,
                job,
                target=args.target,
                threads=args.threads,
                seed=int(job.regenerate.seed) + a,
                max_total=int(cfg["data"]["max_length"]),
            )
        dropped = dropped_ids(rows, out)
        report.update(figures, dropped_rows=len(dropped), dropped_ids=dropped[:20])
        log.info(
            "%s: %d rows, %d turns, %d new tokens in %.1f s generate (%.1f s wall) with %s: "
            "%.1f tokens/s; %d hit max_new_tokens, %d empty; %d turns too long for %d tokens "
            "(%d rows dropped), %d replies cut to fit",
            args.range,
            len(rows),
            figures["prompts"],
            figures["new_tokens"],
            figures["seconds"],
            figures["wall_seconds"],
            figures["backend"],
            figures["tokens_per_second"],
            figures["hit_limit"],
            figures["empty"],
            figures.get("too_long_turns", 0),
            figures.get("max_total_tokens", 0),
            len(dropped),
            figures.get("capped_replies", 0),
        )
    report["versions"] = versions()
    write_jsonl(args.out, out)
    atomic_write_json(args.report, report)


if __name__ == "__main__":
    main()
