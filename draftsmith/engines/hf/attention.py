"""Decode-step attention for the `hf` engine's batched generation (regenerate).

transformers' `sdpa` attention sends a decode step (one query per row) of a grouped-query model
to `scaled_dot_product_attention` with the query heads packed onto their key/value heads and
the padding mask of the batch. On a CPU that call takes the flash-attention kernel, whose
blocking is built for long queries and costs far more than the few products a single query
needs. `DECODE` computes that attention as two batched matrix products over the grouped heads
(no repeated keys or values), the softmax in float32: one query per row goes through
`grouped_decode`; everything else (the prefill, or dropout, soft-capping, position biases)
through transformers' own sdpa function, unchanged. Its mask is sdpa's (a boolean
[B, 1, q, kv] mask, True where a key is visible, or None).

`use_decode_attention(model)` registers it with transformers (once; idempotent) and switches a
loaded model to it. Both compute softmax(q k^T * scale) v over the same keys; they differ in
rounding only. benchmarks/bench_regen_attention.py measures the two on the default's target
(benchmarks/results/regen_attention_<kind>.md): generation at 32 rows 1.08x faster in bfloat16
and 1.04x in float32 (every row identical) on an AVX512-BF16 CPU.
"""

from __future__ import annotations

import torch

DECODE = "draftsmith_decode"


def grouped_decode(query, key, value, mask, scaling: float) -> torch.Tensor:
    """query [B, H, 1, d], key [B, KV, T, d], value [B, KV, T, dv], mask None or bool
    [B, 1, 1, T] (True: visible) -> [B, 1, H, dv]. Query head h reads key/value head
    h // (H / KV), as repeat_kv would give it, without repeating them."""
    b, heads, _, d = query.shape
    kv = key.shape[1]
    q = query.reshape(b, kv, heads // kv, d)
    scores = torch.matmul(q, key.transpose(-1, -2)).float() * scaling  # [B, KV, g, T]
    if mask is not None:
        if mask.dtype == torch.bool:
            scores = scores.masked_fill(~mask.reshape(mask.shape[0], 1, 1, -1), float("-inf"))
        else:
            scores = scores + mask.reshape(mask.shape[0], 1, 1, -1).float()
    probs = torch.softmax(scores, dim=-1).to(value.dtype)
    out = torch.matmul(probs, value)  # [B, KV, g, dv]
    return out.reshape(b, 1, heads, value.shape[-1])


def decode_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None,
                     **kwargs):  # fmt: skip
    """transformers' attention interface: `grouped_decode` for one query per row, sdpa else."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    plain = not dropout and kwargs.get("softcap") is None and kwargs.get("position_bias") is None
    mask_ok = attention_mask is None or attention_mask.shape[-2] == 1
    if query.shape[2] == 1 and plain and mask_ok and key.shape[1] <= query.shape[1]:
        scale = scaling if scaling is not None else query.shape[-1] ** -0.5
        return grouped_decode(query, key, value, attention_mask, scale), None
    return sdpa_attention_forward(
        module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
    )


def use_decode_attention(model) -> None:
    """Register `DECODE` with transformers (with sdpa's mask) and switch `model` to it."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

    AttentionInterface.register(DECODE, decode_attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(DECODE, sdpa_mask)
    model.set_attn_implementation(DECODE)
