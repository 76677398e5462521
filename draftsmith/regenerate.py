"""Regeneration: the target rewrites the assistant turns of one row range.

EAGLE-3 drafts learn the target's own distribution, so the assistant turns are regenerated with
the target: every user turn is answered again, turn by turn (turn 2 is asked with the regenerated
answer of turn 1 in its history); a conversation ending with a user turn gets its answer appended.

The seam between this driver and a backend is one function:

    generate_fn(prompts: list[list[{"role", "content"}]]) -> list[str | None]  (one per prompt)

A None reply means the prompt is too long to answer: its tokens plus one reply token would not
fit in the limit (the target's positions and `data.max_length`, the longest conversation the
data stage keeps; engines read it from the cfg they are given). That conversation ends with the turns before;
a conversation left without any answer is dropped. Engines cut replies that would run past the
limit. Both are counted in the range's report (`too_long_turns`, `capped_replies`,
`dropped_rows`, `dropped_ids`), never silent.

`regenerate(conversations, generate_fn)` drives it. The engines (`draftsmith.engines`, chosen by
`regenerate.backend`) provide it: `hf` generates in-process with transformers, `sglang` sends
the prompts to an SGLang server the job launches. This module reads the range's rows, asks the
engine, and writes the rows and the report.

CLI (rule regenerate): `python -m draftsmith.regenerate --cfg <json> --range rows_<a>-<b>
--target results/target --out results/data/rows_<a>-<b>.jsonl --report <...>.report.json`.
"""

from __future__ import annotations

import argparse
import json
import logging
from collections.abc import Callable

log = logging.getLogger("draftsmith.regenerate")

GenerateFn = Callable[[list[list[dict]]], list[str | None]]


class MissingAnswerError(ValueError):
    """Regeneration is off but a row has a user turn without a source answer."""


def new_stats() -> dict:
    """The counters every regeneration engine keeps (the same report fields for every backend)."""
    return {
        "prompts": 0,
        "new_tokens": 0,
        "prompt_tokens": 0,
        "seconds": 0.0,
        "hit_limit": 0,
        "empty": 0,
        "too_long_turns": 0,
        "capped_replies": 0,
    }


def regenerate(conversations: list[dict], generate_fn: GenerateFn) -> list[dict]:
    """Answer every user turn of every conversation again with `generate_fn`, turn by turn.

    Source assistant turns are discarded; round r asks all conversations that have an r-th user
    turn together, with their regenerated history. Returns new conversation dicts (same id/source).
    A None reply (prompt too long) ends that conversation before the unanswered turn; one left
    without an answer is dropped (see `dropped_ids`).
    """
    history, pending = [], []
    for conv in conversations:
        turns = conv["conversations"]
        system = [t for t in turns[:1] if t["role"] == "system"]
        history.append(list(system))
        pending.append([t for t in turns if t["role"] == "user"])
    rounds = max((len(p) for p in pending), default=0)
    for r in range(rounds):
        active = [i for i, p in enumerate(pending) if len(p) > r]
        prompts = [history[i] + [pending[i][r]] for i in active]
        replies = generate_fn(prompts)
        if len(replies) != len(prompts):
            raise RuntimeError(
                f"generate_fn returned {len(replies)} replies for {len(prompts)} prompts"
            )
        for i, prompt, reply in zip(active, prompts, replies, strict=True):
            if reply is None:
                pending[i] = pending[i][:r]  # no later turn: its history would be longer still
                continue
            history[i] = prompt + [{"role": "assistant", "content": reply}]
    return [
        {"id": conv["id"], "source": conv["source"], "conversations": turns}
        for conv, turns in zip(conversations, history, strict=True)
        if any(t["role"] == "assistant" for t in turns)
    ]


def dropped_ids(conversations: list[dict], regenerated: list[dict]) -> list[str]:
    """Ids of the rows regeneration dropped (not one turn fitted in the length limit)."""
    kept = {c["id"] for c in regenerated}
    return [c["id"] for c in conversations if c["id"] not in kept]


def copy_answers(conversations: list[dict]) -> list[dict]:
    """Regeneration switched off: keep the source answers; every user turn must have one."""
    for conv in conversations:
        if conv["conversations"][-1]["role"] != "assistant":
            raise MissingAnswerError(
                f"regenerate.enabled is false but row {conv['id']!r} of source "
                f"{conv['source']!r} ends with a user turn that has no source answer"
            )
    return [dict(conv) for conv in conversations]


def write_jsonl(path, rows: list[dict]) -> None:
    from draftsmith.common import atomic_path

    with atomic_path(path) as tmp, open(tmp, "w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")


def main(argv: list[str] | None = None) -> None:
    from draftsmith.common import atomic_write_json, init_logging, merge_run, parse_cfg, versions
    from draftsmith.config import parse_range
    from draftsmith.prompts import SourceError, load_sources, rows_for_range

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
    regen = cfg.get("regenerate", {})
    a, b = parse_range(args.range)
    try:
        rows = rows_for_range(load_sources(cfg), a, b)
    except SourceError as e:
        raise SystemExit(str(e)) from None
    report = {"range": args.range, "rows": len(rows), "enabled": bool(regen.get("enabled", True))}
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
            regenerate_rows = engine("regenerate", regen.get("backend", "hf"))
        except EngineError as e:
            raise SystemExit(str(e)) from None
        with stop_guard("regenerate", regen.get("backend", "hf")):
            out, figures = regenerate_rows(
                rows,
                cfg,
                target=args.target,
                threads=args.threads,
                seed=int(regen.get("seed", 0)) + a,
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
