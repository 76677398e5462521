"""The DFlash draft: a block drafter that proposes a block of tokens in one forward.

Computed as vLLM 0.32 serves `DFlashDraftModel` (`DFlashQwen3ForCausalLM`,
`model_executor/models/qwen3_dflash.py`), with the defaults our export writes: every layer
non-causal within the block, full attention, no sliding window, no sink bias, neox RoPE.

Context: the target's aux states of every position whose target features are known
(prompt and accepted tokens), `ctx = hidden_norm(fc(concat aux))` [C, H]. Each layer reads the
context only through its own K/V projections of `ctx` (no input_layernorm, no layer before it):

    k_ctx = rope(k_norm(k_proj(ctx)), ctx positions)      v_ctx = v_proj(ctx)

Block: `block_size` slots at positions a .. a+B-1, where a is the position right after the
context: slot 0 holds the last known token (the target's bonus token), the others the mask
token; their inputs are the target's embeddings (shared, frozen, not part of this module). A
Qwen3-style pre-norm decoder layer (per-head q_norm / k_norm before RoPE) runs over the slots;
its attention sees the context keys and the keys of every slot of its own block:

    h   = x + o_proj(attn(q(ln1 x), [k_ctx; k(ln1 x)], [v_ctx; v(ln1 x)]))
    x'  = h + mlp(ln2 h)
    out = norm(x_last)            logits = target lm_head(out)

Slot k >= 1 proposes the token at position a + k. The lm_head is the target's (shared).

Pure PyTorch: no I/O, no logging, no torch.distributed.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
from torch import nn

from draftsmith.algorithms.layers import MLP, RMSNorm, Rotary, masked_attention


@dataclass
class DFlashConfig:
    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    num_hidden_layers: int
    vocab_size: int
    aux_layer_ids: list[int]  # output-of-layer ids (SGLang's, HF hidden_states[i + 1])
    target_hidden_size: int
    mask_token_id: int
    block_size: int
    num_target_layers: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 8192
    hidden_act: str = "silu"
    algorithm: str = "dflash"
    rope_scaling = None  # plain RoPE only (read by layers.Rotary)

    def __post_init__(self):
        problems = []
        if self.hidden_act != "silu":
            problems.append(f"hidden_act must be silu, got {self.hidden_act}")
        if self.num_attention_heads % self.num_key_value_heads:
            problems.append("num_attention_heads is not a multiple of num_key_value_heads")
        if self.head_dim % 2:
            problems.append(f"head_dim must be even for RoPE, got {self.head_dim}")
        if self.block_size < 2:
            problems.append(
                f"block_size must be >= 2 (one known token + masks), got {self.block_size}"
            )
        if not 0 <= self.mask_token_id < self.vocab_size:
            problems.append(f"mask_token_id {self.mask_token_id} outside [0, {self.vocab_size})")
        if self.num_hidden_layers < 1 or not self.aux_layer_ids:
            problems.append("a DFlash draft needs >= 1 layer and >= 1 aux layer id")
        if problems:
            raise ValueError("DFlash draft config: " + "; ".join(problems))

    @property
    def num_aux(self) -> int:
        return len(self.aux_layer_ids)

    @property
    def draft_vocab_size(self) -> int:
        """The whole target vocabulary: the target's lm_head is shared."""
        return self.vocab_size

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_target_config(
        cls, cfg: dict, aux_layer_ids: list[int], layers: int, block_size: int, mask_token_id: int
    ) -> DFlashConfig:
        """Shapes from the target's HF config.json (Llama-like or Qwen3); the target's hidden
        width (its embedding and lm_head are shared), plain RoPE with the target's theta;
        mask_token_id -1 = the target's last vocabulary id."""
        cfg = dict(cfg.get("text_config") or cfg)
        if "kv_lora_rank" in cfg:
            raise ValueError("DFlash drafts for MLA targets are not built here")
        heads, vocab = int(cfg["num_attention_heads"]), int(cfg["vocab_size"])
        return cls(
            hidden_size=int(cfg["hidden_size"]),
            num_attention_heads=heads,
            num_key_value_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or int(cfg["hidden_size"]) // heads),
            intermediate_size=int(cfg["intermediate_size"]),
            num_hidden_layers=int(layers),
            vocab_size=vocab,
            aux_layer_ids=[int(i) for i in aux_layer_ids],
            target_hidden_size=int(cfg["hidden_size"]),
            mask_token_id=vocab - 1 if mask_token_id < 0 else int(mask_token_id),
            block_size=int(block_size),
            num_target_layers=int(cfg["num_hidden_layers"]),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=float(cfg.get("rope_theta") or 10000.0),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 8192)),
        )

    @classmethod
    def tiny(cls, vocab_size: int = 256, layers: int = 2, block_size: int = 4) -> DFlashConfig:
        """A small draft for unit tests (GQA 4:2, head_dim 16)."""
        return cls(
            hidden_size=64,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            intermediate_size=128,
            num_hidden_layers=layers,
            vocab_size=vocab_size,
            aux_layer_ids=[0, 1, 2],
            target_hidden_size=64,
            mask_token_id=vocab_size - 1,
            block_size=block_size,
            num_target_layers=4,
        )


