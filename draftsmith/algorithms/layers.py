"""The draft layers' building blocks every algorithm here shares: SGLang's RMSNorm, RoPE with
SGLang's inverse frequencies, masked softmax attention and the gated MLP (pure torch)."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


def rope_type(scaling: dict) -> str:
    return str(scaling.get("rope_type", scaling.get("type", "default")))


class RMSNorm(nn.Module):
    """SGLang's RMSNorm (forward_native): fp32 statistics, weight applied in fp32."""

    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return (x * self.weight.float()).to(dtype)


class Rotary(nn.Module):
    """Neox-style RoPE with SGLang's inverse frequencies (default, linear, llama3)."""

    def __init__(self, cfg):
        super().__init__()
        dim = cfg.head_dim
        inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
        self.position_scale = 1.0
        kind = rope_type(cfg.rope_scaling) if cfg.rope_scaling else "default"
        if kind == "linear":
            self.position_scale = 1.0 / float(cfg.rope_scaling["factor"])
        elif kind == "llama3":
            inv_freq = _llama3_inv_freq(inv_freq, cfg.rope_scaling)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, q, k, position_ids):
        """q [B,nh,T,d], k [B,nkv,T,d], position_ids [B,T] -> rotated q, k."""
        t = position_ids.float()
        if self.position_scale != 1.0:
            t = t * self.position_scale
        freqs = t[..., None] * self.inv_freq  # [B,T,d/2]
        angles = torch.cat([freqs, freqs], -1)[:, None]
        cos, sin = angles.cos().to(q.dtype), angles.sin().to(q.dtype)
        return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    a, b = x.chunk(2, dim=-1)
    return torch.cat([-b, a], dim=-1)


def _llama3_inv_freq(inv_freq: torch.Tensor, s: dict) -> torch.Tensor:
    factor = float(s["factor"])
    low, high = float(s["low_freq_factor"]), float(s["high_freq_factor"])
    old_len = float(s["original_max_position_embeddings"])
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    smooth = (old_len / wavelen - low) / (high - low) if low != high else 0
    return torch.where(
        wavelen < high_wavelen,
        inv_freq,
        torch.where(
            wavelen > low_wavelen,
            inv_freq / factor,
            (1 - smooth) * inv_freq / factor + smooth * inv_freq,
        ),
    )


def _expand_kv(x: torch.Tensor, groups: int) -> torch.Tensor:
    """[B,nkv,S,d] -> [B,nkv*groups,S,d]; query head h uses kv head h // groups."""
    return x if groups == 1 else x.repeat_interleave(groups, dim=1)


def masked_attention(q, k, v, visible: torch.Tensor) -> torch.Tensor:
    """Softmax attention; `visible` [B,T,S] bool broadcasts over heads. Rows see >= 1 key."""
    groups = q.shape[1] // k.shape[1]
    k, v = _expand_kv(k, groups), _expand_kv(v, groups)
    scores = (q @ k.transpose(-1, -2)) * q.shape[-1] ** -0.5
    scores = scores.masked_fill(~visible[:, None], float("-inf"))
    return torch.softmax(scores.float(), dim=-1).to(q.dtype) @ v


class MLP(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
