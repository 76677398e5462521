"""Multi-head latent attention (DeepSeek-V2 MLA) for the EAGLE-3 draft layer.

`draft.attention: mla` swaps the draft layer's grouped-query attention for the attention of
`Eagle3DeepseekV2ForCausalLM`, the MLA draft both pinned engines serve (SGLang 0.5.23
`srt/models/kimi_k25_eagle3.py` over `deepseek_v2.DeepseekV2AttentionMLA`, vLLM 0.32
`model_executor/models/deepseek_eagle3.py` over `deepseek_v2.DeepseekV2MLAAttention`). Per
position, with x = cat([input_layernorm(embed), hidden_norm(hidden)]) (2H wide, as for the
Llama draft):

    q        = q_b_proj(q_a_layernorm(q_a_proj(x)))            # [heads, nope + rope]
    c, k_pe  = split(kv_a_proj_with_mqa(x), [kv_lora, rope])   # one latent, one shared rope key
    k_nope, v = split(kv_b_proj(kv_a_layernorm(c)), [nope, v]) # per head
    q_pe, k_pe = RoPE(q_pe, k_pe)    interleaved pairs (GPT-J style), as both engines run it
    k        = cat([k_nope, k_pe broadcast over heads])
    out      = o_proj(softmax(q k^T * scale) v)

The engines cache only (c, k_pe) and fold kv_b_proj into the query and the output (the
"absorbed" form); that is the same function, so training and the in-process decoder use the
decompressed per-head K and V above and go through the draft's attention caches
(draftsmith.algorithms.eagle3.model.TTTCache, KVCache) unchanged: K is [heads, nope + rope] wide, V [heads, v].

RoPE: default, or YaRN as DeepSeek configures it (`deepseek_yarn` in both engines): frequencies
blended between interpolation and extrapolation over the correction range of beta_fast /
beta_slow, cos and sin multiplied by mscale(factor, mscale) / mscale(factor, mscale_all_dim),
and the softmax scale (nope + rope)^-0.5 multiplied by mscale(factor, mscale_all_dim)^2. The
caches scale scores by the key width^-0.5, so the query carries the extra mscale^2 factor.

Pure PyTorch: no I/O.
"""

from __future__ import annotations

import math

import torch
from torch import nn

KEYS = ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
ALGORITHMS = ("eagle3", "eagle3.1")
# the YaRN parameters both engines' deepseek_yarn rotary reads (attn_factor/extrapolation_factor
# are SGLang-only, attention_factor switches vLLM to another rotary: refused)
YARN_KEYS = {
    "rope_type",
    "type",
    "factor",
    "original_max_position_embeddings",
    "beta_fast",
    "beta_slow",
    "mscale",
    "mscale_all_dim",
}


class MLAError(ValueError):
    """A target or draft config the MLA draft cannot be built from."""


def dims_from_target(cfg: dict) -> dict[str, int]:
    """The MLA widths of the target's text config (the draft uses the target's own)."""
    missing = [k for k in KEYS if cfg.get(k) is None]
    if missing:
        arch = (cfg.get("architectures") or ["?"])[0]
        raise MLAError(
            f"draft.attention is mla but the target ({arch}, model_type "
            f"{cfg.get('model_type')!r}) has no MLA fields {missing} in its config.json: an MLA "
            "draft needs a DeepSeek-V2/V3 or Kimi-K2.x style target (with q_lora_rank: the "
            "engines' Eagle3DeepseekV2ForCausalLM has no plain q_proj); use draft.attention llama"
        )
    return {k: int(cfg[k]) for k in KEYS}


def scaling_from_target(rope: dict) -> dict | None:
    """The draft's rope_scaling from `families.target_rope(cfg)`: None (default RoPE) or the
    target's YaRN parameters; any other kind is refused (no engine runs it for this class)."""
    if rope["kind"] == "default":
        return None
    if rope["kind"] != "yarn":
        raise MLAError(
            f"draft.attention mla: the target's RoPE is {rope['kind']!r}; the MLA draft "
            "reproduces default and yarn RoPE only (the engines' deepseek_yarn)"
        )
    return dict(rope["scaling"])


def check(cfg) -> None:
    """Refuse a DraftConfig whose MLA fields the engines would read otherwise."""
    if cfg.algorithm not in ALGORITHMS:
        raise MLAError(f"draft.attention mla works with {list(ALGORITHMS)}, not {cfg.algorithm!r}")
    if not isinstance(cfg.mla, dict) or sorted(cfg.mla) != sorted(KEYS):
        raise MLAError(f"an MLA draft config needs mla = {{{', '.join(KEYS)}}}, got {cfg.mla!r}")
    bad = [k for k in KEYS if not (isinstance(cfg.mla[k], int) and cfg.mla[k] > 0)]
    if bad or cfg.mla["qk_rope_head_dim"] % 2:
        raise MLAError(f"MLA widths must be positive ints (qk_rope_head_dim even): {cfg.mla}")
    if cfg.num_key_value_heads != cfg.num_attention_heads:
        raise MLAError("an MLA draft has one K/V head per query head")
    s = cfg.rope_scaling
    if s is not None:
        kind = str(s.get("rope_type", s.get("type")))
        extra = sorted(set(s) - YARN_KEYS)
        if kind != "yarn" or extra or "factor" not in s:
            raise MLAError(
                f"MLA draft rope_scaling must be yarn with a factor and only {sorted(YARN_KEYS)}: "
                f"got {s}"
            )


