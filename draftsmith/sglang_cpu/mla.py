"""MLA targets (DeepSeek-V2/V3, Kimi-K2.5) on SGLang's `torch_native` attention backend.

SGLang 0.5.23 picks, per batch, how a DeepSeek-family layer attends from a registry keyed by the
attention backend (`srt/models/deepseek_common/attention_backend_handler.py`,
`AttentionBackendRegistry`); `torch_native` is not in it, so the `triton` handler answers. That
handler sends a prefill without a cached prefix to the MHA path: K and V expanded per head
(q/k width nope + rope, v width v_head_dim), handed to `attn_mha`. `torch_native`'s
`forward_extend` ignores the K/V it is given and attends over the KV pool, which for MLA holds one
latent (kv_lora_rank + rope wide) per token, so the first prefill fails
(`RuntimeError: Expected size for first two dimensions of batch2 tensor to be: [4, 96] but got:
[4, 576]` on a kv_lora 512 / rope 64 target).

`register` adds `torch_native` to the registry with SGLang's own MLA choice
(`_dispatch_mla_subtype`): without SGLang's compiled AMX kernels (this layer ships none, see
`kernels.py`) it always answers the absorbed MLA path (`attn_mqa`: one latent KV head, queries of
kv_lora_rank + rope per head, V = the first kv_lora_rank of the latent), which decode and
target-verify batches already take and which `torch_native`'s SDPA serves with grouped-query
broadcasting. Prefill then computes the same attention as the MHA path (absorbed weights),
so captured states and outputs equal transformers' (tests/test_sglang_capture.py,
tests/test_engines_mla.py).

Called from the import hook (`hook.py`) when SGLang loads the registry module, inside processes
of the sglang-cpu role only. Imports nothing itself: the module is handed in.
"""

from __future__ import annotations

BACKEND = "torch_native"
MARK = "_draftsmith_sglang_cpu_mla"  # set on the patched registry class


def register(module) -> None:
    """Register `torch_native` in `module.AttentionBackendRegistry` (idempotent; a registration
    SGLang itself made for `torch_native` is kept)."""
    registry = module.AttentionBackendRegistry
    if getattr(registry, MARK, False) or BACKEND in registry._handlers:
        return

    def handle_attention_torch_native(attn, forward_batch):
        return module._dispatch_mla_subtype(attn, forward_batch)

    registry.register(BACKEND, handle_attention_torch_native)
    setattr(registry, MARK, True)
