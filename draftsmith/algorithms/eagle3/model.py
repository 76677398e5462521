"""The EAGLE-3 draft: one Llama decoder layer, computed exactly as SGLang serves it.

Reference: `sglang/srt/models/llama_eagle3.py` of the pinned sglang==0.5.23 wheel
(`LlamaForCausalLMEagle3`). Per position the draft computes

    residual = hidden                                  # fc(aux) at step 0, own output later
    x        = cat([input_layernorm(embed), hidden_norm(hidden)], -1)     # 2H wide
    residual = self_attn(x) + residual                 # q/k/v take 2H, o gives H
    out      = mlp(post_attention_layernorm(residual)) + residual
    logits   = lm_head(norm(out))                      # draft vocabulary
    target   = draft_id + d2t[draft_id]

`out` (pre-norm) is what SGLang feeds back as the next draft step's hidden state
(`hidden_states_to_aux` of its fused final norm). The input embedding is the target's, frozen,
and lives outside this module (it is never saved): callers pass `input_embeds`.

EAGLE-3.1 (`DraftConfig.algorithm` "eagle3.1"; its spec sets the config's switches, plain
fields) switches on two pieces
both engines read from the exported config.json: `fc_norm`, one RMSNorm per aux state before
fc (`project`), and `norm_output`, the post-norm state `norm(out)` fed back instead of `out`
(`feedback`). Callers chain steps with `hidden = draft.feedback(out)`.

Attention goes through a cache object with one method, `attend(q, k, v)`:
`KVCache` for incremental decoding and `TTTCache` for training-time test, whose visibility
rule (`ttt_visibility`) is spelled out as an explicit mask for tests.

Pure PyTorch: no I/O, no logging, no torch.distributed.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING

import torch
from torch import nn

from draftsmith.algorithms.layers import MLP, RMSNorm, Rotary, masked_attention, rope_type
from draftsmith.targets.families import DRAFT_ROPE as SUPPORTED_ROPE
from draftsmith.targets.families import target_rope

if TYPE_CHECKING:
    from draftsmith.algorithms.spec import AlgorithmSpec

EAGLE3 = "eagle3"  # the algorithm of a draft with no switch on (the registry's default)
SWITCHES = ("fc_norm", "norm_output")  # the layer switches an algorithm's spec may turn on


@dataclass
class DraftConfig:
    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int  # target vocabulary (t2d length)
    draft_vocab_size: int
    aux_layer_ids: list[int]
    target_hidden_size: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None  # None | {"rope_type": "linear"|"llama3", ...}
    max_position_embeddings: int = 8192
    hidden_act: str = "silu"
    extra: dict = field(default_factory=dict)  # provenance only (e.g. dropped rope scaling)
    algorithm: str = EAGLE3  # draft.algorithm: the name config.json records
    attention: str = (
        "llama"  # draft.attention: llama (q/k/v/o) | mla (draftsmith.algorithms.eagle3.mla)
    )
    mla: dict | None = None  # MLA widths (mla.KEYS), with attention mla
    fc_norm: bool = False  # one RMSNorm per aux state before fc (EAGLE-3.1)
    norm_output: bool = False  # the post-norm output is fed back between draft steps (EAGLE-3.1)

    def __post_init__(self):
        if self.hidden_act != "silu":
            raise ValueError(
                f"draft hidden_act must be silu (SGLang's only one), got {self.hidden_act}"
            )
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads {self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads {self.num_key_value_heads}"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for RoPE, got {self.head_dim}")
        if not 1 <= self.draft_vocab_size <= self.vocab_size:
            raise ValueError(
                f"draft_vocab_size {self.draft_vocab_size} must be in [1, {self.vocab_size}]"
            )
        if self.attention not in ("llama", "mla"):
            raise ValueError(f"draft attention {self.attention!r} is not one of llama, mla")
        if self.attention == "mla":
            # draftsmith.algorithms.eagle3.mla uses this module's RMSNorm
            import draftsmith.algorithms.eagle3.mla as mla

            mla.check(self)
        elif self.rope_scaling is not None:
            kind = rope_type(self.rope_scaling)
            if kind not in SUPPORTED_ROPE:
                raise ValueError(f"rope_scaling type {kind!r} is not one of {SUPPORTED_ROPE}")

    @property
    def num_aux(self) -> int:
        return len(self.aux_layer_ids)

    def to_dict(self) -> dict:
        """The fields; `algorithm` only when not the default and a switch only when on (the
        default's provenance is the one written before those fields existed)."""
        out = asdict(self)
        if out["algorithm"] == EAGLE3:
            del out["algorithm"]
        for k in SWITCHES:
            if not out[k]:
                del out[k]
        if out["attention"] == "llama":  # likewise: a Llama draft's provenance as before
            del out["attention"], out["mla"]
        return out

    @classmethod
    def from_dict(cls, d: dict) -> DraftConfig:
        return cls(**d)

    @classmethod
    def from_target_config(
        cls,
        cfg: dict,
        draft_vocab_size: int,
        aux_layer_ids: list[int],
        attention: str = "llama",
        spec: AlgorithmSpec | None = None,
    ) -> DraftConfig:
        """Draft shapes from the target's HF `config.json` dict (Llama-like or DeepSeek-V3/MLA).

        MLA targets (DeepSeek-V3, Kimi-K2.x) have no per-head K/V width; the draft uses
        `v_head_dim` as its head_dim, as the published Kimi EAGLE-3 drafts do. RoPE scaling
        kinds other than linear/llama3 (e.g. yarn, longrope) are not reproduced: the draft then
        uses plain RoPE with the target's theta, its exported config says so, so serving matches
        training, and the export warns (`draftsmith.targets.families.rope_note`). Per-layer-type RoPE
        (Gemma-3) gives the full-attention layers' theta and scaling. `attention` "mla" takes
        the target's MLA widths and its RoPE, YaRN included (draftsmith.algorithms.eagle3.mla; refused without).
        `spec`: the draft's algorithm (its name and layer switches; None: EAGLE-3's, none on).
        """
        cfg = dict(cfg.get("text_config") or cfg)
        for key in ("hidden_size", "num_attention_heads", "intermediate_size", "vocab_size"):
            if key not in cfg:
                raise ValueError(f"target config has no {key!r}")
        hidden = int(cfg["hidden_size"])
        heads = int(cfg["num_attention_heads"])
        kv_heads = int(cfg.get("num_key_value_heads") or heads)
        if "kv_lora_rank" in cfg:  # MLA: no GQA width, use the value head width
            head_dim = int(cfg.get("v_head_dim") or hidden // heads)
        else:
            head_dim = int(cfg.get("head_dim") or hidden // heads)
        rope = target_rope(cfg)  # per-layer-type RoPE (Gemma-3): the full-attention layers'
        theta, scaling, extra = rope["theta"], rope["scaling"], {}
        if rope["layer_type"]:
            extra["target_rope_layer_type"] = rope["layer_type"]
        mla_dims = None
        if attention == "mla":
            import draftsmith.algorithms.eagle3.mla as mla

            mla_dims, scaling = mla.dims_from_target(cfg), mla.scaling_from_target(rope)
            kv_heads = heads
        elif scaling is not None and rope["kind"] not in SUPPORTED_ROPE:
            extra["target_rope_scaling_not_used"] = dict(scaling)  # the export warns
            scaling = None
        return cls(
            hidden_size=hidden,
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=head_dim,
            intermediate_size=int(cfg["intermediate_size"]),
            vocab_size=int(cfg["vocab_size"]),
            draft_vocab_size=int(draft_vocab_size),
            aux_layer_ids=[int(i) for i in aux_layer_ids],
            target_hidden_size=hidden,
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            rope_scaling=scaling,
            max_position_embeddings=int(cfg.get("max_position_embeddings", 8192)),
            extra=extra,
            attention=attention,
            mla=mla_dims,
            **({"algorithm": spec.name, **spec.draft} if spec is not None else {}),
        )

    @classmethod
    def tiny(cls, vocab_size: int = 256, draft_vocab_size: int = 64) -> DraftConfig:
        """A few-thousand-parameter draft for unit tests (GQA 4:2, head_dim 16)."""
        return cls(
            hidden_size=64,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            intermediate_size=128,
            vocab_size=vocab_size,
            draft_vocab_size=draft_vocab_size,
            aux_layer_ids=[1, 2, 3],
            target_hidden_size=64,
            rms_norm_eps=1e-6,
            rope_theta=10000.0,
            max_position_embeddings=2048,
        )


# ---------------------------------------------------------------------------------------------
# Attention: masks and caches


def block_causal_mask(segment_ids: torch.Tensor) -> torch.Tensor:
    """[B,T] segment ids (rows packed in a sequence; -1 = padding) -> [B,T,T] bool.

    Query i sees key p iff p <= i and both are in the same segment; padding sees only itself.
    """
    t = segment_ids.shape[-1]
    causal = torch.ones(t, t, dtype=torch.bool, device=segment_ids.device).tril()
    same = segment_ids[:, :, None] == segment_ids[:, None, :]
    eye = torch.eye(t, dtype=torch.bool, device=segment_ids.device)
    return (causal & same) | eye


def ttt_visibility(step0: torch.Tensor, steps: int) -> torch.Tensor:
    """The full TTT mask, for tests: [steps, T, steps*T] bool, key index = s*T + p.

    A query of step j at position i sees the step-0 keys that `step0[i]` allows (the causal
    prefix within its row) and the keys of steps 1..j at position i itself (the diagonal).
    """
    t = step0.shape[-1]
    full = torch.zeros(steps, t, steps * t, dtype=torch.bool)
    eye = torch.eye(t, dtype=torch.bool)
    for j in range(steps):
        full[j, :, :t] = step0
        for s in range(1, j + 1):
            full[j, :, s * t : (s + 1) * t] = eye
    return full


class CausalAttention:
    """No cache: causal attention within the T given tokens (or a given [B,T,T] mask)."""

    def __init__(self, visible: torch.Tensor | None = None):
        self.visible = visible

    def attend(self, q, k, v):
        visible = self.visible
        if visible is None:
            t = q.shape[2]
            visible = torch.ones(1, t, t, dtype=torch.bool, device=q.device).tril()
        return masked_attention(q, k, v, visible)


class KVCache:
    """Incremental decoding: `attend` appends the new K/V, new token t sees all cached keys
    plus new keys <= t. `truncate(n)` drops rejected speculative positions."""

    def __init__(self):
        self.k: torch.Tensor | None = None
        self.v: torch.Tensor | None = None

    def __len__(self) -> int:
        return 0 if self.k is None else self.k.shape[2]

    def truncate(self, n: int) -> None:
        if self.k is not None:
            self.k, self.v = self.k[:, :, :n], self.v[:, :, :n]

    def attend(self, q, k, v):
        past = len(self)
        self.k = k if self.k is None else torch.cat([self.k, k], dim=2)
        self.v = v if self.v is None else torch.cat([self.v, v], dim=2)
        t, s = q.shape[2], self.k.shape[2]
        visible = torch.ones(t, s, dtype=torch.bool, device=q.device).tril(diagonal=past)
        return masked_attention(q, self.k, self.v, visible[None])


class TTTCache:
    """Training-time-test attention over an unrolled chain of draft steps (packed rows).

    The model is called with [1, N, ...] tensors holding the flat positions `index`
    (b * T + t, ascending) chosen with `select`: step 0 holds every position of the [B, T]
    batch, later steps any subset of the previous step's positions (those that still have a
    loss to train; the others are skipped, so the projections and the MLP run only where they
    matter). Attention itself is batched over the whole [B, T] layout: queries and keys are
    scattered into it once per step (zeros elsewhere, never seen by a selected query) and the
    outputs gathered back, so there is no per-row loop and no per-step gather of old keys.

    A query of step j at position t sees the step-0 keys `step0_visible[b, t]` allows
    (block-causal over the packed rows, kept as an additive 0/-inf mask made once) and its own
    keys of steps 1..j (the diagonal): step-0 scores concatenated with j diagonal scores
    `(q * k_s).sum(-1)`, one softmax over both, output `p0 @ v0 + sum_s p_s * v_s`.
    `ttt_visibility` is the same rule as an explicit mask. Grouped-query heads are views
    ([B, nkv, g, T, d]: query head h uses kv head h // g); K and V are never repeated.

    The queries go in chunks of `chunk` positions; a chunk's step-0 scores cover only the keys
    from the start of the earliest row any of its queries is in (over the batch) to its last
    position. Every key outside that window is masked for all of the chunk's queries (an
    earlier row or a later position), so the softmax is the full one; with rows shorter than
    the pack, most of the T x T scores are never computed.
    """

    def __init__(self, step0_visible: torch.Tensor, chunk: int = 128):
        self.batch, self.length = step0_visible.shape[:2]
        bias = torch.zeros(step0_visible.shape, device=step0_visible.device)
        self.bias = bias.masked_fill_(~step0_visible, float("-inf"))[:, None, None]
        # the first key each query sees (its row's start; a padding position sees itself)
        first = step0_visible.to(torch.uint8).argmax(-1).amin(0)  # [T], over the batch
        self.windows = [
            (a, int(first[a : a + chunk].min()), min(a + chunk, self.length))
            for a in range(0, self.length, chunk)
        ]
        self.index: torch.Tensor | None = None  # None: every position, in order
        self.k0 = self.v0 = None  # [B, nkv, T, d]
        self.dk = self.dv = None  # steps 1..j: [B, nkv, 1, T, j, d]

    def select(self, index: torch.Tensor) -> None:
        """Flat positions (ascending) of the next step's queries."""
        self.index = index

    def _batched(self, x: torch.Tensor) -> torch.Tensor:
        """[1, heads, N, d] at `index` -> [B, heads, T, d] (zeros at unselected positions)."""
        x = x[0].transpose(0, 1)  # [N, heads, d]
        if self.index is not None:
            full = x.new_zeros(self.batch * self.length, *x.shape[1:])
            x = full.index_copy(0, self.index, x)
        return x.view(self.batch, self.length, *x.shape[1:]).transpose(1, 2)

    def _window(self, qg: torch.Tensor, a: int, w0: int, e: int) -> torch.Tensor:
        """Outputs [B, nkv, g, e - a, dv] of the queries a..e-1 (qg: [B, nkv, g, T, d], scaled)
        over the step-0 keys w0..e-1 and their own diagonal keys."""
        q = qg[:, :, :, a:e]
        bsz, nkv, g, c, d = q.shape
        k0, v0 = self.k0[:, :, w0:e], self.v0[:, :, w0:e]
        width = e - w0
        scores = (q.reshape(bsz, nkv, g * c, d) @ k0.transpose(-1, -2)).view(bsz, nkv, g, c, width)
        if self.dk is not None:
            sd = (q[..., None, :] * self.dk[:, :, :, a:e]).sum(-1)  # [B, nkv, g, c, j]
            scores = torch.cat([scores, sd], dim=-1)
        scores = scores.float()
        scores[..., :width] += self.bias[..., a:e, w0:e]
        p = torch.softmax(scores, dim=-1).to(q.dtype)
        o = (p[..., :width].reshape(bsz, nkv, g * c, width) @ v0).view(bsz, nkv, g, c, -1)
        if self.dv is not None:
            o = o + (p[..., width:, None] * self.dv[:, :, :, a:e]).sum(-2)
        return o

    def attend(self, q, k, v):
        """q/k [1, nh|nkv, N, d], v [1, nkv, N, dv] at `self.index` -> [1, nh, N, dv]."""
        if self.k0 is None and q.shape[2] != self.batch * self.length:
            raise ValueError(
                f"TTT step 0 needs all {self.batch * self.length} positions, got {q.shape[2]}"
            )
        q, k, v = self._batched(q), self._batched(k), self._batched(v)
        bsz, nh, t, d = q.shape
        nkv = k.shape[1]
        dv = v.shape[-1]  # the value width (MLA: not the query/key width)
        if self.k0 is None:
            self.k0, self.v0 = k, v
        else:  # the diagonal keys of steps 1..j, stacked: [B, nkv, 1, T, j, d]
            k, v = k[:, :, None, :, None], v[:, :, None, :, None]
            self.dk = k if self.dk is None else torch.cat([self.dk, k], dim=-2)
            self.dv = v if self.dv is None else torch.cat([self.dv, v], dim=-2)
        qg = (q * d**-0.5).reshape(bsz, nkv, nh // nkv, t, d)  # scaled once, before the scores
        parts = [self._window(qg, a, w0, e) for a, w0, e in self.windows]
        o = (parts[0] if len(parts) == 1 else torch.cat(parts, dim=3)).reshape(bsz, nh, t, dv)
        if self.index is None:
            return o.transpose(1, 2).reshape(1, bsz * t, nh, dv).transpose(1, 2)
        out = o[self.index // t, :, self.index % t]  # [N, nh, d]
        return out.transpose(0, 1)[None]


# ---------------------------------------------------------------------------------------------
# The model


class Attention(nn.Module):
    def __init__(self, cfg: DraftConfig):
        super().__init__()
        self.nh, self.nkv, self.hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        width = 2 * cfg.hidden_size
        self.q_proj = nn.Linear(width, self.nh * self.hd, bias=False)
        self.k_proj = nn.Linear(width, self.nkv * self.hd, bias=False)
        self.v_proj = nn.Linear(width, self.nkv * self.hd, bias=False)
        self.o_proj = nn.Linear(self.nh * self.hd, cfg.hidden_size, bias=False)
        self.rotary = Rotary(cfg)

    def forward(self, x, position_ids, cache):
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.nh, self.hd).transpose(1, 2)
        k = self.k_proj(x).view(b, t, self.nkv, self.hd).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.nkv, self.hd).transpose(1, 2)
        q, k = self.rotary(q, k, position_ids)
        out = cache.attend(q, k, v)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, self.nh * self.hd))


class MidLayer(nn.Module):
    def __init__(self, cfg: DraftConfig):
        super().__init__()
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        if cfg.attention == "mla":
            from draftsmith.algorithms.eagle3.mla import MLAAttention

            self.self_attn = MLAAttention(cfg, RMSNorm)
        else:
            self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, embeds, hidden, position_ids, cache):
        residual = hidden
        x = torch.cat([self.input_layernorm(embeds), self.hidden_norm(hidden)], dim=-1)
        residual = self.self_attn(x, position_ids, cache) + residual
        return self.mlp(self.post_attention_layernorm(residual)) + residual


