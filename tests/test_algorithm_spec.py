"""The algorithm seam: one spec per algorithm (draftsmith.algorithms.spec), resolved once,
carrying the engines' serving flags and what the algorithm refuses; a fourth algorithm is one
folder and a registry line; pairs no engine serves are refused at parse time."""

from __future__ import annotations

import json
import sys

import pytest
import torch
from test_model import tiny_draft
from wf import with_defaults

from draftsmith import algorithms
from draftsmith.algorithms.spec import AlgorithmSpec, Serving
from draftsmith.config.checks import load_schema
from draftsmith.config.engines import ENGINES

VERIFIER = {"name_or_path": "results/target", "architectures": ["LlamaForCausalLM"]}


@pytest.mark.parametrize("name", algorithms.names())
def test_every_spec_is_complete(name):
    spec = algorithms.get(name)
    assert isinstance(spec, AlgorithmSpec) and spec.name == name
    # every engine is answered: a flag or a refusal with its reason, never silence
    assert set(spec.serving) == set(ENGINES), (name, set(spec.serving) ^ set(ENGINES))
    trainer = spec.part("trainer")
    for fn in ("build_draft", "objective", "losses"):
        assert callable(getattr(trainer, fn, None)), f"{name}: trainer lacks {fn}"
    exporter_fns = ("export_draft", "check_export", "load_export", "config_problems", "arch")
    for fn in (*exporter_fns, "layer_ids"):
        assert callable(getattr(spec.exporter, fn, None)), f"{name}: exporter lacks {fn}"
    assert callable(getattr(spec.exporter, "family_layer_ids", None)), name
    if spec.decoder:
        assert callable(spec.part("decoder").runner)
    assert "{n}" not in spec.drafting or spec.drafting.format(n=3)
    # the engines' method lines: one token, or several
    assert spec.drafting_words(1).endswith(", 1 draft token per verification pass")
    assert spec.drafting_words(3).endswith(", 3 draft tokens per verification pass")
    schema = load_schema()
    for key in spec.refuses:  # the off value is the schema's default (algorithms.off_value)
        section, _, option = key.partition(".")
        prop = schema["properties"][section]["properties"].get(option, {})
        assert "default" in prop, f"{name}: refuses {key} without its off value"


def test_serving_needs_a_flag_or_a_reason():
    with pytest.raises(ValueError, match="exactly one"):
        Serving()
    with pytest.raises(ValueError, match="exactly one"):
        Serving(flag="X", refused="why")
    spec = algorithms.get("eagle3")
    assert "no nowhere serving path" in spec.serves("nowhere").refused


def test_engine_flags_come_from_the_spec():
    """The engines' flags per algorithm are the specs' (SGLang's EAGLE3 for both EAGLE-3
    kinds; vLLM's method names); DFlash on SGLang is refused with why."""
    flags = {n: {e: algorithms.get(n).serves(e).flag for e in ENGINES} for n in algorithms.names()}
    assert flags["eagle3"]["sglang"] == flags["eagle3.1"]["sglang"] == "EAGLE3"
    assert flags["eagle3"]["vllm"] == "eagle3" and flags["dflash"]["vllm"] == "dflash"
    assert flags["dflash"]["sglang"] is None
    assert "CpuSRTPlatform" in algorithms.get("dflash").serves("sglang").refused


def test_defaults_are_refused_for_no_algorithm_on_the_engines_that_serve_it():
    for name in algorithms.names():
        for engine in ENGINES:
            cfg = with_defaults({"draft": {"algorithm": name}, "bench": {"backend": engine}})
            refused = algorithms.refusals(cfg)
            if algorithms.get(name).serves(engine).refused:
                assert refused and f"bench.backend {engine}" in refused[0], (name, engine)
            else:
                assert refused == [], (name, engine, refused)


def test_settings_an_algorithm_refuses_are_named():
    cfg = with_defaults({"draft": {"algorithm": "dflash"}, "train": {"eval_rows": 2}})
    (msg,) = algorithms.refusals(cfg)
    assert "train.eval_rows 2" in msg and "set train.eval_rows 0" in msg
    cfg = with_defaults({"draft": {"algorithm": "dflash"}, "bench": {"temperature": 0.7}})
    assert "greedy only" in algorithms.refusals(cfg)[0]
    cfg = with_defaults({"draft": {"algorithm": "eagle3"}, "train": {"eval_rows": 2}})
    assert algorithms.refusals(cfg) == []