class DFlashAttention(nn.Module):
    def __init__(self, cfg: DFlashConfig):
        super().__init__()
        self.nh, self.nkv, self.hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        h = cfg.hidden_size
        self.q_proj = nn.Linear(h, self.nh * self.hd, bias=False)
        self.k_proj = nn.Linear(h, self.nkv * self.hd, bias=False)
        self.v_proj = nn.Linear(h, self.nkv * self.hd, bias=False)
        self.o_proj = nn.Linear(self.nh * self.hd, h, bias=False)
        self.q_norm = RMSNorm(self.hd, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(self.hd, cfg.rms_norm_eps)
        self.rotary = Rotary(cfg)

    def _kv(self, x: torch.Tensor, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """[B,T,H] at positions [B,T] -> roped K, V [B,nkv,T,d]."""
        b, t, _ = x.shape
        k = self.k_norm(self.k_proj(x).view(b, t, self.nkv, self.hd)).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.nkv, self.hd).transpose(1, 2)
        return self._rope(k, pos), v

    def _rope(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """RoPE on one [B, heads, T, d] tensor (layers.Rotary rotates a q/k pair)."""
        return self.rotary(x, x[:, :0], pos)[0]

    def context_kv(self, ctx: torch.Tensor, pos: torch.Tensor):
        """The K/V the context contributes to this layer (what vLLM precomputes into its cache)."""
        return self._kv(ctx, pos)

    def forward(self, x, pos, ctx_kv, visible):
        b, t, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(b, t, self.nh, self.hd)).transpose(1, 2)
        q = self._rope(q, pos)
        k, v = self._kv(x, pos)
        k, v = torch.cat([ctx_kv[0], k], dim=2), torch.cat([ctx_kv[1], v], dim=2)
        if visible is None:
            visible = torch.ones(1, t, k.shape[2], dtype=torch.bool, device=x.device)
        out = masked_attention(q, k, v, visible)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, self.nh * self.hd))


class DFlashLayer(nn.Module):
    def __init__(self, cfg: DFlashConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = DFlashAttention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x, pos, ctx_kv, visible):
        h = x + self.self_attn(self.input_layernorm(x), pos, ctx_kv, visible)
        return h + self.mlp(self.post_attention_layernorm(h))


class DFlashDraft(nn.Module):
    """State-dict names are the exported checkpoint's (fc, hidden_norm, layers.*, norm); no
    embedding and no lm_head: the target's are shared."""

    def __init__(self, cfg: DFlashConfig):
        super().__init__()
        self.config = cfg
        self.fc = nn.Linear(cfg.num_aux * cfg.target_hidden_size, cfg.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.layers = nn.ModuleList(DFlashLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def context(self, aux: torch.Tensor) -> torch.Tensor:
        """Target aux states [B,C,n_aux*H_t] (aux-id order) -> context states [B,C,H]."""
        return self.hidden_norm(self.fc(aux))

    def context_kv(self, ctx: torch.Tensor, pos: torch.Tensor) -> list:
        """Per layer, the context's (K, V) [B,nkv,C,d] at positions pos [B,C]."""
        return [layer.self_attn.context_kv(ctx, pos) for layer in self.layers]

    def forward(self, block_embeds, block_pos, ctx_kv, visible=None) -> torch.Tensor:
        """block_embeds [B,Q,H] (target embeddings of the slot tokens) at positions [B,Q];
        ctx_kv from `context_kv`; visible [B,Q,C+Q] bool (None: every key). Returns the
        post-norm states [B,Q,H] the target's lm_head reads."""
        x = block_embeds
        for layer, kv in zip(self.layers, ctx_kv, strict=True):
            x = layer(x, block_pos, kv, visible)
        return self.norm(x)

    def block_inputs(self, token: int, start: int, n: int, device) -> tuple:
        """The slot ids [1,n] ([token, mask, ...]) and positions [1,n] of a block at `start`."""
        ids = torch.full((1, n), self.config.mask_token_id, dtype=torch.long, device=device)
        ids[0, 0] = token
        return ids, torch.arange(start, start + n, device=device)[None]
