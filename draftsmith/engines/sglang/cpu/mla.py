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

MLA drafts (`Eagle3DeepseekV2ForCausalLM`, SGLang's `srt/models/kimi_k25_eagle3.py`): the class
calls `torch.cuda.synchronize()` when the EAGLE worker shares the target's embedding with it
(`set_embed`, `set_embed_and_head`), which CPU torch refuses (`Torch not compiled with CUDA
enabled`) before the server serves. `install_draft` runs those two methods with
`torch.cuda.synchronize` a no-op: on a CPU there is no device work to wait for.

Called from the import hook (`hook.py`) when SGLang loads the registry module or the MLA draft's
model file, inside processes of the sglang-cpu role only. Imports nothing from SGLang: the
module is handed in.
"""

from __future__ import annotations

import functools

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


DRAFT_CLASS = "Eagle3DeepseekV2ForCausalLM"
DRAFT_METHODS = ("set_embed", "set_embed_and_head")


def install_draft(module) -> None:
    """Run the MLA draft class's embedding-sharing methods without a CUDA synchronize
    (idempotent)."""
    cls = getattr(module, DRAFT_CLASS)
    if getattr(cls, MARK, False):
        return
    for name in DRAFT_METHODS:
        setattr(cls, name, _without_cuda_sync(getattr(cls, name)))
    setattr(cls, MARK, True)


def _without_cuda_sync(method):
    @functools.wraps(method)
    def run(*args, **kwargs):
        import torch

        sync = torch.cuda.synchronize
        torch.cuda.synchronize = lambda *a, **k: None
        try:
            return method(*args, **kwargs)
        finally:
            torch.cuda.synchronize = sync

    return run