# an algorithm's folder as a stranger writes one: EAGLE-3's parts under another spec
VARIANT = """
from draftsmith.algorithms.eagle3 import decode, export, train
from draftsmith.algorithms.spec import AlgorithmSpec, Serving

SPEC = AlgorithmSpec(
    name={name!r},
    title={title!r},
    drafting="Chain speculative decoding ({title})",
    serving={{"hf": Serving(flag="chain"), "sglang": {sglang},
             "vllm": Serving(flag="eagle3")}},
    trainer=train,
    exporter=export,
    decoder=decode,
    {extra},
)
"""
FOURTH = VARIANT.format(
    name="eagle3-greedy",
    title="EAGLE-3, greedy only",
    sglang='Serving(refused="not tried on SGLang")',
    extra='refuses={"bench.temperature": "this variant is greedy only"}',
)


@torch.no_grad()
def test_a_fourth_algorithm_is_one_folder_and_a_registry_line(tmp_path, monkeypatch):
    """A new algorithm, as a user would add it: its folder with a SPEC and one registry line
    (here on sys.path and monkeypatched in; in the package also the schema's enum). Nothing
    else changes, and it trains' draft, exports, is read back and checked as itself."""
    from draftsmith.algorithms.export import check_export, export_draft, load_export

    pkg = tmp_path / "fourth_algorithm"
    pkg.mkdir()
    (pkg / "__init__.py").write_text(FOURTH)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setitem(algorithms.MODULES, "eagle3-greedy", "fourth_algorithm")
    spec = algorithms.get("eagle3-greedy")
    cfg = with_defaults({"draft": {"algorithm": "eagle3"}})
    cfg["draft"]["algorithm"] = "eagle3-greedy"  # the schema's enum is the third file
    cfg["bench"].update(backend="sglang", temperature=0.5)
    refused = algorithms.refusals(cfg)
    assert len(refused) == 2 and "not tried on SGLang" in refused[0] and "greedy" in refused[1]

    draft = tiny_draft(0, "eagle3-greedy")  # DraftConfig refuses an unregistered name
    dcfg = draft.config
    embed = torch.randn(dcfg.vocab_size, dcfg.target_hidden_size)
    out = tmp_path / "draft"
    export_draft(draft, out, {}, embed=embed, verifier=VERIFIER)
    c = json.loads((out / "config.json").read_text())
    assert c[algorithms.ALGORITHM_KEY] == "eagle3-greedy"
    assert algorithms.of_export(c) is spec
    check_export(out)
    back = load_export(out)
    assert back.config.algorithm == "eagle3-greedy"
    assert "fourth_algorithm" in sys.modules


def test_an_export_is_read_as_the_algorithm_it_records_and_checked_against_its_keys():
    eagle = {"architectures": ["LlamaForCausalLMEagle3"]}
    assert algorithms.of_export(eagle).name == "eagle3"  # an export from before the key
    assert algorithms.of_export({**eagle, "fc_norm": True}).name == "eagle3.1"
    recorded = {**eagle, algorithms.ALGORITHM_KEY: "eagle3", "fc_norm": True}
    assert algorithms.of_export(recorded).name == "eagle3"
    assert any("an EAGLE-3 draft has no fc_norm" in p for p in algorithms.export_problems(recorded))
    bad = {**eagle, algorithms.ALGORITHM_KEY: "eagle9"}
    assert "is not one of" in algorithms.export_problems(bad)[0]


FOUR_AUX = VARIANT.format(
    name="eagle3x4", title="EAGLE-3, four aux layers", sglang='Serving(flag="EAGLE3")',
    extra="aux_layers=4",
)  # fmt: skip


def test_a_captured_layer_count_the_algorithm_cannot_use_is_refused_at_parse_time(
    tmp_path, monkeypatch
):
    """spec.aux_layers: capture.aux_layer_ids auto (three) or a wrong count of ids is refused
    by the config checks (algorithms.refusals, rules/common.smk), before any job runs."""
    for name in algorithms.names():  # the built-in algorithms read any count of ids
        assert algorithms.get(name).aux_layers is None
        five = with_defaults(
            {"draft": {"algorithm": name}, "capture": {"aux_layer_ids": [0, 1, 2, 3, 4]}}
        )
        assert not algorithms.capture_problems(five)
    pkg = tmp_path / "four_aux_algorithm"
    pkg.mkdir()
    (pkg / "__init__.py").write_text(FOUR_AUX)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setitem(algorithms.MODULES, "eagle3x4", "four_aux_algorithm")
    cfg = with_defaults({"draft": {"algorithm": "eagle3"}})
    cfg["draft"]["algorithm"] = "eagle3x4"  # the schema's enum would list it
    (msg,) = algorithms.refusals(cfg)
    assert "capture.aux_layer_ids 'auto' (3 layers)" in msg and "exactly 4" in msg
    cfg["capture"]["aux_layer_ids"] = [1, 2, 3, 4, 5]
    assert "(5 layers)" in algorithms.refusals(cfg)[0]
    cfg["capture"]["aux_layer_ids"] = [1, 2, 3, 4]
    assert algorithms.refusals(cfg) == []
