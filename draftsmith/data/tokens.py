"""Tokenization: render each conversation with the target's own chat template, derive the loss mask.

The mask covers the content of every assistant turn plus the end-of-turn token that follows it
(`<|im_end|>`, `<|eot_id|>`, `<｜end▁of▁sentence｜>`, ...); role headers, system and user text are
excluded. `apply_chat_template(return_assistant_tokens_mask=True)` only works for templates with
`{% generation %}` markers, so the mask is derived from the rendered text instead:

1. render the whole conversation (`tokenize=False`);
2. for assistant turn k, render turns[:k] with the generation prompt; the rendered conversation
   starts with that prefix, so the turn's content is searched from the prefix's end;
3. tokenize the full text once with character offsets and mark tokens overlapping the content;
4. the first token at or after the content's end is the end-of-turn token; it must be a special
   (added) token, otherwise the template is not one we understand and we stop.

Thinking models (Qwen3, Kimi-K2.5, DeepSeek-R1) reply with a reasoning block
(`<think>...</think>` before the answer) that their templates drop from earlier turns (R1: from
every turn), so the stored turn is not in the rendering. `data.reasoning` says what is trained
then: `verbatim` (the default) refuses such rows; `last` and `all` find each turn as the template
renders it (whole, with the whitespace around the reasoning markers the template's own, else its
answer alone) and train the last assistant turn only (TorchSpec's rule) or every one.
`regenerate.thinking` enabled/disabled renders with the templates' switches (`enable_thinking`, `thinking`).

Output per row range, packed: `input_ids [T] int64`, `loss_mask [T] uint8`, `row_offsets [R+1] int64`
(safetensors, atomic). Rows longer than `data.max_length` are truncated (mask with them) or dropped.

CLI (rule tokenize): `python -m draftsmith tokens --cfg <json> --rows results/data/rows_<a>-<b>.jsonl
--target results/target --out results/tokens/rows_<a>-<b>.safetensors`.
"""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

from draftsmith.runtime.files import atomic_path, command_parser, init_logging, parse_cfg

log = logging.getLogger("draftsmith.data.tokens")
# the reasoning block of a thinking reply, before its answer (Qwen3, DeepSeek-R1, Kimi-K2.5)
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
# the chat-template switches of thinking: Qwen3's, and Kimi-K2.5's / DeepSeek-V3.1's
THINKING_SWITCHES = ("enable_thinking", "thinking")
REASONING_RULES = ("verbatim", "last", "all")  # data.reasoning
THINKING_MODES = ("template", "enabled", "disabled")  # regenerate.thinking


class TemplateError(ValueError):
    """The chat template renders a conversation in a way the mask derivation cannot follow."""


def template_kwargs(thinking: str = "template") -> dict:
    """Chat template variables of `regenerate.thinking`: none for `template` (its default), else
    every family's switch set true or false (a template reads its own, ignores the others)."""
    if thinking not in THINKING_MODES:
        raise ValueError(f"regenerate.thinking must be one of {THINKING_MODES}, got {thinking!r}")
    return {} if thinking == "template" else dict.fromkeys(THINKING_SWITCHES, thinking == "enabled")


def render(
    tokenizer, turns: list[dict], add_generation_prompt: bool = False, thinking: str = "template"
) -> str:
    return tokenizer.apply_chat_template(
        turns,
        tokenize=False,
        add_generation_prompt=add_generation_prompt,
        **template_kwargs(thinking),
    )


def template_refusal(tokenizer, turns: list[dict]) -> str | None:
    """The chat template's own refusal of these turns (its `raise_exception`, e.g. Gemma-2's
    "System role not supported"), or None when it renders them: the turns as given, and as
    regeneration asks them (each user turn with the generation prompt, a placeholder answer
    after it)."""
    from jinja2.exceptions import TemplateError as JinjaTemplateError

    probe = [t for t in turns if t["role"] != "assistant"]
    asked = []
    for turn in probe:
        asked.append(turn)
        if turn["role"] == "user":
            asked.append({"role": "assistant", "content": "..."})
    try:
        render(tokenizer, turns)
        render(tokenizer, asked)
        render(tokenizer, asked[:-1], add_generation_prompt=True)
    except JinjaTemplateError as e:
        return f"the chat template refuses it: {e}"
    return None