def yarn_mscale(scale: float, mscale: float) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def score_factor(cfg) -> float:
    """What YaRN multiplies the softmax scale by: mscale(factor, mscale_all_dim)^2 (1 without)."""
    s = cfg.rope_scaling
    if s is None:
        return 1.0
    m = yarn_mscale(float(s["factor"]), float(s.get("mscale_all_dim", 0) or 0))
    return m * m


def softmax_scale(cfg) -> float:
    """The engines' attention scale: (nope + rope)^-0.5 * score_factor."""
    return (cfg.mla["qk_nope_head_dim"] + cfg.mla["qk_rope_head_dim"]) ** -0.5 * score_factor(cfg)


def _yarn_inv_freq(dim: int, base: float, s: dict) -> torch.Tensor:
    factor = float(s["factor"])
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.float) / dim)
    extra, inter = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    old = float(s["original_max_position_embeddings"])

    def corr(rot: float) -> float:
        return (dim * math.log(old / (rot * 2 * math.pi))) / (2 * math.log(base))

    low = max(math.floor(corr(float(s.get("beta_fast", 32)))), 0)
    high = min(math.ceil(corr(float(s.get("beta_slow", 1)))), dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float) - low) / (high - low)).clamp(0, 1)
    mask = 1 - ramp
    return inter * (1 - mask) + extra * mask


class InterleavedRotary(nn.Module):
    """RoPE on the rope part of q and k, pairs (2i, 2i+1) rotated together (`is_neox_style`
    False), with DeepSeek's YaRN when the config has it."""

    def __init__(self, cfg):
        super().__init__()
        dim, s = cfg.mla["qk_rope_head_dim"], cfg.rope_scaling
        if s is None:
            inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
            self.mscale = 1.0
        else:
            inv_freq = _yarn_inv_freq(dim, cfg.rope_theta, s)
            factor = float(s["factor"])
            self.mscale = yarn_mscale(factor, float(s.get("mscale", 1))) / yarn_mscale(
                factor, float(s.get("mscale_all_dim", 0) or 0)
            )
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        """x [B, heads, T, rope], position_ids [B, T] -> rotated x."""
        freqs = position_ids.float()[..., None] * self.inv_freq  # [B, T, rope/2]
        cos = (freqs.cos() * self.mscale).repeat_interleave(2, -1)[:, None].to(x.dtype)
        sin = (freqs.sin() * self.mscale).repeat_interleave(2, -1)[:, None].to(x.dtype)
        rotated = torch.stack([-x[..., 1::2], x[..., 0::2]], dim=-1).flatten(-2)
        return x * cos + rotated * sin


class MLAAttention(nn.Module):
    """The MLA draft attention; parameter names are the checkpoint's (q_a_proj, q_a_layernorm,
    q_b_proj, kv_a_proj_with_mqa, kv_a_layernorm, kv_b_proj, o_proj). `norm` is the draft's
    RMSNorm class (draftsmith.algorithms.layers.RMSNorm, the engines' fp32-statistics norm)."""

    def __init__(self, cfg, norm):
        super().__init__()
        m = cfg.mla
        self.nh = cfg.num_attention_heads
        self.nope, self.rope, self.vd = (
            m["qk_nope_head_dim"],
            m["qk_rope_head_dim"],
            m["v_head_dim"],
        )
        self.kv_lora = m["kv_lora_rank"]
        width = 2 * cfg.hidden_size
        self.q_a_proj = nn.Linear(width, m["q_lora_rank"], bias=False)
        self.q_a_layernorm = norm(m["q_lora_rank"], cfg.rms_norm_eps)
        self.q_b_proj = nn.Linear(m["q_lora_rank"], self.nh * (self.nope + self.rope), bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(width, self.kv_lora + self.rope, bias=False)
        self.kv_a_layernorm = norm(self.kv_lora, cfg.rms_norm_eps)
        self.kv_b_proj = nn.Linear(self.kv_lora, self.nh * (self.nope + self.vd), bias=False)
        self.o_proj = nn.Linear(self.nh * self.vd, cfg.hidden_size, bias=False)
        self.rotary = InterleavedRotary(cfg)
        # the caches scale by (nope + rope)^-0.5; the query carries YaRN's mscale^2 on top
        self.q_factor = score_factor(cfg)

    def forward(self, x, position_ids, cache):
        b, t, _ = x.shape
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q = q.view(b, t, self.nh, self.nope + self.rope).transpose(1, 2)
        c, k_pe = self.kv_a_proj_with_mqa(x).split([self.kv_lora, self.rope], dim=-1)
        kv = self.kv_b_proj(self.kv_a_layernorm(c)).view(b, t, self.nh, self.nope + self.vd)
        k_nope, v = kv.transpose(1, 2).split([self.nope, self.vd], dim=-1)
        q_nope, q_pe = q.split([self.nope, self.rope], dim=-1)
        q_pe = self.rotary(q_pe, position_ids)
        k_pe = self.rotary(k_pe[:, None], position_ids).expand(b, self.nh, t, self.rope)
        q = torch.cat([q_nope, q_pe], dim=-1)
        if self.q_factor != 1.0:
            q = q * self.q_factor
        k = torch.cat([k_nope, k_pe], dim=-1)
        out = cache.attend(q, k, v)  # [B, heads, T, v]
        return self.o_proj(out.transpose(1, 2).reshape(b, t, self.nh * self.vd))
