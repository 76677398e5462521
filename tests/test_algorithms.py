"""draft.algorithm and the algorithm seam (draftsmith.algorithms): the schema's values, the
default's params unchanged, and what each algorithm adds to the draft and its export."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from draftsmith import algorithms

ROOT = Path(__file__).resolve().parents[1]
SCHEMA = yaml.safe_load((ROOT / "schemas" / "config.schema.yaml").read_text())


def test_schema_values_are_the_registry():
    prop = SCHEMA["properties"]["draft"]["properties"]["algorithm"]
    assert prop["enum"] == algorithms.names()
    assert prop["default"] == algorithms.DEFAULT == "eagle3"
    assert prop["x-omit-default"] is True
    for name in algorithms.names():
        assert algorithms.get(name).NAME == name
    with pytest.raises(algorithms.AlgorithmError, match="draft.algorithm 'medusa'"):
        algorithms.get("medusa")


def test_the_default_algorithm_stales_nothing():
    """draft.algorithm at its default is left out of the train job's params (the draft built
    before the key existed is the one built now); eagle3.1 is in them."""
    from draftsmith.config import neutral_defaults, sections_json

    neutral = neutral_defaults(SCHEMA)
    assert neutral["draft"]["algorithm"] == "eagle3"
    draft = {"vocab_size": 4096, "init_from_target": True, "serve_check": "warn"}
    before = sections_json({"draft": draft}, ["draft"], neutral=neutral)
    now = sections_json({"draft": {**draft, "algorithm": "eagle3"}}, ["draft"], neutral=neutral)
    assert now == before
    other = {"draft": {**draft, "algorithm": "eagle3.1"}}
    assert json.loads(sections_json(other, ["draft"], neutral=neutral))["draft"]["algorithm"] == (
        "eagle3.1"
    )
    assert algorithms.of_config({"draft": draft}).NAME == "eagle3"
    assert algorithms.of_config(other).NAME == "eagle3.1"