def split_refused(tokenizer, rows: list[dict]) -> tuple[list[dict], list[dict]]:
    """(rows the chat template renders, [{"id", "source", "reason"}] of those it refuses)."""
    kept, refused = [], []
    for row in rows:
        reason = template_refusal(tokenizer, row["conversations"])
        if reason is None:
            kept.append(row)
        else:
            refused.append({"id": row["id"], "source": row["source"], "reason": reason})
    return kept, refused


def log_refused(where: str, refused: list[dict], listed: int = 5) -> None:
    """One warning naming the refused rows (source and id) and the template's reason."""
    if refused:
        shown = "; ".join(f"{r['source']} row {r['id']}: {r['reason']}" for r in refused[:listed])
        more = f"; and {len(refused) - listed} more" if len(refused) > listed else ""
        log.warning(
            "%s: skipped %d rows the chat template refuses (%s%s); data.system_prompt drop or "
            "merge removes system turns",
            where,
            len(refused),
            shown,
            more,
        )


def _relaxed(content: str) -> re.Pattern:
    """The content with any whitespace around the reasoning markers (templates re-space them)."""
    parts = re.split(rf"\s*({re.escape(THINK_OPEN)}|{re.escape(THINK_CLOSE)})\s*", content)
    return re.compile(r"\s*".join(re.escape(p) for p in parts if p))


def find_turn(text: str, content: str, lower: int, relaxed: bool) -> tuple[int, int, bool] | None:
    """(start, end, reasoning kept) of an assistant turn's content in the rendered text at or
    after `lower`: verbatim; or, `relaxed`, re-spaced around its reasoning markers, else its
    answer alone (the template dropped the reasoning). None: not rendered."""
    start = text.find(content, lower)
    if start >= 0:
        return start, start + len(content), True
    if not relaxed or THINK_CLOSE not in content:
        return None
    found = _relaxed(content).search(text, lower)
    if found:
        return found.start(), found.end(), True
    answer = content.split(THINK_CLOSE)[-1].strip()
    start = text.find(answer, lower) if answer else -1
    return (start, start + len(answer), False) if start >= 0 else None


def assistant_spans(
    tokenizer, turns: list[dict], reasoning: str = "verbatim", thinking: str = "template"
) -> tuple[str, list[tuple[int, int]], int]:
    """Rendered text, the character span of each trained assistant turn's content in it (every
    turn, or the last one for `reasoning` last) and the turns whose reasoning was not rendered."""
    if reasoning not in REASONING_RULES:
        raise ValueError(f"data.reasoning must be one of {REASONING_RULES}, got {reasoning!r}")
    text = render(tokenizer, turns, thinking=thinking)
    last = max((k for k, t in enumerate(turns) if t["role"] == "assistant"), default=-1)
    spans, cursor, dropped = [], 0, 0
    for k, turn in enumerate(turns):
        if turn["role"] != "assistant":
            continue
        prefix = render(tokenizer, turns[:k], add_generation_prompt=True, thinking=thinking)
        lower = max(cursor, len(prefix)) if text.startswith(prefix) else cursor
        content = turn["content"].strip()
        found = find_turn(text, content, lower, relaxed=reasoning != "verbatim")
        if found is None:
            raise TemplateError(
                f"assistant turn {k} ({content[:40]!r}...) not found in the rendered chat "
                f"template after position {lower}; the template rewrites assistant content"
                + (
                    " (a thinking template drops earlier turns' reasoning: data.reasoning "
                    "last or all)"
                    if reasoning == "verbatim" and THINK_CLOSE in content
                    else ""
                )
            )
        start, end, kept = found
        dropped += int(not kept)
        if reasoning != "last" or k == last:
            spans.append((start, end))
        cursor = end
    return text, spans, dropped


def _special_ids(tokenizer) -> set[int]:
    ids = set(tokenizer.all_special_ids)
    ids.update(tokenizer.added_tokens_decoder.keys())
    return ids


