"""What goes into the benchmark, counted: rows skipped as bad, prompts refused as too long.

`screen_sets(sets, skipped, target_dir, job, tokenizer)` chat-templates every prompt with the
target's tokenizer and refuses (leaves out of its set) each prompt whose tokens plus
`bench.max_new_tokens` do not fit the target's context (`max_position_embeddings`): a
speculative or greedy run past it measures nothing a server would serve. Refused, not truncated:
a cut prompt is another prompt. The report's `input` section says, per set, how many rows were
used, skipped as bad (empty or blank prompts, broken JSON: `draftsmith.data.prompts.read_source`) and
refused as too long, with the first ids; report.md has the same in one line.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

log = logging.getLogger("draftsmith.stages.bench")
LISTED = 5


def target_context(target_dir: Path) -> int | None:
    cfg = json.loads((Path(target_dir) / "config.json").read_text())
    cfg = cfg.get("text_config", cfg)
    n = cfg.get("max_position_embeddings")
    return int(n) if n else None


def screen_sets(
    sets: dict[str, list[dict]], skipped: dict[str, dict], target_dir: Path, job, tokenizer
) -> tuple[dict[str, list[dict]], dict[str, dict]]:
    """(sets without the prompts too long for the target, the `input` report per set);
    `tokenizer`: the target's, as the bench engine's role loads it (`job`: the bench job's
    JobSettings)."""
    from draftsmith.bench.specdec import prompt_ids
    from draftsmith.data.prompts import prompt_turns

    max_new_tokens = int(job.bench.max_new_tokens)
    context = target_context(target_dir)
    kept_sets, report = {}, {}
    for name, rows in sets.items():
        kept, too_long = [], []
        for row in rows:
            n = len(prompt_ids(tokenizer, prompt_turns(row)))
            if context is not None and n + max_new_tokens > context:
                too_long.append({"id": row["id"], "prompt_tokens": n})
            else:
                kept.append(row)
        bad = skipped.get(name, {})
        report[name] = {
            "used": len(kept),
            "skipped_bad_rows": int(bad.get("skipped", 0)),
            "first_bad_rows": bad.get("first_bad_rows", []),
            "refused_too_long": len(too_long),
            "first_too_long": too_long[:LISTED],
            "context": context,
            "max_new_tokens": max_new_tokens,
            "too_long_policy": "refused",
        }
        if too_long:
            log.warning(
                "%s: refused %d prompt(s) longer than the target's context (%d positions, "
                "%d new tokens): %s",
                name,
                len(too_long),
                context,
                max_new_tokens,
                too_long[:LISTED],
            )
        if not kept:
            raise SystemExit(
                f"bench set {name}: no prompt left ({len(too_long)} longer than the target's "
                f"context of {context} positions with bench.max_new_tokens {max_new_tokens}, "
                f"{report[name]['skipped_bad_rows']} bad rows skipped)"
            )
        kept_sets[name] = kept
    return kept_sets, report


def input_line(report: dict) -> str:
    """One sentence for report.md: what each set used, skipped and refused."""
    parts = []
    for name, r in report.items():
        parts.append(
            f"{name} {r['used']} used, {r['skipped_bad_rows']} skipped as bad rows, "
            f"{r['refused_too_long']} refused as longer than the context ({r['context']} "
            f"positions incl. {r['max_new_tokens']} new tokens)"
        )
    return "Prompts: " + "; ".join(parts) + "."
