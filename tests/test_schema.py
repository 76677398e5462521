"""Config schema: strict, documented, and enforced at parse time."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from wf import ROOT, snakemake, tiny_config, write_config

SCHEMA = yaml.safe_load((ROOT / "draftsmith" / "config" / "config.schema.yaml").read_text())
RESOURCE_WORDS = ("threads", "mem", "gpus_per", "partition", "outdir", "cores")


def walk(node, path="config"):
    if not isinstance(node, dict):
        return
    if node.get("type") == "object" or "properties" in node:
        yield path, node
    for key, child in node.get("properties", {}).items():
        yield from walk(child, f"{path}.{key}")
    if isinstance(node.get("additionalProperties"), dict):
        yield from walk(node["additionalProperties"], f"{path}.<name>")
    if isinstance(node.get("items"), dict):
        yield from walk(node["items"], f"{path}[]")


def test_every_key_is_typed_described_and_defaulted():
    problems = []
    for path, obj in walk(SCHEMA):
        if obj.get("additionalProperties", None) is not False and not isinstance(
            obj.get("additionalProperties"), dict
        ):
            problems.append(f"{path}: additionalProperties must be false")
        required = set(obj.get("required", []))
        for key, prop in obj.get("properties", {}).items():
            where = f"{path}.{key}"
            if "description" not in prop:
                problems.append(f"{where}: no description")
            if "type" not in prop and "oneOf" not in prop:
                problems.append(f"{where}: no type")
            if "default" not in prop and key not in required:
                problems.append(f"{where}: no default")
            if any(w in key for w in RESOURCE_WORDS):
                problems.append(f"{where}: resources belong in profiles/, not config")
    assert not problems, "\n".join(problems)


def test_default_config_validates():
    import jsonschema

    cfg = yaml.safe_load((ROOT / "config.yaml").read_text())
    jsonschema.validate(cfg, SCHEMA)


@pytest.mark.parametrize(
    "section, value, needle",
    [
        ("trian", {"lr": 1.0}, "trian"),  # misspelt top-level key
        ("train", {"learning_rate": 1.0}, "learning_rate"),  # unknown nested key
        ("train", {"epochs": "four"}, "four"),  # wrong type
        ("capture", {"dtype": "int4"}, "int4"),  # not an allowed value
    ],
)
def test_bad_config_fails_at_parse_time_naming_the_key(tmp_path: Path, section, value, needle):
    cfg = tiny_config(tmp_path / "nonexistent-target")
    cfg[section] = {**cfg.get(section, {}), **value}
    write_config(tmp_path, cfg)
    proc = snakemake(tmp_path, "-n", check=False)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert needle in out, out[-3000:]
    assert "ValidationError" in out or "validation" in out.lower(), out[-3000:]


def test_config_doc_is_generated_from_the_schema():
    from draftsmith.config.doc import render

    assert (ROOT / "docs" / "config.md").read_text() == render(SCHEMA), (
        "docs/config.md is stale: run `python -m draftsmith config-doc > docs/config.md`"
    )
