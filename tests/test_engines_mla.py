"""A DeepSeek-V3-shaped target (MLA attention, MoE, YaRN RoPE) served by the real engines on
CPU with a Llama-style EAGLE-3 draft our own pipeline trained for it (tests/trained.py).

The target is `tinymodel --arch deepseek_v3 --engine-shapes` (kv_lora_rank 512, rope 64: the
only latent width vLLM's CPU MLA kernels take). vLLM (role vllm-cpu) runs it on its CPU_MLA
backend with the stand-ins of draftsmith.engines.vllm_cpu; SGLang (role sglang-cpu) on torch_native with
draftsmith.engines.sglang_cpu's MLA registration. The standard is the Llama path's (test_vllm.py,
test_interop_sglang.py): speculative output equal to plain greedy, and acceptance (passes,
histogram, tau) equal to our in-process hf engine's on the same prompts, which also proves the
engine fed the draft the layers training saw (SGLang's DeepSeek file adds 1 to the ids only
when the first is 1; vLLM reads the top-level ids). Training the draft and running three
engines on this target takes well over CI's few minutes, so those tests are `extended`; the
untrained-draft vLLM test is the CI-sized check of the stand-ins.

The same target wrapped as Kimi-K2.5 ships it (`KimiK25ForConditionalGeneration`, weights
under `language_model.`, Kimi's preprocessor_config.json) is served by vLLM with the same draft
(`language_model_only`, and the kernel-scan stand-in of draftsmith.engines.vllm_cpu); SGLang's
Kimi-K2.5 class is not run on it (docs/kimi.md).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from roles import role_python
from trained import IDS, PROMPTS, assert_same_acceptance, run_bench, train_tiny_project

BENCH = {"num_steps": 3, "max_new_tokens": 32, "tau_floor": 1.0}
SGLANG_BENCH = {**BENCH, "role": "sglang-cpu", "topk": 1, "num_draft_tokens": 0, "concurrency": 1}
SGLANG = {
    "tp_size": 1,
    "extra_args": [],
    "port": 0,
    "startup_timeout": 900,
    "request_timeout": 1800,
    "retries": 2,
}


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    root = tmp_path_factory.mktemp("mla_proj")
    return train_tiny_project(root, arch="deepseek_v3", engine_shapes=True)


@pytest.fixture(scope="module")
def ours(trained):
    """Our engine's figures on PROMPTS; the draft must really draft for the comparison to
    tell right layers from wrong ones."""
    cfg = json.loads((trained / "results" / "draft" / "config.json").read_text())
    assert cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == IDS
    assert cfg["eagle_aux_hidden_state_layer_ids"] == [i + 1 for i in IDS]
    res = run_bench(trained, "hf", "results/draft", {"bench": BENCH, "target": {}})["res"]["s"]
    assert res["tau"] > 1.05 and sum(res["accept_len_hist"][1:]) >= 10, res
    assert res["identical_outputs"] == len(PROMPTS)
    return res


@pytest.mark.slow
@pytest.mark.vllm
def test_vllm_cpu_runs_an_mla_target_with_a_llama_style_draft(tmp_path):
    """The CI-sized check (no training): an untrained draft exported by us, on the MLA target,
    through the vLLM engine with its CPU stand-ins: vLLM takes CPU_MLA, feeds the layers the
    export names and stays lossless (speculative output equal to its plain greedy). Stock
    vllm-cpu 0.32.0 stops before serving (draftsmith.engines.vllm_cpu says where)."""
    import torch
    from test_specdec import random_draft
    from transformers import AutoModelForCausalLM

    from draftsmith.algorithms.export import export_draft, target_embedding
    from draftsmith.targets.tinymodel import make_tiny_target

    python = role_python("vllm-cpu")
    target = make_tiny_target(
        tmp_path / "results" / "target", "deepseek_v3", 6, 128, engine_shapes=True
    )
    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32)
    export_draft(
        random_draft(model, aux_ids=IDS),
        tmp_path / "results" / "draft",
        {},
        embed=target_embedding(target),
        verifier={"name_or_path": "results/target", "architectures": ["DeepseekV3ForCausalLM"]},
    )
    cfg = {"bench": {**BENCH, "max_new_tokens": 16}, "target": {"dtype": "float32"}}
    run = run_bench(tmp_path, "vllm", "results/draft", cfg, python)
    theirs, log = run["res"]["s"], run["log"]
    assert "Using CPU_MLA backend." in log, log[-3000:]
    assert "Using auxiliary layers from speculative config: (2, 3, 5)" in log
    assert run["info"]["vllm_cpu_stand_ins"] == ["expand_any_dtype", "cpu_attn_block_16"]
    assert theirs["identical_outputs"] == len(PROMPTS) and theirs["verify_passes"] > 0


@pytest.mark.slow
@pytest.mark.vllm
@pytest.mark.extended
def test_vllm_cpu_serves_an_mla_target_with_our_draft(trained, ours):
    python = role_python("vllm-cpu")
    cfg = {"bench": BENCH, "target": {"dtype": "float32"}}
    run = run_bench(trained, "vllm", "results/draft", cfg, python)
    theirs, log = run["res"]["s"], run["log"]
    assert "Using CPU_MLA backend." in log, log[-3000:]
    assert "Using auxiliary layers from speculative config: (2, 3, 5)" in log
    assert run["info"]["vllm_cpu_stand_ins"] == ["expand_any_dtype", "cpu_attn_block_16"]
    assert theirs["identical_outputs"] == len(PROMPTS)
    assert_same_acceptance(theirs, ours, "vllm")
    print(f"tau: ours {ours['tau']:.4f}, vLLM {theirs['tau']:.4f}")


@pytest.mark.slow
@pytest.mark.sglang
@pytest.mark.extended
def test_sglang_cpu_serves_an_mla_target_with_our_draft(trained, ours):
    python = role_python("sglang-cpu")
    full = {"bench": SGLANG_BENCH, "sglang": SGLANG, "target": {"dtype": "float32"}}
    theirs = run_bench(trained, "sglang", "results/draft", full, python)["res"]["s"]
    assert theirs["identical_outputs"] == len(PROMPTS)
    assert_same_acceptance(theirs, ours, "sglang")
    print(f"tau: ours {ours['tau']:.4f}, SGLang {theirs['tau']:.4f}")


def wrapped_project(project: Path, root: Path) -> Path:
    """`project`'s target laid out as Kimi-K2.5 ships it (draftsmith.targets.tinymodel.wrap_target: the
    wrapper's config.json, weights under `language_model.`, a stand-in vision tower, Kimi's
    preprocessor_config.json), beside the same draft: served, it must decode as the plain one."""
    from draftsmith.targets.tinymodel import wrap_target

    shutil.copytree(project / "results" / "target", root / "results" / "target")
    wrap_target(root / "results" / "target")
    shutil.copytree(project / "results" / "draft", root / "results" / "draft")
    return root


def assert_served_wrapped(run: dict) -> None:
    """vLLM built the Kimi-K2.5 wrapper, its text model only, with the kernel-scan stand-in."""
    log = run["log"]
    assert "Resolved architecture: KimiK25ForConditionalGeneration" in log, log[-3000:]
    assert "Using CPU_MLA backend." in log
    assert run["info"]["vllm_cpu_stand_ins"] == [
        "expand_any_dtype",
        "cpu_attn_block_16",
        "kernel_scan_slots",
    ]


@pytest.mark.slow
@pytest.mark.vllm
@pytest.mark.extended
def test_vllm_cpu_serves_the_kimi_wrapped_target_with_our_draft(trained, ours, tmp_path):
    """The same target wrapped as Kimi-K2.5 (KimiK25ForConditionalGeneration around the
    DeepSeek-V3 text model), the same Llama-style draft: vLLM serves it with
    `language_model_only` and the stand-ins, decodes every prompt as plain greedy and accepts
    exactly what our engine accepts on the plain target."""
    root = wrapped_project(trained, tmp_path)
    cfg = {"bench": BENCH, "target": {"dtype": "float32"}}
    run = run_bench(root, "vllm", "results/draft", cfg, role_python("vllm-cpu"))
    theirs = run["res"]["s"]
    assert_served_wrapped(run)
    assert "Using auxiliary layers from speculative config: (2, 3, 5)" in run["log"]
    assert theirs["identical_outputs"] == len(PROMPTS)
    assert_same_acceptance(theirs, ours, "vllm wrapped")
    print(f"tau: ours {ours['tau']:.4f}, vLLM wrapped {theirs['tau']:.4f}")
