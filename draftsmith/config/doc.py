"""Render docs/config.md from draftsmith/config/config.schema.yaml (a test keeps the two in step).

python -m draftsmith config-doc > docs/config.md      # regenerate the reference
python -m draftsmith config-doc --check docs/config.md  # exit 1 when it is stale
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import yaml

from draftsmith.runtime.files import command_parser

SCHEMA = Path(__file__).resolve().parent / "config.schema.yaml"


def _type(prop: dict) -> str:
    if "oneOf" in prop:
        return " or ".join(_type(p) for p in prop["oneOf"])
    t = prop.get("type", "")
    if "enum" in prop:
        return f"{t}: " + " \\| ".join(f"`{v}`" for v in prop["enum"])
    return t


def _rows(node: dict, prefix: str):
    for key, prop in node.get("properties", {}).items():
        name = f"{prefix}.{key}" if prefix else key
        default = json.dumps(prop.get("default")) if "default" in prop else "(required)"
        desc = " ".join(prop.get("description", "").split()).replace("|", "\\|")
        yield f"| `{name}` | {_type(prop)} | `{default}` | {desc} |"
        if "properties" in prop:
            yield from _rows(prop, name)
        if isinstance(prop.get("additionalProperties"), dict):
            yield from _rows(prop["additionalProperties"], f"{name}.<role>")
        if isinstance(prop.get("items"), dict) and "properties" in prop["items"]:
            yield from _rows(prop["items"], f"{name}[]")


def render(schema: dict) -> str:
    lines = [
        "# Configuration keys",
        "",
        "Generated from `draftsmith/config/config.schema.yaml` by `python -m draftsmith config-doc`;",
        "do not edit by hand. Unknown keys are errors at parse time. Threads, memory, GPUs",
        "and partitions are not config: they live in `profiles/`.",
        "",
        "| key | type | default | description |",
        "|---|---|---|---|",
        *_rows(schema, ""),
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    ap = command_parser("config-doc", __doc__)
    ap.add_argument("--check", type=Path, metavar="CONFIG_MD", help="compare with this file")
    args = ap.parse_args(argv)
    text = render(yaml.safe_load(SCHEMA.read_text()))
    if args.check is None:
        print(text, end="")
    elif args.check.read_text() != text:
        sys.exit(f"{args.check} is stale: run `python -m draftsmith config-doc > {args.check}`")