def encode_with_mask(
    tokenizer, turns: list[dict], reasoning: str = "verbatim", thinking: str = "template"
) -> tuple[list[int], list[int]]:
    """Token ids of the rendered conversation and its 0/1 loss mask (same length)."""
    ids, mask, _ = encode_turns(tokenizer, turns, reasoning, thinking)
    return ids, mask


def encode_turns(tokenizer, turns, reasoning: str = "verbatim", thinking: str = "template"):
    """(ids, mask, turns whose reasoning the template did not render) of one conversation."""
    text, spans, dropped = assistant_spans(tokenizer, turns, reasoning, thinking)
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids, offsets = list(enc["input_ids"]), list(enc["offset_mapping"])
    mask = [0] * len(ids)
    special = _special_ids(tokenizer)
    for start, end in spans:
        for i, (s, e) in enumerate(offsets):
            if s < end and e > start:
                mask[i] = 1
        eot = next((i for i, (s, e) in enumerate(offsets) if s >= end and e > s), None)
        if eot is None or ids[eot] not in special:
            found = "nothing" if eot is None else repr(tokenizer.convert_ids_to_tokens(ids[eot]))
            raise TemplateError(
                f"expected a special end-of-turn token right after assistant content, found "
                f"{found}; the chat template is not supported by the mask derivation"
            )
        mask[eot] = 1
    return ids, mask, dropped


def end_of_turn_id(tokenizer) -> int:
    """The token the chat template puts after assistant content (generation stops there)."""
    probe = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]
    ids, mask = encode_with_mask(tokenizer, probe)
    return ids[max(i for i, m in enumerate(mask) if m)]


def tokenize_rows(
    tokenizer,
    rows: list[dict],
    max_length: int,
    overlong: str = "truncate",
    reasoning: str = "verbatim",
    thinking: str = "template",
):
    """Pack rows -> (arrays dict, stats dict): numpy int64 ids and offsets, uint8 mask (no torch:
    the tokenize job never imports it). `rows` are conversation dicts (prompts module);
    `reasoning` (data.reasoning) and `thinking` (regenerate.thinking) as in the module doc."""
    import numpy as np

    if overlong not in ("truncate", "drop"):
        raise ValueError(f"data.overlong must be truncate or drop, got {overlong!r}")
    all_ids, all_mask, offsets, kept = [], [], [0], []
    truncated, dropped, no_mask, unrendered = [], [], [], 0
    ok, refused = split_refused(tokenizer, rows)
    ok_ids = {id(row) for row in ok}
    for i, row in enumerate(rows):
        if id(row) not in ok_ids:
            continue  # the chat template refuses it (counted in stats["refused"])
        try:
            ids, mask, n = encode_turns(tokenizer, row["conversations"], reasoning, thinking)
            unrendered += n
        except TemplateError as e:
            raise TemplateError(f"row {row['id']} ({row['source']}): {e}") from None
        if len(ids) > max_length:
            if overlong == "drop":
                dropped.append(row["id"])
                continue
            ids, mask = ids[:max_length], mask[:max_length]
            truncated.append(row["id"])
        if not any(mask):
            no_mask.append(row["id"])
        all_ids.extend(ids)
        all_mask.extend(mask)
        offsets.append(len(all_ids))
        kept.append(i)
    tensors = {
        "input_ids": np.asarray(all_ids, dtype=np.int64),
        "loss_mask": np.asarray(all_mask, dtype=np.uint8),
        "row_offsets": np.asarray(offsets, dtype=np.int64),
    }
    stats = {
        "rows": len(rows),
        "kept": len(kept),
        "kept_rows": kept,
        "tokens": len(all_ids),
        "masked_tokens": int(sum(all_mask)),
        "truncated": truncated,
        "dropped": dropped,
        "rows_without_loss": no_mask,
    }
    if reasoning != "verbatim":  # (verbatim: every turn is rendered whole)
        stats["reasoning_not_rendered"] = unrendered
    if refused:
        stats["refused"] = refused
    return tensors, stats


