"""Few-query attention for the `hf` engine: decode steps (regenerate's batches) and the
verification passes of the in-process bench.

transformers' `sdpa` attention sends a few queries of a grouped-query model to
`scaled_dot_product_attention`: a decode step (one query per row) with the query heads packed
onto their key/value heads, a verification pass of K + 1 queries with the key/value heads
repeated to the query heads (a copy per layer) and a boolean mask. On a CPU that call takes the
flash-attention kernel, whose blocking is built for long queries and costs far more than the
few products a few queries need. `DECODE` computes that attention as two batched matrix
products over the grouped heads (no repeated keys or values), the softmax in float32: up to
`FEW` queries per row go through `grouped_decode`; everything else (a prefill, or dropout,
soft-capping, position biases) through transformers' own sdpa function, unchanged. Its mask is
sdpa's (a boolean [B, 1, q, kv] mask, True where a key is visible, or None: causal).

`use_decode_attention(model)` registers it with transformers (once; idempotent) and switches a
loaded model to it. Both compute softmax(q k^T * scale) v over the same keys; they differ in
rounding only. benchmarks/bench_regen_attention.py measures the two on the default's target
(benchmarks/results/regen_attention_<kind>.md): generation at 32 rows 1.08x faster in bfloat16
and 1.04x in float32 (every row identical) on an AVX512-BF16 CPU; benchmarks/bench_pass_cost.py
measures a speculative pass with each.
"""

from __future__ import annotations

import torch

DECODE = "draftsmith_decode"


FEW = 8  # queries per row up to which DECODE computes the attention itself (K + 1 <= 8)


def grouped_decode(query, key, value, mask, scaling: float) -> torch.Tensor:
    """query [B, H, q, d], key [B, KV, T, d], value [B, KV, T, dv], mask None (causal: query i
    sees the first T - q + 1 + i keys) or bool [B, 1, q, T] (True: visible) -> [B, q, H, dv].
    Query head h reads key/value head h // (H / KV), as repeat_kv would give it, without
    repeating them."""
    b, heads, n, d = query.shape
    kv, t = key.shape[1], key.shape[2]
    g = heads // kv
    q = query.reshape(b, kv, g * n, d)  # row j * n + i: group member j, query i
    scores = torch.matmul(q, key.transpose(-1, -2)).float() * scaling  # [B, KV, g n, T]
    if mask is None and n > 1:
        mask = torch.ones(n, t, dtype=torch.bool, device=query.device).tril(t - n).view(1, 1, n, t)
    if mask is not None:
        m = mask.reshape(mask.shape[0], 1, 1, mask.shape[-2], t)
        s = scores.view(b, kv, g, n, t)
        # the float32 minimum, not -inf: a row with no visible key (a padded query of a short
        # batched prefill) averages the values instead of turning into NaN, as eager attention
        # does; every other row is exact (exp(min - max) is 0)
        low = torch.finfo(torch.float32).min
        s = s.masked_fill(~m, low) if m.dtype == torch.bool else s + m.float()
        scores = s.view(b, kv, g * n, t)
    probs = torch.softmax(scores, dim=-1).to(value.dtype)
    out = torch.matmul(probs, value)  # [B, KV, g n, dv]
    return out.reshape(b, heads, n, value.shape[-1]).transpose(1, 2)


def decode_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None,
                     **kwargs):  # fmt: skip
    """transformers' attention interface: `grouped_decode` for up to FEW queries per row, sdpa
    else."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    plain = not dropout and kwargs.get("softcap") is None and kwargs.get("position_bias") is None
    n = query.shape[2]
    mask_ok = attention_mask is None or attention_mask.shape[-2] in (1, n)
    if n <= FEW and plain and mask_ok and key.shape[1] <= query.shape[1]:
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
