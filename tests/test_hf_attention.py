"""The hf engine's decode attention: equal to sdpa's, and generation through it unchanged."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from draftsmith.engines.hf.attention import DECODE, grouped_decode, use_decode_attention


def reference(q, k, v, mask, scale):
    """sdpa with the key/value heads repeated, as transformers' eager path does."""
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale).transpose(1, 2)


@pytest.mark.parametrize("with_mask", [False, True])
def test_grouped_decode_equals_sdpa(with_mask):
    gen = torch.Generator().manual_seed(0)
    b, heads, kv, t, d = 5, 6, 2, 17, 8
    q = torch.randn(b, heads, 1, d, generator=gen)
    k, v = torch.randn(b, kv, t, d, generator=gen), torch.randn(b, kv, t, d, generator=gen)
    mask = None
    if with_mask:
        mask = torch.ones(b, 1, 1, t, dtype=torch.bool)
        for i in range(b):
            mask[i, ..., : 2 * i] = False  # left padding of 2 * i keys
    got = grouped_decode(q, k, v, mask, 0.3)
    torch.testing.assert_close(got, reference(q, k, v, mask, 0.3), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("n", [2, 3, 8])
def test_few_queries_equal_sdpa_with_and_without_their_causal_mask(n):
    """A verification pass of n queries after a cache of t - n keys: mask None means causal
    (query i sees t - n + 1 + i keys), as sdpa's is_causal would with the cache's offset; an
    explicit boolean mask (the causal one, plus left padding of one row) gives the same."""
    gen = torch.Generator().manual_seed(3)
    b, heads, kv, t, d = 2, 6, 2, 13, 8
    q = torch.randn(b, heads, n, d, generator=gen)
    k, v = torch.randn(b, kv, t, d, generator=gen), torch.randn(b, kv, t, d, generator=gen)
    causal = torch.ones(n, t, dtype=torch.bool).tril(t - n).expand(b, 1, n, t).clone()
    torch.testing.assert_close(grouped_decode(q, k, v, None, 0.3),
                               reference(q, k, v, causal, 0.3), rtol=1e-5, atol=1e-6)  # fmt: skip
    causal[1, ..., :4] = False
    torch.testing.assert_close(grouped_decode(q, k, v, causal, 0.3),
                               reference(q, k, v, causal, 0.3), rtol=1e-5, atol=1e-6)  # fmt: skip
    # each query reads no key past its own position
    before = grouped_decode(q, k, v, None, 0.3)
    k2, v2 = k.clone(), v.clone()
    k2[:, :, -1], v2[:, :, -1] = 1e4, -1e4  # the last key: visible to the last query only
    after = grouped_decode(q, k2, v2, None, 0.3)
    assert torch.equal(after[:, : n - 1], before[:, : n - 1])
    assert not torch.equal(after[:, n - 1], before[:, n - 1])


def test_a_query_with_no_visible_key_stays_finite():
    """A padded query row of a short batched prefill sees no key: no NaN (which the values'
    product would carry into every later layer's real rows), and the other rows unchanged."""
    gen = torch.Generator().manual_seed(4)
    q = torch.randn(2, 4, 3, 8, generator=gen)
    k, v = torch.randn(2, 2, 5, 8, generator=gen), torch.randn(2, 2, 5, 8, generator=gen)
    mask = torch.ones(3, 5, dtype=torch.bool).tril(2).expand(2, 1, 3, 5).clone()
    mask[1, 0, 0] = False  # row 1's first query: padding, every key hidden
    out = grouped_decode(q, k, v, mask, 0.3)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out[0], reference(q, k, v, mask, 0.3)[0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(out[1, 1:], reference(q, k, v, mask, 0.3)[1, 1:],
                               rtol=1e-5, atol=1e-6)  # fmt: skip


def test_padding_keys_are_never_read():
    gen = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(2, 4, 1, 8, generator=gen), torch.randn(2, 2, 9, 8, generator=gen),
               torch.randn(2, 2, 9, 8, generator=gen))  # fmt: skip
    mask = torch.ones(2, 1, 1, 9, dtype=torch.bool)
    mask[:, ..., :3] = False
    before = grouped_decode(q, k, v, mask, 0.35)
    k[:, :, :3], v[:, :, :3] = 1e4, -1e4  # what a masked key holds cannot matter
    assert torch.equal(grouped_decode(q, k, v, mask, 0.35), before)


def tiny_gqa_model():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                      attn_implementation="sdpa")  # fmt: skip
    return LlamaForCausalLM(cfg).eval()


@torch.inference_mode()
def test_generation_through_decode_attention_matches_sdpa():
    """Batched, left-padded greedy generation of a random tiny GQA model: the same logits (to
    rounding) and tokens with the decode attention as with sdpa; the prefill keeps sdpa."""
    model = tiny_gqa_model()
    ids = torch.randint(3, 128, (3, 10), generator=torch.Generator().manual_seed(2))
    mask = torch.ones_like(ids)
    mask[1, :4] = 0
    mask[2, :7] = 0
    kw = {"do_sample": False, "max_new_tokens": 12, "min_new_tokens": 12, "pad_token_id": 0,
          "output_scores": True, "return_dict_in_generate": True}  # fmt: skip
    plain = model.generate(input_ids=ids, attention_mask=mask, **kw)
    use_decode_attention(model)
    assert model.config._attn_implementation == DECODE
    calls = []
    import draftsmith.engines.hf.attention as ha

    own = ha.grouped_decode
    try:
        ha.grouped_decode = lambda *a: calls.append(1) or own(*a)
        ours = model.generate(input_ids=ids, attention_mask=mask, **kw)
    finally:
        ha.grouped_decode = own
    assert len(calls) == 2 * 11  # every decode step of both layers (the prefill is sdpa's)
    assert torch.equal(plain.sequences, ours.sequences)
    for a, b in zip(plain.scores, ours.scores, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