def write_tokens(path, tensors: dict, stats: dict) -> None:
    """Write a tokens file from numpy arrays (or CPU torch tensors): the same bytes either way."""
    import numpy as np
    from safetensors.numpy import save_file

    meta = {"format": "draftsmith.data.tokens/1", "stats": json.dumps(stats)}
    arrays = {k: np.ascontiguousarray(np.asarray(v)) for k, v in tensors.items()}
    with atomic_path(path) as tmp:
        save_file(arrays, str(tmp), metadata=meta)


GENERIC_FAST = ("TokenizersBackend", "PreTrainedTokenizerFast")


def load_tokenizer(target: Path, trust_remote_code: bool = False):
    """The target's tokenizer, as AutoTokenizer loads it. A tokenizer.json whose config names
    the generic fast class (and no remote code) is loaded by that class directly, which is what
    AutoTokenizer resolves it to, without importing the model configuration classes and torch
    (seconds of a tokenize job's start-up)."""
    cfg_path = Path(target) / "tokenizer_config.json"
    try:
        cfg = json.loads(cfg_path.read_text()) if cfg_path.is_file() else {}
    except ValueError:
        cfg = {}
    generic = cfg.get("tokenizer_class") in GENERIC_FAST and "auto_map" not in cfg
    if generic and not trust_remote_code and (Path(target) / "tokenizer.json").is_file():
        from transformers import PreTrainedTokenizerFast

        return PreTrainedTokenizerFast.from_pretrained(Path(target))
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(Path(target), trust_remote_code=trust_remote_code)


def read_tokens(path) -> dict:
    """{"input_ids", "loss_mask", "row_offsets"} of one tokens file, checked for consistency."""
    from safetensors.torch import load_file

    t = load_file(str(path))
    missing = {"input_ids", "loss_mask", "row_offsets"} - set(t)
    if missing:
        raise ValueError(f"{path}: missing tensors {sorted(missing)}")
    n = t["input_ids"].numel()
    if t["loss_mask"].numel() != n or int(t["row_offsets"][-1]) != n:
        raise ValueError(
            f"{path}: input_ids ({n}), loss_mask ({t['loss_mask'].numel()}) and "
            f"row_offsets[-1] ({int(t['row_offsets'][-1])}) disagree"
        )
    return t


def read_rows_jsonl(path) -> list[dict]:
    rows = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise SystemExit(f"{path}:{lineno}: not JSON ({e.msg})") from None
    return rows


def main(argv: list[str] | None = None) -> None:
    ap = command_parser("tokens", __doc__)
    ap.add_argument("--cfg", required=True, help="JSON with the data section")
    ap.add_argument("--rows", required=True, help="results/data/rows_<a>-<b>.jsonl")
    ap.add_argument("--target", required=True, help="target HF directory (tokenizer)")
    ap.add_argument("--out", required=True, help="results/tokens/rows_<a>-<b>.safetensors")
    args = ap.parse_args(argv)
    init_logging("draftsmith.data.tokens")
    cfg = parse_cfg(args.cfg)
    data = cfg["data"]
    tokenizer = load_tokenizer(
        Path(args.target),
        trust_remote_code=bool(
            # a target section only when trust_remote_code is on (or thinking is set)
            "target" in cfg and cfg["target"].get("trust_remote_code")
        ),
    )
    if not tokenizer.is_fast:
        raise SystemExit(f"{args.target}: the tokenizer must be a fast tokenizer (offsets)")
    rows = read_rows_jsonl(args.rows)
    try:
        tensors, stats = tokenize_rows(
            tokenizer,
            rows,
            int(data["max_length"]),
            data["overlong"],
            # x-omit-default: absent from the job's config at their defaults
            reasoning=data.get("reasoning", "verbatim"),
            thinking=(cfg.get("regenerate") or {}).get("thinking", "template"),
        )
    except TemplateError as e:
        raise SystemExit(f"{args.rows}: {e}") from None
    log_refused(args.rows, stats.get("refused", []))
    log.info(
        "%s: %d/%d rows, %d tokens, %d masked, %d truncated, %d dropped, %d without loss",
        args.rows,
        stats["kept"],
        stats["rows"],
        stats["tokens"],
        stats["masked_tokens"],
        len(stats["truncated"]),
        len(stats["dropped"]),
        len(stats["rows_without_loss"]),
    )
    write_tokens(args.out, tensors, stats)