class Eagle3Draft(nn.Module):
    """State-dict names are SGLang's checkpoint names (fc, midlayer.*, norm, lm_head, d2t, t2d)."""

    def __init__(self, cfg: DraftConfig):
        super().__init__()
        self.config = cfg
        self.fc = nn.Linear(cfg.num_aux * cfg.target_hidden_size, cfg.hidden_size, bias=False)
        if cfg.fc_norm:  # EAGLE-3.1: checkpoint names fc_norm.{i}.weight, ones at start
            self.fc_norm = nn.ModuleList(
                RMSNorm(cfg.target_hidden_size, cfg.rms_norm_eps) for _ in range(cfg.num_aux)
            )
        self.midlayer = MidLayer(cfg)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.long))
        self.register_buffer("t2d", torch.zeros(cfg.vocab_size, dtype=torch.bool))

    def set_vocab(self, d2t: torch.Tensor, t2d: torch.Tensor) -> None:
        """Install the vocabulary mapping (d2t offsets [K] int64, t2d [V] bool)."""
        if tuple(d2t.shape) != tuple(self.d2t.shape) or tuple(t2d.shape) != tuple(self.t2d.shape):
            raise ValueError(
                f"vocab mapping shapes d2t {tuple(d2t.shape)}, t2d {tuple(t2d.shape)} do not match "
                f"the draft config (d2t {tuple(self.d2t.shape)}, t2d {tuple(self.t2d.shape)})"
            )
        ids = d2t.long() + torch.arange(d2t.shape[0])
        if not bool(t2d.bool()[ids].all()) or int(t2d.bool().sum()) != d2t.shape[0]:
            raise ValueError("d2t and t2d disagree: t2d must be true exactly at d2t[i] + i")
        self.d2t.copy_(d2t.long())
        self.t2d.copy_(t2d.bool())

    def project(self, aux: torch.Tensor) -> torch.Tensor:
        """Target aux states [B,T,K*H_t] (K aux layer ids, SGLang order) -> step-0 hidden [B,T,H].
        With fc_norm each aux state is RMS-normed by its own norm first."""
        if self.config.fc_norm:
            chunks = aux.chunk(self.config.num_aux, dim=-1)
            aux = torch.cat([norm(c) for norm, c in zip(self.fc_norm, chunks, strict=True)], dim=-1)
        return self.fc(aux)

    def step(self, input_embeds, hidden, position_ids, kv_cache=None) -> torch.Tensor:
        """One draft step. input_embeds: target embedding of the token after each position;
        hidden: project(aux) at step 0, else `feedback` of the previous step's output. Returns
        the pre-norm output [B,T,H], the input of `logits` and of `feedback`."""
        cache = CausalAttention() if kv_cache is None else kv_cache
        return self.midlayer(input_embeds, hidden, position_ids, cache)

    def feedback(self, out: torch.Tensor) -> torch.Tensor:
        """The next draft step's `hidden` from this step's output: `out` itself (EAGLE-3), or
        with norm_output the final norm of it, the state lm_head reads (EAGLE-3.1)."""
        return self.norm(out) if self.config.norm_output else out

    def logits(self, hidden_out: torch.Tensor) -> torch.Tensor:
        """[..., H] -> draft-vocab logits [..., K] (final norm, then lm_head)."""
        return self.lm_head(self.norm(hidden_out))

    def draft_to_target(self, ids: torch.Tensor) -> torch.Tensor:
        """Draft-vocab ids -> target ids (SGLang: hot_token_id = d2t + arange)."""
        return ids + self.d2t[ids]
