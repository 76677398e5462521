"""The engines registry: one module per engine, one function per stage."""

from __future__ import annotations

import types

import pytest

from draftsmith import engines
from draftsmith.engines import ENTRY_POINTS, EngineError, engine, implements


def test_hf_implements_every_stage():
    from draftsmith.engines.hf import engine as hf

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


def test_workflow_needs_are_read_without_importing_the_engine():
    """needs() reads each engine's WORKFLOW literal from its source: what the module itself
    holds, over the defaults, and the engine's module stays unimported (the Snakefile asks)."""
    import importlib
    import subprocess
    import sys

    code = (
        "import sys\n"
        "from draftsmith.engines import ENGINES, needs\n"
        "[needs(e) for e in ENGINES]\n"
        "assert not [m for m in ENGINES.values() if m in sys.modules], sys.modules.keys()\n"
        "assert 'torch' not in sys.modules\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
    for name, module in engines.ENGINES.items():
        declared = importlib.import_module(module).WORKFLOW
        assert engines.needs(name) == {**engines.NEEDS, **declared}


def test_workflow_declaration_is_checked(monkeypatch, tmp_path):
    import sys

    fake = tmp_path / "draftsmith_fake_decl.py"
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setitem(engines.ENGINES, "fake", "draftsmith_fake_decl")
    fake.write_text('WORKFLOW = {"gpus": 2, "colour": "red"}\n')
    with pytest.raises(EngineError, match=r"WORKFLOW keys \['colour'\] are not among"):
        engines.needs("fake")
    fake.write_text("WORKFLOW = dict(gpus=2)\n")
    with pytest.raises(EngineError, match="WORKFLOW must be a literal"):
        engines.needs("fake")
    fake.write_text('WORKFLOW = {"honours": ["bench.temperature"]}\n')
    assert engines.needs("fake")["gpus"] == 1
    assert engines.honoured_by("bench.temperature") == ["hf", "sglang", "vllm", "fake"]
    assert "draftsmith_fake_decl" not in sys.modules


def test_own_settings_name_the_section_and_its_dataclass(monkeypatch, tmp_path):
    """own_settings: (section, its dataclass) of an engine with a settings section, derived from
    the one declaration, WORKFLOW's "settings", without importing the engine; None without one
    or for a backend that is no engine, an error when the section has no dataclass."""
    import sys
    from dataclasses import is_dataclass

    from draftsmith.config.settings import ENGINE_SECTIONS

    assert engines.own_settings("hf") is None and engines.own_settings("nope") is None
    section, cls = engines.own_settings("sglang")
    assert section == "sglang" and is_dataclass(cls) and cls is ENGINE_SECTIONS["sglang"]
    fake = tmp_path / "draftsmith_fake_own.py"
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setitem(engines.ENGINES, "fake", "draftsmith_fake_own")
    fake.write_text('WORKFLOW = {"settings": "sglang"}\n')
    assert engines.own_settings("fake") == ("sglang", ENGINE_SECTIONS["sglang"])
    fake.write_text('WORKFLOW = {"settings": "nosuch"}\n')
    with pytest.raises(EngineError, match="names the settings section 'nosuch', which has no"):
        engines.own_settings("fake")
    assert "draftsmith_fake_own" not in sys.modules


def test_check_config_asks_the_declarations(monkeypatch, tmp_path):
    """check_config refuses sampling for the engines whose WORKFLOW does not honour
    bench.temperature, and names the ones that do: no engine name in the rule itself."""
    from wf import with_defaults

    from draftsmith.config.checks import ConfigError, check_config

    (tmp_path / "draftsmith_fake_sampler.py").write_text(
        'WORKFLOW = {"honours": ["bench.temperature"]}\n'
    )
    (tmp_path / "draftsmith_fake_greedy.py").write_text("WORKFLOW = {}\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setitem(engines.ENGINES, "fake", "draftsmith_fake_sampler")
    monkeypatch.setitem(engines.ENGINES, "greedy", "draftsmith_fake_greedy")
    cfg = with_defaults({"target": {"source": "embedded"}, "bench": {"temperature": 0.5}})
    cfg["bench"]["backend"] = "fake"
    check_config(cfg)
    cfg["bench"]["backend"] = "greedy"
    with pytest.raises(
        ConfigError, match="only the hf and sglang and vllm and fake engine .* bench.backend hf or"
    ):
        check_config(cfg)
