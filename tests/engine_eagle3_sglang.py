"""Run SGLang's own EAGLE-3 draft class on CPU over given inputs (the sglang-cpu role's python).

    python tests/engine_eagle3_sglang.py DRAFT_DIR INPUTS OUT PORT

DRAFT_DIR is a draftsmith export (config.json + model.safetensors); INPUTS a safetensors file
with `aux` [T, n_aux * H_t], `embeds` [T + S - 1, H] (the target embedding of the token after
each position, then of each chained token) and `steps` [1] (S, the draft steps). The pinned
wheel's `LlamaForCausalLMEagle3` is built from the config exactly as its model loader does
(transformers' LlamaConfig from config.json, then `load_weights` over the checkpoint), and run
the way SGLang's EAGLE worker chains it with topk 1: an extend over the T positions with the
aux states as `spec_info.hidden_states`, then S - 1 single-token decode steps, each fed the
state the previous forward returned for the next step (its `[aux]` output, which `norm_output`
decides). Returns, per step, the final-norm state of the last position, its logits
(`lm_head`), and the state returned for the next step, in OUT (safetensors).

The only stand-in is the attention kernel: `RadixAttention` (the KV pool and a backend's
metadata) is replaced by causal softmax attention over a plain per-layer K/V list, which is
what the chain computes with topk 1. Everything else (fused q/k/v and gate/up loading, RMSNorm,
RoPE, fc_norm, fc, the residual path, norm_output) is SGLang's code.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from types import SimpleNamespace

import torch
from safetensors.torch import load_file, save_file


class ChainAttention(torch.nn.Module):
    """Causal attention over a growing K/V list (one sequence), in place of RadixAttention."""

    def __init__(self, heads: int, kv_heads: int, head_dim: int):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.k = self.v = None

    def forward(self, q, k, v, forward_batch=None, **_):
        t = q.shape[0]
        q = q.view(t, self.heads, self.head_dim).transpose(0, 1)
        k = k.view(t, self.kv_heads, self.head_dim).transpose(0, 1)
        v = v.view(t, self.kv_heads, self.head_dim).transpose(0, 1)
        past = 0 if self.k is None else self.k.shape[1]
        self.k = k if self.k is None else torch.cat([self.k, k], dim=1)
        self.v = v if self.v is None else torch.cat([self.v, v], dim=1)
        g = self.heads // self.kv_heads
        keys, values = self.k.repeat_interleave(g, 0), self.v.repeat_interleave(g, 0)
        mask = torch.ones(t, past + t, dtype=torch.bool).tril(diagonal=past)
        out = torch.nn.functional.scaled_dot_product_attention(q, keys, values, attn_mask=mask)
        return out.transpose(0, 1).reshape(t, self.heads * self.head_dim)


def init_single_process(port: int) -> None:
    """World size 1 and SGLang's model-parallel groups (its layers need them at TP 1), as
    sglang.test.layer_ut_utils.init_single_process_dist does (that module imports the
    benchmark suite, whose dependencies the role does not install)."""
    import os

    from sglang.srt.distributed import parallel_state as ps
    from sglang.srt.runtime_context import SpawnRanks, get_parallel, publish, reset_context
    from sglang.srt.server_args import ServerArgs

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1")
    os.environ["LOCAL_RANK"] = "0"
    ps.init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo")
    reset_context()
    publish(
        ServerArgs(model_path="dummy", tp_size=1, ep_size=1, pp_size=1),
        role="test",
        ranks=SpawnRanks(world_rank=0),
    )
    if ps._WORLD is not None:
        get_parallel().override_permanently(world_group=ps._WORLD)
    ps.initialize_model_parallel(backend="gloo")


def build(draft_dir: Path, port: int):
    init_single_process(port)
    from sglang.srt.models.llama_eagle3 import LlamaForCausalLMEagle3
    from transformers import LlamaConfig

    config = LlamaConfig.from_dict(json.loads((draft_dir / "config.json").read_text()))
    model = LlamaForCausalLMEagle3(config).float().eval()
    model.load_weights(load_file(str(draft_dir / "model.safetensors")).items())
    for layer in model.model.layers:
        att = layer.self_attn
        att.attn = ChainAttention(att.num_heads, att.num_kv_heads, att.head_dim)
    return model


@torch.no_grad()
def run(draft_dir: Path, inputs: Path, out: Path, port: int) -> None:
    model = build(draft_dir, port)
    x = load_file(str(inputs))
    aux, embeds, steps = x["aux"].float(), x["embeds"].float(), int(x["steps"][0])
    t = aux.shape[0]
    hidden, positions, lo = aux, torch.arange(t), 0
    result = {}
    for j in range(steps):
        n = t if j == 0 else 1
        batch = SimpleNamespace(spec_info=SimpleNamespace(hidden_states=hidden))
        to_logits, (to_next,) = model.model(
            None, positions, batch, input_embeds=embeds[lo : lo + n]
        )
        result[f"normed.{j}"] = to_logits[-1].clone()
        result[f"logits.{j}"] = (to_logits[-1] @ model.lm_head.weight.T).clone()
        result[f"next.{j}"] = to_next[-1].clone()
        hidden, lo = to_next[-1:], lo + n
        positions = torch.tensor([t - 1 + j + 1])
    result["fc_norm"] = torch.tensor([model.model.fc_norm is not None])
    result["norm_output"] = torch.tensor([bool(model.model.norm_output)])
    save_file(result, str(out))


if __name__ == "__main__":
    run(Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3]), int(sys.argv[4]))
