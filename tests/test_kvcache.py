"""The KV cache written in place: the same keys, values and generations as transformers' own."""

from __future__ import annotations

import torch
from test_hf_attention import tiny_gqa_model
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from draftsmith.engines.hf.attention import use_decode_attention
from draftsmith.runtime.kvcache import SlabLayer, slab_cache


def steps(gen: torch.Generator, lengths: list[int], b: int = 3, heads: int = 2, d: int = 4):
    """One (keys, values) update per length; values wider than keys, as some models have."""
    shape = (b, heads)
    return [(torch.randn(*shape, n, d, generator=gen), torch.randn(*shape, n, d + 1, generator=gen))
            for n in lengths]  # fmt: skip


def same(got, want) -> bool:
    return all(torch.equal(g, w) for g, w in zip(got, want, strict=True))


def test_updates_equal_the_concatenating_layer_and_write_in_place():
    ours, theirs = SlabLayer(capacity=8), DynamicLayer()
    buffers = set()
    for k, v in steps(torch.Generator().manual_seed(0), [5, 1, 1, 1]):
        assert same(ours.update(k, v), theirs.update(k, v))
        buffers.add(ours.slab_keys.data_ptr())
        assert ours.keys.data_ptr() == ours.slab_keys.data_ptr()  # a view, not a copy
    assert len(buffers) == 1  # 8 positions of room: one buffer for all four updates
    assert ours.get_seq_length() == theirs.get_seq_length() == 8


def test_a_full_buffer_grows_and_keeps_what_it_held():
    ours, theirs = SlabLayer(capacity=3), DynamicLayer()
    for k, v in steps(torch.Generator().manual_seed(1), [2, 1, 1, 4, 1]):
        assert same(ours.update(k, v), theirs.update(k, v))
    assert ours.slab_keys.shape[-2] >= 9


def test_crop_select_and_reset_then_update():
    ours, theirs = SlabLayer(capacity=16), DynamicLayer()
    gen = torch.Generator().manual_seed(2)
    for k, v in steps(gen, [4, 1, 1]):
        ours.update(k, v), theirs.update(k, v)
    for layer in (ours, theirs):
        layer.crop(-2)  # speculative decoding drops rejected positions
    k, v = steps(gen, [3])[0]
    assert same(ours.update(k, v), theirs.update(k, v))
    index = torch.tensor([2, 0])
    for layer in (ours, theirs):
        layer.batch_select_indices(index)  # a new tensor: the next update starts a new buffer
    k, v = steps(gen, [1], b=2)[0]
    assert same(ours.update(k, v), theirs.update(k, v))
    assert ours.keys.data_ptr() == ours.slab_keys.data_ptr()
    ours.reset()
    k, v = steps(gen, [2])[0]
    assert torch.equal(ours.update(k, v)[0], k)


def test_slab_cache_replaces_only_full_attention_layers():
    model = tiny_gqa_model()
    cache = slab_cache(model, 10)
    assert [type(layer) for layer in cache.layers] == [SlabLayer, SlabLayer]
    assert all(layer.capacity == 10 for layer in cache.layers)


@torch.inference_mode()
def test_batched_generation_is_identical_with_the_slab_cache():
    """Left-padded greedy generation of a tiny random model, with the decode attention the
    regenerate stage uses: the same tokens and scores with the cache written in place."""
    model = tiny_gqa_model()
    use_decode_attention(model)
    ids = torch.randint(3, 128, (3, 9), generator=torch.Generator().manual_seed(3))
    mask = torch.ones_like(ids)
    mask[1, :3], mask[2, :6] = 0, 0
    kw = {"do_sample": False, "max_new_tokens": 12, "min_new_tokens": 12,
          "return_dict_in_generate": True, "output_scores": True}  # fmt: skip
    want = model.generate(input_ids=ids, attention_mask=mask, past_key_values=DynamicCache(), **kw)
    cache = slab_cache(model, 9 + 12)
    got = model.generate(input_ids=ids, attention_mask=mask, past_key_values=cache, **kw)
    assert torch.equal(got.sequences, want.sequences)
    assert all(torch.equal(a, b) for a, b in zip(got.scores, want.scores, strict=True))
    assert cache.layers[0].slab_keys.shape[-2] == 21  # the room asked for, never regrown
