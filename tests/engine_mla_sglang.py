"""Run SGLang's own MLA EAGLE-3 draft class on CPU over given inputs (the sglang-cpu role's python).

    python tests/engine_mla_sglang.py DRAFT_DIR INPUTS OUT PORT

As tests/engine_eagle3_sglang.py, for the pinned wheel's `Eagle3DeepseekV2ForCausalLM`
(`srt/models/kimi_k25_eagle3.py`): built from the config as its model loader does (transformers'
config class for config.json's model_type, then `load_weights`, which fuses q_a_proj and
kv_a_proj_with_mqa and splits kv_b_proj into w_kc / w_vc), and chained as SGLang's EAGLE worker
chains it with topk 1: an extend over the T positions with the aux states as
`spec_info.hidden_states`, then S - 1 single-token decode steps fed the state the previous
forward returned for the next step.

The attention runs SGLang's absorbed MLA path (`forward_absorb_prepare` / `forward_absorb_core`:
q_a_layernorm, q_b_proj, kv_a_layernorm, the w_kc absorption, SGLang's RoPE, w_vc, o_proj). The
stand-ins: the backend choice (`dispatch_attn_forward_method` answers the absorbed MLA method,
which a GPU backend would pick) and the kernel `attn_mqa` (`RadixAttention`: the latent KV pool
and a backend's metadata), replaced by causal multi-query attention over a plain latent list
with the layer's own softmax scale. OUT also holds SGLang's parameter names and shapes.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from types import SimpleNamespace

import torch
from safetensors.torch import load_file, save_file

sys.path.insert(0, str(Path(__file__).resolve().parent))
from engine_eagle3_sglang import init_single_process  # noqa: E402


class LatentMQA(torch.nn.Module):
    """Causal attention of every head over one shared latent key/value list (MLA's MQA form):
    q [t, heads, kv_lora + rope], k [t, 1, kv_lora + rope], v [t, 1, kv_lora]."""

    def __init__(self, heads: int, scaling: float):
        super().__init__()
        self.heads, self.scaling = heads, scaling
        self.k = self.v = None

    def forward(self, q, k, v, forward_batch=None, **_):
        t = q.shape[0]
        q = q.reshape(t, self.heads, -1).transpose(0, 1)
        k, v = k.reshape(t, -1), v.reshape(t, -1)
        past = 0 if self.k is None else self.k.shape[0]
        self.k = k if self.k is None else torch.cat([self.k, k])
        self.v = v if self.v is None else torch.cat([self.v, v])
        mask = torch.ones(t, past + t, dtype=torch.bool).tril(diagonal=past)
        scores = (q @ self.k.T * self.scaling).masked_fill(~mask, float("-inf"))
        out = torch.softmax(scores, -1) @ self.v  # [heads, t, kv_lora]
        return out.transpose(0, 1).reshape(t, -1)


def build(draft_dir: Path, port: int):
    init_single_process(port)
    from sglang.srt.models.kimi_k25_eagle3 import Eagle3DeepseekV2ForCausalLM
    from transformers import AutoConfig

    config = AutoConfig.for_model(**json.loads((draft_dir / "config.json").read_text()))
    model = Eagle3DeepseekV2ForCausalLM(config).float().eval()
    model.load_weights(load_file(str(draft_dir / "model.safetensors")).items())
    att = model.model.midlayer.self_attn

    def dispatch(forward_batch):
        att.current_attention_backend = "torch_native"
        return method_mla()

    att.dispatch_attn_forward_method = dispatch
    att.attn_mqa = LatentMQA(att.num_local_heads, float(att.attn_mqa.scaling))
    return model


def method_mla():
    from sglang.srt.models.deepseek_common.attention_forward_methods.forward_methods import (
        AttnForwardMethod,
    )

    return AttnForwardMethod.MLA


def batch(hidden, extend: bool):
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    mode = ForwardMode.EXTEND if extend else ForwardMode.DECODE
    return SimpleNamespace(
        spec_info=SimpleNamespace(hidden_states=hidden), forward_mode=mode, attn_cp_metadata=None
    )


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
        to_logits, (to_next,) = model.model(
            None, positions, batch(hidden, j == 0), input_embeds=embeds[lo : lo + n]
        )
        result[f"normed.{j}"] = to_logits[-1].clone()
        result[f"logits.{j}"] = (to_logits[-1] @ model.lm_head.weight.T).clone()
        result[f"next.{j}"] = to_next[-1].clone()
        hidden, lo = to_next[-1:], lo + n
        positions = torch.tensor([t - 1 + j + 1])
    result["fc_norm"] = torch.tensor([model.model.fc_norm is not None])
    result["norm_output"] = torch.tensor([bool(model.model.norm_output)])
    result["scaling"] = torch.tensor([float(model.model.midlayer.self_attn.scaling)])
    for name, p in model.named_parameters():
        result[f"param:{name}"] = torch.tensor(list(p.shape))
    save_file(result, str(out))


if __name__ == "__main__":
    run(Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3]), int(sys.argv[4]))
