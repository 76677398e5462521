"""Row shapes: what one row of a prompt source holds, validated into a conversation.

A row is a dict, whatever file it came from (a JSONL line, a record of a JSON array, a row of a
parquet or Arrow table). Its shape is one of

    specforge  {"id"?, "conversations": [{"role", "content"}, ...]}
    sharegpt   {"id"?, "conversations": [{"from": "human|gpt|system", "value"}, ...]}
    messages   {"id"?, "messages": [{"role", "content"}, ...]}   (OpenAI chat)
    prompt     {"id"?, "prompt", "system"?}

`parse_row(obj, shape)` returns the validated turns and the shape it read: a row holding a
`messages` list but not the named shape's key is read as OpenAI messages whatever shape the
source names. `detect_shape(rows)` tells the shape of a source's first rows (`format: auto`).
A row that cannot be read raises BadRow, whose message names the key at fault.
"""

from __future__ import annotations

from collections import Counter

ROLES = ("system", "user", "assistant")
SHAPES = ("specforge", "sharegpt", "messages", "prompt")
# the top-level key each shape's rows carry
SHAPE_KEYS = (
    ("specforge", "conversations"),
    ("sharegpt", "conversations"),
    ("messages", "messages"),
    ("prompt", "prompt"),
)
SHAREGPT_ROLES = (
    ("system", "system"),
    ("human", "user"),
    ("user", "user"),
    ("gpt", "assistant"),
    ("assistant", "assistant"),
    ("chatgpt", "assistant"),
)


class SourceError(ValueError):
    """A prompt source that cannot be read at all (missing file, unknown format, broken file)."""


class BadRow(ValueError):
    """One row that is skipped; the message is the reason recorded in the report."""


def shape_key(shape: str) -> str:
    return dict(SHAPE_KEYS)[shape]


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
        raise BadRow("missing or not a list")
    roles = dict(SHAREGPT_ROLES)
    mapped = []
    for i, turn in enumerate(turns):
        if not isinstance(turn, dict):
            raise BadRow(f"turn {i} is not an object")
        who = turn.get("from")
        if who not in roles:
            raise BadRow(f"turn {i} has unknown 'from' {who!r}")
        mapped.append({"role": roles[who], "content": turn.get("value")})
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
        raise BadRow("missing or not a list")
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
    if obj.get("system") is not None:  # a table's column is None where a row has no system turn
        turns.append({"role": "system", "content": obj["system"]})
    turns.append({"role": "user", "content": obj.get("prompt")})
    return check_conversation(turns)


def parse_row(obj, shape: str) -> tuple[list[dict], str]:
    """(validated turns, the shape read) of one row in `shape`; BadRow names the key at fault.

    OpenAI `messages` rows are recognised whatever shape the source names: a row without the
    named shape's key but with a `messages` list is read as messages."""
    if not isinstance(obj, dict):
        raise BadRow("not a JSON object")
    key = shape_key(shape)
    if key not in obj and isinstance(obj.get("messages"), list):
        shape, key = "messages", "messages"
    parse = {
        "specforge": _from_specforge,
        "sharegpt": _from_sharegpt,
        "messages": _from_messages,
        "prompt": _from_prompt,
    }[shape]
    try:
        return parse(obj), shape
    except BadRow as e:
        keys = ", ".join(repr(k) for k in sorted(obj)) or "none"
        detail = f" (the row's keys: {keys})" if key not in obj else ""
        raise BadRow(f"key {key!r}: {e}{detail}") from None


def row_shape(obj) -> str | None:
    """The shape one row shows, or None (not an object, or no key of any shape)."""
    if not isinstance(obj, dict):
        return None
    if isinstance(obj.get("messages"), list):
        return "messages"
    turns = obj.get("conversations")
    if isinstance(turns, list):
        first = next((t for t in turns if isinstance(t, dict)), {})
        return "sharegpt" if "from" in first or "value" in first else "specforge"
    return "prompt" if "prompt" in obj else None


def detect_shape(rows) -> tuple[str | None, dict]:
    """(the most common shape among `rows`, {shape: count}); ties go to the shape seen first."""
    counts = Counter(s for s in map(row_shape, rows) if s)
    return (counts.most_common(1)[0][0] if counts else None), dict(counts)


def shape_of_keys(keys) -> str | None:
    """The shapes a row with these keys suggests (for the error of a source read in another)."""
    found = [s for s, k in SHAPE_KEYS if k in (keys or ())]
    return " or ".join(found) or None
