"""The engines registry: one module per engine, one function per stage."""

from __future__ import annotations

import types

import pytest

from draftsmith import engines
from draftsmith.engines import ENTRY_POINTS, EngineError, engine, implements


def test_hf_implements_every_stage():
    from draftsmith.engines import hf

    assert implements("hf") == list(ENTRY_POINTS)
    assert engine("regenerate", "hf") is hf.regenerate_rows
    assert engine("capture", "hf") is hf.capture_range
    assert engine("bench", "hf") is hf.bench_sets


def test_unknown_backend_and_stage_are_named():
    with pytest.raises(EngineError, match=r"bench.backend 'nope' is not an engine; engines: .*hf"):
        engine("bench", "nope")
    with pytest.raises(EngineError, match="unknown stage 'train'"):
        engine("train", "hf")


def test_engine_without_a_stage(monkeypatch):
    """An engine module that defines only some stages: asking for another one says so."""
    import sys

    mod = types.ModuleType("draftsmith_fake_engine")
    mod.regenerate_rows = lambda *a, **k: None
    monkeypatch.setitem(sys.modules, "draftsmith_fake_engine", mod)
    monkeypatch.setitem(engines.ENGINES, "fake", "draftsmith_fake_engine")
    assert implements("fake") == ["regenerate"]
    with pytest.raises(EngineError, match="the fake engine .* does not implement the capture"):
        engine("capture", "fake")
