"""Train/serve equality of the MLA draft (draft.attention mla) against the serving engines' own
`Eagle3DeepseekV2ForCausalLM` classes, as tests/test_algorithms_engines.py does for the Llama
draft.

A tiny random MLA draft (YaRN RoPE, the CPU MLA widths kv_lora_rank 512 / qk_rope_head_dim 64)
of each algorithm is built and exported with our code; the pinned SGLang wheel's class
(`srt/models/kimi_k25_eagle3.py`, tests/engine_mla_sglang.py) and the pinned vLLM wheel's
(`deepseek_eagle3.py`, tests/engine_mla_vllm.py) each load the export with their own loader and
run on CPU: an extend over the aux states, then single-token draft steps chained as their EAGLE
workers do with topk 1. Only the innermost attention kernel is a plain stand-in (absorbed MLA
over a latent list, with the engine's own kv_b_proj and softmax scale); the projections, norms,
the fused q/kv down-projection, RoPE (interleaved, DeepSeek YaRN with mscale), fc / fc_norm and
the state fed back are the engines' code. Their logits, final-norm states and fed-back states
equal ours from the in-process decoder's chain (KVCache, `draftsmith.bench.specdec.DraftRunner`'s
path; tests/test_mla.py proves TTT equals that chain), step by step, and their parameter names
and shapes are the ones draftsmith.algorithms.eagle3.contract_mla checks the export against (SGLang).

Not covered here: the real servers' MLA attention backends and KV pools, GPUs.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch
from roles import role_python
from safetensors.torch import load_file, save_file
from test_algorithms_engines import free_port, our_chain
from test_mla import YARN, tiny_mla

from draftsmith.algorithms.eagle3 import contract_mla as draft_contract_mla
from draftsmith.algorithms.export import export_draft, load_export
from draftsmith.engines.sglang.cpu import server_env

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
T, STEPS = 7, 4
MLA = {  # the CPU MLA backends' widths (vLLM CPU: head size 576 = 512 + 64)
    "q_lora_rank": 32,
    "kv_lora_rank": 512,
    "qk_nope_head_dim": 16,
    "qk_rope_head_dim": 64,
    "v_head_dim": 16,
}
TARGET = {  # the tiny draft's target, as vLLM's engine arguments need one (config only)
    "architectures": ["DeepseekV3ForCausalLM"],
    "model_type": "deepseek_v3",
    "hidden_size": 64,
    "intermediate_size": 128,
    "moe_intermediate_size": 32,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "num_hidden_layers": 4,
    **MLA,
    "n_routed_experts": 4,
    "n_shared_experts": 1,
    "num_experts_per_tok": 2,
    "n_group": 1,
    "topk_group": 1,
    "first_k_dense_replace": 1,
    "topk_method": "noaux_tc",
    "scoring_func": "sigmoid",
    "moe_layer_freq": 1,
    "norm_topk_prob": True,
    "routed_scaling_factor": 1.0,
    "vocab_size": 256,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "rope_scaling": {**YARN, "original_max_position_embeddings": 256, "mscale_all_dim": 0.707},
    "max_position_embeddings": 1024,
    "hidden_act": "silu",
    "torch_dtype": "float32",
    "tie_word_embeddings": False,
}


def export(algorithm: str, out: Path) -> Path:
    draft = tiny_mla(seed=11, algorithm=algorithm, target=TARGET)
    c = draft.config
    embed = torch.randn(c.vocab_size, c.target_hidden_size)
    verifier = {"name_or_path": "target", "architectures": TARGET["architectures"]}
    export_draft(draft, out, {}, embed=embed, verifier=verifier)
    return out


def engine_chain(engine: str, algorithm: str, tmp_path: Path):
    draft_dir = export(algorithm, tmp_path / "draft")
    ours = load_export(draft_dir)
    assert ours.config.attention == "mla" and ours.config.algorithm == algorithm
    c = ours.config
    g = torch.Generator().manual_seed(12)
    aux = torch.randn(T, c.num_aux * c.target_hidden_size, generator=g) * 3
    embeds = torch.randn(T + STEPS - 1, c.hidden_size, generator=g)
    inputs, out = tmp_path / "inputs.safetensors", tmp_path / "engine.safetensors"
    save_file({"aux": aux, "embeds": embeds, "steps": torch.tensor([STEPS])}, str(inputs))
    if engine == "sglang":
        python, env = role_python("sglang-cpu"), server_env(threads=1)
        args = [str(ROOT / "tests" / "engine_mla_sglang.py"), str(draft_dir)]
    else:
        python, env = role_python("vllm-cpu"), {**os.environ, "OMP_NUM_THREADS": "1"}
        target = tmp_path / "target"
        target.mkdir()
        (target / "config.json").write_text(json.dumps(TARGET))
        args = [str(ROOT / "tests" / "engine_mla_vllm.py"), str(draft_dir), str(target)]
    proc = subprocess.run(
        [python, *args, str(inputs), str(out), str(free_port())],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return (
        ours,
        aux,
        embeds,
        load_file(str(out)),
        json.loads((draft_dir / "config.json").read_text()),
    )


@pytest.mark.parametrize(
    "engine",
    [
        pytest.param("sglang", marks=pytest.mark.sglang),
        pytest.param("vllm", marks=pytest.mark.vllm),
    ],
)
@pytest.mark.parametrize("algorithm", ["eagle3", "eagle3.1"])
def test_engine_mla_draft_class_equals_ours(engine, algorithm, tmp_path):
    from draftsmith.algorithms.eagle3 import mla

    ours, aux, embeds, theirs, config = engine_chain(engine, algorithm, tmp_path)
    assert bool(theirs["fc_norm"]) == bool(theirs["norm_output"]) == (algorithm == "eagle3.1")
    # the engine's softmax scale carries YaRN's mscale^2 (mscale_all_dim 0.707 here)
    scale = mla.softmax_scale(ours.config)
    assert scale != pytest.approx(80**-0.5)
    assert float(theirs["scaling"][0]) == pytest.approx(scale, rel=1e-6)
    for j, (logits, normed, nxt) in enumerate(our_chain(ours, aux, embeds, STEPS)):
        for name, mine in (("logits", logits), ("normed", normed), ("next", nxt)):
            torch.testing.assert_close(theirs[f"{name}.{j}"], mine, rtol=1e-4, atol=1e-5)
    if engine == "sglang":  # the parameters the contract check replays SGLang's loader into
        params = {k[6:]: tuple(v.tolist()) for k, v in theirs.items() if k.startswith("param:")}
        assert params == draft_contract_mla.sglang_params(config)
    # the control: the draft read with neox-style RoPE gives other logits
    with torch.no_grad():
        bad = our_chain(neox(ours), aux, embeds, 1)
    assert not torch.allclose(theirs["logits.0"], bad[0][0], rtol=1e-3, atol=1e-3)


def neox(draft):
    """The same draft with its RoPE rotating halves (neox) instead of interleaved pairs."""
    rot = draft.midlayer.self_attn.rotary

    def forward(x, position_ids):
        freqs = position_ids.float()[..., None] * rot.inv_freq
        cos = torch.cat([freqs.cos(), freqs.cos()], -1)[:, None] * rot.mscale
        sin = torch.cat([freqs.sin(), freqs.sin()], -1)[:, None] * rot.mscale
        a, b = x.chunk(2, dim=-1)
        return x * cos + torch.cat([-b, a], -1) * sin

    rot.forward = forward
    return draft
