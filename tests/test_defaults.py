"""No default is repeated outside the schema: a `.get("key", <literal>)` in `draftsmith/` whose
literal is the schema's default for a property of that name is a second copy of that default
(the validated config carries every default: `rules/common.smk` validates with the schema).

Exempt by rule: properties marked `x-omit-default` (jobs do not receive them while at their
default, so their readers must fall back to exactly the schema's value, which this test then
proves). Exempt by file or by (file, key): `ALLOWED` below, each entry with its reason.
"""

from __future__ import annotations

import ast
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
SCHEMA = ROOT / "draftsmith" / "config" / "config.schema.yaml"

# (file, key) -> why that fallback stays; key None: the whole file.
ALLOWED = {
    # Storage.from_config also reads the converters' `--storage` JSON (python -m
    # draftsmith convert), which no schema validates: its defaults are that CLI's defaults.
    ("draftsmith/hidden/storage.py", None): "reads unvalidated CLI JSON too",
    # storage_keys mirrors Storage.from_config's defaults for the same JSON.
    ("draftsmith/config/checks.py", None): "mirrors storage.py",
    # read_source also reads specs built in code (the bundled set when data.sources is empty,
    # bench's sets), and load_sources any dict holding a data section (docs/data.md).
    ("draftsmith/data/prompts.py", "max_rows"): "specs built in code",
    # envs holds an entry only for the roles a user configures: a role without one (`cpu`,
    # usually) has no object for the schema to fill, so its item defaults are read here
    ("draftsmith/config/workflow.py", "python"): "a role without an envs entry",
    ("draftsmith/config/workflow.py", "gpus"): "a role without an envs entry",
}


def schema_defaults(schema: dict) -> tuple[dict[str, list], dict[str, list]]:
    """{property name: [defaults]} over the whole schema, for all properties and for those
    marked x-omit-default."""
    defaults: dict[str, list] = {}
    neutral: dict[str, list] = {}

    def walk(node) -> None:
        if isinstance(node, dict):
            for name, prop in (node.get("properties") or {}).items():
                if isinstance(prop, dict) and "default" in prop:
                    defaults.setdefault(name, []).append(prop["default"])
                    if prop.get("x-omit-default"):
                        neutral.setdefault(name, []).append(prop["default"])
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    walk(schema)
    return defaults, neutral


def same(a, b) -> bool:
    return type(a) is type(b) and a == b or ({type(a), type(b)} <= {int, float} and a == b)


def repeated_defaults(path: Path, defaults: dict, neutral: dict) -> list[str]:
    found, where = [], str(path.relative_to(ROOT))
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if not (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "get"
            and len(node.args) == 2
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
        ):
            continue
        key = node.args[0].value
        try:
            literal = ast.literal_eval(node.args[1])
        except ValueError:
            continue
        if any(same(literal, d) for d in neutral.get(key, [])):
            continue  # the default of an x-omit-default property of that name
        if (where, None) in ALLOWED or (where, key) in ALLOWED:
            continue
        if any(same(literal, d) for d in defaults.get(key, [])):
            found.append(f"{where}:{node.lineno}: .get({key!r}, {literal!r})")
    return found


def test_the_scanner_finds_a_repeated_default(tmp_path):
    src = tmp_path / "m.py"
    src.write_text(
        'def f(cfg):\n    return cfg["capture"].get("dtype", "bfloat16"), cfg.get("x", 1)\n'
    )
    global ROOT
    saved, ROOT = ROOT, tmp_path
    try:
        hits = repeated_defaults(src, {"dtype": ["bfloat16"], "x": [2]}, {})
        assert hits == ["m.py:2: .get('dtype', 'bfloat16')"]
        assert repeated_defaults(src, {"dtype": ["bfloat16"]}, {"dtype": ["bfloat16"]}) == []
    finally:
        ROOT = saved


def test_no_schema_default_is_repeated_in_the_package():
    defaults, neutral = schema_defaults(yaml.safe_load(SCHEMA.read_text()))
    assert "dtype" in defaults and neutral, "the schema reader found no defaults"
    found = []
    for path in sorted((ROOT / "draftsmith").rglob("*.py")):
        found += repeated_defaults(path, defaults, neutral)
    assert not found, (
        "schema defaults repeated (read the validated config with cfg[section][key]):\n"
        + "\n".join(found)
    )
