"""The draft model: TTT visibility, SGLang semantics, incremental decoding, export round trip."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from draftsmith.algorithms.eagle3.model import (
    DraftConfig,
    Eagle3Draft,
    KVCache,
    TTTCache,
    block_causal_mask,
    ttt_visibility,
)
from draftsmith.algorithms.export import ExportError, check_export, export_draft, load_export
from draftsmith.algorithms.layers import masked_attention

SMOLLM2 = {  # results/target/config.json of the embedded default (transformers 5 layout)
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "head_dim": 64,
    "hidden_act": "silu",
    "hidden_size": 576,
    "intermediate_size": 1536,
    "max_position_embeddings": 8192,
    "num_attention_heads": 9,
    "num_hidden_layers": 30,
    "num_key_value_heads": 3,
    "rms_norm_eps": 1e-05,
    "rope_parameters": {"rope_theta": 100000.0, "rope_type": "default"},
    "tie_word_embeddings": True,
    "vocab_size": 49152,
}


def tiny_draft(seed: int = 0, algorithm: str = "eagle3", **kw) -> Eagle3Draft:
    """A random tiny draft of `algorithm` (resolved by the registry: its name and switches)."""
    from draftsmith import algorithms

    spec = algorithms.get(algorithm)  # an unregistered name is refused here
    torch.manual_seed(seed)
    cfg = dataclasses.replace(DraftConfig.tiny(**kw), algorithm=spec.name, **spec.draft)
    draft = Eagle3Draft(cfg)
    with torch.no_grad():  # non-trivial norms so their placement matters
        for name, p in draft.named_parameters():
            if "norm" in name:  # every *norm.weight, and eagle3.1's fc_norm.{i}.weight
                p.uniform_(0.5, 1.5)
    hot = torch.sort(torch.randperm(cfg.vocab_size)[: cfg.draft_vocab_size]).values
    t2d = torch.zeros(cfg.vocab_size, dtype=torch.bool)
    t2d[hot] = True
    draft.set_vocab(hot - torch.arange(cfg.draft_vocab_size), t2d)
    return draft.eval()


# ---------------------------------------------------------------------------------------------
# TTT attention


def test_ttt_visibility_never_sees_a_later_position():
    seg = torch.tensor([[0, 0, 0, 1, 1, 1, 1, -1]])
    steps, t = 4, seg.shape[1]
    full = ttt_visibility(block_causal_mask(seg)[0], steps)
    assert full.shape == (steps, t, steps * t)
    for j in range(steps):
        for i in range(t):
            seen = full[j, i].nonzero().flatten().tolist()
            for key in seen:
                s, p = divmod(key, t)
                assert p <= i, f"step {j} position {i} sees position {p} of step {s}"
                assert s <= j, f"step {j} sees the later step {s}"
                assert s == 0 or p == i, "later steps are visible only on the diagonal"
                if seg[0, i] >= 0 and s == 0:
                    assert seg[0, p] == seg[0, i], "attention crossed a packed row boundary"
            if seg[0, i] >= 0:  # the causal prefix of its own row + its own chain
                row_start = int((seg[0] == seg[0, i]).nonzero()[0])
                assert seen == list(range(row_start, i + 1)) + [s * t + i for s in range(1, j + 1)]


@pytest.mark.parametrize("chunk", [1, 2, 3, 128])
def test_ttt_cache_equals_explicit_mask_attention(chunk):
    """TTTCache (step-0 scores over each query chunk's key window + diagonal, compact
    positions) == one softmax over all steps' keys with the explicit `ttt_visibility` mask, at
    every position each step keeps, whatever the chunk size."""
    g = torch.Generator().manual_seed(0)
    b, nh, nkv, t, d, steps = 2, 4, 2, 7, 8, 4
    seg = torch.tensor([[0, 0, 0, 1, 1, 1, 1], [0, 0, 0, 0, 0, -1, -1]])
    visible = block_causal_mask(seg)
    qs = [torch.randn(b, nh, t, d, generator=g) for _ in range(steps)]
    ks = [torch.randn(b, nkv, t, d, generator=g) for _ in range(steps)]
    vs = [torch.randn(b, nkv, t, d, generator=g) for _ in range(steps)]
    cache = TTTCache(visible, chunk=chunk)
    if chunk == 2:  # windows start at the earliest row start of the chunk, over the batch
        assert cache.windows == [(0, 0, 2), (2, 0, 4), (4, 0, 6), (6, 3, 7)]
    idx = torch.arange(b * t)
    got = []
    for j in range(steps):
        if j > 0:  # drop a few positions each step (they have no loss left)
            idx = idx[torch.rand(idx.numel(), generator=g) < 0.8]
            cache.select(idx)

        q, k, v = (
            x.permute(1, 0, 2, 3).reshape(x.shape[1], b * t, d)[:, idx][None]
            for x in (qs[j], ks[j], vs[j])
        )
        got.append((idx, cache.attend(q, k, v)))
    k_all, v_all = torch.cat(ks, dim=2), torch.cat(vs, dim=2)
    for j, (idx, out) in enumerate(got):
        assert out.shape == (1, nh, idx.numel(), d)
        for n, flat in enumerate(idx.tolist()):
            bi, ti = divmod(flat, t)
            full = ttt_visibility(visible[bi], steps)[j, ti]
            want = masked_attention(
                qs[j][bi : bi + 1, :, ti : ti + 1],
                k_all[bi : bi + 1],
                v_all[bi : bi + 1],
                full[None, None],
            )
            torch.testing.assert_close(out[0, :, n], want[0, :, 0], rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------------------------------------
# SGLang semantics, re-implemented the way llama_eagle3.py computes them


def sglang_reference(draft: Eagle3Draft, aux_or_hidden, embeds, positions):
    """One LlamaForCausalLMEagle3 forward over a whole sequence [T], written from SGLang's code:
    fused qkv/gate_up weights (as load_weights stacks them), fused add+RMSNorm returning
    (normed, residual), cos/sin cache indexed by position, explicit causal attention loop.
    Returns (logits of hidden_states_to_logits, aux = pre-norm hidden fed back)."""
    sd, c = draft.state_dict(), draft.config

    def rms(x, w, residual=None):
        if residual is not None:
            x = x + residual
            residual = x
        y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + c.rms_norm_eps) * w
        return y if residual is None else (y, residual)

    hs = aux_or_hidden
    if hs.shape[-1] != embeds.shape[-1]:
        hs = hs @ sd["fc.weight"].T
    p = "midlayer."
    residual = hs
    hs = rms(hs, sd[p + "hidden_norm.weight"])
    e = rms(embeds, sd[p + "input_layernorm.weight"])
    x = torch.cat([e, hs], dim=-1)
    qkv_w = torch.cat([sd[p + f"self_attn.{n}_proj.weight"] for n in "qkv"])
    q_size, kv_size = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
    q, k, v = (x @ qkv_w.T).split([q_size, kv_size, kv_size], dim=-1)
    inv = 1.0 / (c.rope_theta ** (torch.arange(0, c.head_dim, 2, dtype=torch.float) / c.head_dim))
    freqs = torch.einsum("i,j -> ij", torch.arange(c.max_position_embeddings).float(), inv)
    cos, sin = freqs.cos()[positions], freqs.sin()[positions]

    def rope(t, n):
        t = t.view(-1, n, c.head_dim)
        a, b = t[..., : c.head_dim // 2], t[..., c.head_dim // 2 :]
        cs, sn = cos[:, None], sin[:, None]
        return torch.cat([a * cs - b * sn, b * cs + a * sn], dim=-1)

    q, k = rope(q, c.num_attention_heads), rope(k, c.num_key_value_heads)
    v = v.view(-1, c.num_key_value_heads, c.head_dim)
    group = c.num_attention_heads // c.num_key_value_heads
    out = torch.zeros_like(q)
    for i in range(q.shape[0]):
        for h in range(c.num_attention_heads):
            s = (k[: i + 1, h // group] @ q[i, h]) * c.head_dim**-0.5
            out[i, h] = torch.softmax(s, dim=0) @ v[: i + 1, h // group]
    attn = out.reshape(-1, q_size) @ sd[p + "self_attn.o_proj.weight"].T
    hs, residual = rms(attn, sd[p + "post_attention_layernorm.weight"], residual)
    gate, up = (
        hs @ torch.cat([sd[p + "mlp.gate_proj.weight"], sd[p + "mlp.up_proj.weight"]]).T
    ).chunk(2, dim=-1)
    hs = (F.silu(gate) * up) @ sd[p + "mlp.down_proj.weight"].T
    to_logits, to_aux = rms(hs, sd["norm.weight"], residual)
    return to_logits @ sd["lm_head.weight"].T, to_aux


@torch.no_grad()
def test_forward_matches_sglang_semantics():
    draft = tiny_draft()
    c = draft.config
    g = torch.Generator().manual_seed(1)
    t = 9
    aux = torch.randn(t, c.num_aux * c.target_hidden_size, generator=g)
    embeds = torch.randn(t, c.hidden_size, generator=g)
    pos = torch.arange(5, 5 + t)
    out = draft.step(embeds[None], draft.project(aux[None]), pos[None])
    want_logits, want_aux = sglang_reference(draft, aux, embeds, pos)
    torch.testing.assert_close(out[0], want_aux, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(draft.logits(out)[0], want_logits, rtol=1e-4, atol=1e-5)
    # a draft decode step: the fed-back hidden has width H, so SGLang skips fc
    nxt = draft.step(embeds[None], out, pos[None] + 1)
    want_logits, _ = sglang_reference(draft, out[0], embeds, pos + 1)
    torch.testing.assert_close(draft.logits(nxt)[0], want_logits, rtol=1e-4, atol=1e-5)
    ids = draft.logits(out)[0].argmax(-1)
    assert draft.t2d[draft.draft_to_target(ids)].all()


@torch.no_grad()
def test_kv_cache_incremental_equals_full():
    draft = tiny_draft()
    c = draft.config
    g = torch.Generator().manual_seed(2)
    t = 12
    hidden = draft.project(torch.randn(1, t, c.num_aux * c.hidden_size, generator=g))
    embeds = torch.randn(1, t, c.hidden_size, generator=g)
    pos = torch.arange(t)[None]
    full = draft.step(embeds, hidden, pos)
    cache = KVCache()
    parts = [
        draft.step(embeds[:, a:b], hidden[:, a:b], pos[:, a:b], cache)
        for a, b in ((0, 5), (5, 6), (6, 12))
    ]
    torch.testing.assert_close(torch.cat(parts, dim=1), full, rtol=1e-5, atol=1e-6)
    cache.truncate(6)  # roll back rejected positions, then redo them
    assert len(cache) == 6
    redo = draft.step(embeds[:, 6:], hidden[:, 6:], pos[:, 6:], cache)
    torch.testing.assert_close(redo, full[:, 6:], rtol=1e-5, atol=1e-6)


def test_config_from_targets(tiny_target, tiny_deepseek_target):
    cfg = DraftConfig.from_target_config(SMOLLM2, 4096, [1, 14, 26])
    assert (
        cfg.hidden_size,
        cfg.num_attention_heads,
        cfg.num_key_value_heads,
        cfg.head_dim,
        cfg.intermediate_size,
        cfg.vocab_size,
    ) == (576, 9, 3, 64, 1536, 49152)
    assert cfg.rope_theta == 100000.0 and cfg.rope_scaling is None
    draft = Eagle3Draft(cfg)
    assert draft.fc.weight.shape == (576, 3 * 576)
    assert draft.midlayer.self_attn.q_proj.weight.shape == (576, 2 * 576)
    for path in (tiny_target, tiny_deepseek_target):
        tc = json.loads((path / "config.json").read_text())
        dc = DraftConfig.from_target_config(tc, 32, [1, 1, 1])
        d = Eagle3Draft(dc)
        assert d.fc.weight.shape == (tc["hidden_size"], 3 * tc["hidden_size"])
        assert dc.vocab_size == tc["vocab_size"]


def test_llama3_rope_matches_transformers():
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    scaling = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    hf = LlamaConfig(
        hidden_size=512,
        num_attention_heads=4,
        head_dim=128,
        rope_parameters={"rope_theta": 500000.0, **scaling},
    )
    want, _ = ROPE_INIT_FUNCTIONS["llama3"](hf, "cpu")
    cfg = DraftConfig.from_target_config(hf.to_dict(), 16, [1, 2, 3])
    assert cfg.rope_scaling["rope_type"] == "llama3"
    draft = Eagle3Draft(cfg)
    torch.testing.assert_close(draft.midlayer.self_attn.rotary.inv_freq, want.float())


# ---------------------------------------------------------------------------------------------
# Export


VERIFIER = {"name_or_path": "results/target", "architectures": ["LlamaForCausalLM"]}


def export_tiny(draft, out, provenance=None):
    c = draft.config
    embed = torch.randn(c.vocab_size, c.target_hidden_size).to(torch.bfloat16)
    export_draft(draft, out, provenance or {}, embed=embed, verifier=VERIFIER)
    return embed


@torch.no_grad()
def test_export_round_trip_identical_logits(tmp_path):
    draft = tiny_draft(seed=3)
    embed = export_tiny(draft, tmp_path / "draft", {"test": True})
    check_export(tmp_path / "draft")
    names = set(load_file(str(tmp_path / "draft" / "model.safetensors")))
    assert not any("embed" in n for n in names)
    cfg = json.loads((tmp_path / "draft" / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"]
    assert cfg["tie_word_embeddings"] is False
    assert cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 2, 3]  # SGLang
    assert cfg["eagle_aux_hidden_state_layer_ids"] == [2, 3, 4]  # vLLM reads this one first
    spec = json.loads((tmp_path / "draft" / "speculators" / "config.json").read_text())
    assert spec["eagle_aux_hidden_state_layer_ids"] == [2, 3, 4]  # vLLM: input-of-layer
    assert spec["speculators_config"]["verifier"] == VERIFIER
    spec_w = load_file(str(tmp_path / "draft" / "speculators" / "model.safetensors"))
    assert torch.equal(spec_w["embed_tokens.weight"], embed)  # as stored: vLLM shares it
    assert not any(k.startswith("midlayer.") for k in spec_w)
    back = load_export(tmp_path / "draft")
    c = draft.config
    g = torch.Generator().manual_seed(4)
    aux = torch.randn(2, 6, c.num_aux * c.hidden_size, generator=g)
    embeds = torch.randn(2, 6, c.hidden_size, generator=g)
    pos = torch.arange(6).expand(2, 6)
    for model_out in (draft, back):
        out = model_out.step(embeds, model_out.project(aux), pos)
        logits = model_out.logits(out)
        if model_out is draft:
            want = logits
    assert torch.equal(logits, want)
    assert torch.equal(back.d2t, draft.d2t) and torch.equal(back.t2d, draft.t2d)


def test_contract_check_refuses_what_sglang_would_skip(tmp_path):
    draft = tiny_draft(seed=5)
    export_tiny(draft, tmp_path / "ok")
    weights = load_file(str(tmp_path / "ok" / "model.safetensors"))
    config = json.loads((tmp_path / "ok" / "config.json").read_text())

    def broken(name, tensors=None, cfg=None):
        d = tmp_path / name
        d.mkdir()
        save_file(tensors if tensors is not None else weights, str(d / "model.safetensors"))
        (d / "config.json").write_text(json.dumps(cfg or config))
        return d

    renamed = dict(weights)
    renamed["midlayer.self_attn.qkv.weight"] = renamed.pop("midlayer.self_attn.q_proj.weight")
    with pytest.raises(ExportError, match="would skip"):
        check_export(broken("renamed", renamed))
    shaped = {**weights, "fc.weight": weights["fc.weight"][:, :-1].contiguous()}
    with pytest.raises(ExportError, match="fc.weight"):
        check_export(broken("shape", shaped))
    embed = {**weights, "embed_tokens.weight": torch.zeros(config["vocab_size"], 64)}
    with pytest.raises(ExportError, match="embed_tokens"):
        check_export(broken("embed", embed))
    with pytest.raises(ExportError, match="tie_word_embeddings"):
        check_export(broken("tied", cfg={**config, "tie_word_embeddings": True}))
    no_t2d = {k: v for k, v in weights.items() if k != "t2d"}
    with pytest.raises(ExportError, match="t2d"):
        check_export(broken("no_t2d", no_t2d))
    # a config whose top-level ids are SGLang's (or absent) would feed vLLM the wrong layers
    sglang_ids = config["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
    for name, bad in (("top_same", sglang_ids), ("top_missing", None)):
        cfg = {**config, "eagle_aux_hidden_state_layer_ids": bad}
        with pytest.raises(ExportError, match="vLLM reads it before"):
            check_export(broken(name, cfg=cfg))


@torch.no_grad()
def test_full_vocabulary_draft_exports_without_mapping(tmp_path):
    """draft vocab == target vocab: no d2t/t2d (vLLM cannot load a d2t there), identity back."""
    draft = tiny_draft(seed=6, draft_vocab_size=DraftConfig.tiny().vocab_size)
    export_tiny(draft, tmp_path / "full")
    for d in (tmp_path / "full", tmp_path / "full" / "speculators"):
        names = set(load_file(str(d / "model.safetensors")))
        assert not names & {"d2t", "t2d"}, d
    back = load_export(tmp_path / "full")
    assert not back.d2t.any() and back.t2d.all()
    ids = torch.arange(back.config.draft_vocab_size)
    assert torch.equal(back.draft_to_target(ids), ids)
    weights = load_file(str(tmp_path / "full" / "model.safetensors"))
    weights["d2t"] = torch.zeros(back.config.draft_vocab_size, dtype=torch.long)
    save_file(weights, str(tmp_path / "full" / "model.safetensors"))
    with pytest.raises(ExportError, match="full-vocabulary"):
        check_export(tmp_path / "full")
