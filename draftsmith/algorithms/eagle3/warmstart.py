"""`draft.init_layer_from_target`: the EAGLE-3 draft's decoder layer starts as one of the target's.

The source is the target layer right after the deepest captured aux state (aux id d, SGLang's
"output of layer d", so layer d + 1: the layer that reads that state), or the target's last
layer when d is the last. Copied, float32:

    midlayer.self_attn.{q,k,v}_proj   the hidden-state half (columns H..2H: the draft's q/k/v
                                      read cat([input_layernorm(embed), hidden_norm(hidden)]));
                                      the embedding half keeps its seeded random init
    midlayer.self_attn.o_proj         whole
    midlayer.mlp.{gate,up,down}_proj  whole
    midlayer.hidden_norm              the layer's input_layernorm (it norms the residual stream)
    midlayer.post_attention_layernorm the layer's post_attention_layernorm
    fc                                zeros but an identity on the deepest aux state's block, so
                                      step 0's hidden state is that state, the source layer's input

`input_layernorm` (the embedding's norm) keeps its init, as does EAGLE-3.1's fc_norm (ones).
Norm weights are taken as the target applies them (`1 + w` for Gemma-style norms). The exported
checkpoint is the same format: only the starting values change.

Refused (ValueError naming the key and why; the trainer turns it into an error): draft.attention
mla (no q/k/v/o to copy), a source layer without one of the tensors above (a mixture-of-experts
MLP), a layer with norms the draft layer lacks (Gemma-2/3's pre/post feed-forward norms), any
shape that differs from the draft's.
"""

from __future__ import annotations

from pathlib import Path

import torch

from draftsmith.targets.families import effective_norm_weight
from draftsmith.targets.layout import LayoutError, read_layer

KEY = "draft.init_layer_from_target"
# draft parameter (under midlayer.) <- target layer tensor, copied whole
WHOLE = {
    "self_attn.o_proj.weight": "self_attn.o_proj.weight",
    "mlp.gate_proj.weight": "mlp.gate_proj.weight",
    "mlp.up_proj.weight": "mlp.up_proj.weight",
    "mlp.down_proj.weight": "mlp.down_proj.weight",
}
# draft q/k/v (2H inputs) <- target q/k/v (H inputs): the hidden-state half
HALF = ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight")
NORMS = {
    "hidden_norm.weight": "input_layernorm.weight",
    "post_attention_layernorm.weight": "post_attention_layernorm.weight",
}
# norms a layer may have that the draft's Llama layer does not compute
FOREIGN_NORMS = ("pre_feedforward_layernorm.weight", "post_feedforward_layernorm.weight")


def source_layer(aux_ids: list[int], num_layers: int) -> int:
    """The target layer the draft layer starts as: the one after the deepest aux state."""
    return min(max(aux_ids) + 1, num_layers - 1)


def read_source(target_dir: Path, target_cfg: dict, aux_ids: list[int]) -> tuple[int, dict]:
    """(index, tensors by suffix) of the source layer, read from the target's safetensors."""
    index = source_layer(aux_ids, int(target_cfg["num_hidden_layers"]))
    wanted = (*WHOLE.values(), *HALF, *NORMS.values(), *FOREIGN_NORMS)
    try:
        return index, read_layer(target_dir, index, wanted)
    except LayoutError as e:
        raise ValueError(f"{KEY}: {e}") from None


def check(draft, index: int, pieces: dict) -> None:
    """Refuse what cannot be copied as specified (the module doc), naming the key and why."""
    cfg = draft.config
    if cfg.attention != "llama":
        raise ValueError(
            f"{KEY}: draft.attention {cfg.attention} has no q/k/v/o projections to copy; "
            "set draft.attention llama or draft.init_layer_from_target false"
        )
    foreign = [s for s in FOREIGN_NORMS if s in pieces]
    if foreign:
        raise ValueError(
            f"{KEY}: target layer {index} has norms the draft layer does not compute "
            f"({', '.join(foreign)})"
        )
    missing = [s for s in (*WHOLE.values(), *HALF, *NORMS.values()) if s not in pieces]
    if missing:
        raise ValueError(
            f"{KEY}: target layer {index} has no {', '.join(missing)} (a dense Llama-like "
            "layer is needed, e.g. not a mixture-of-experts MLP)"
        )
    params = dict(draft.midlayer.named_parameters())
    hidden = cfg.hidden_size
    for mine, theirs in WHOLE.items():
        want, got = tuple(params[mine].shape), tuple(pieces[theirs].shape)
        if want != got:
            raise ValueError(
                f"{KEY}: target layer {index} {theirs} is {got}, the draft's {mine} is {want}"
            )
    for name in HALF:
        want = (params[name].shape[0], hidden)
        if tuple(pieces[name].shape) != want:
            raise ValueError(
                f"{KEY}: target layer {index} {name} is {tuple(pieces[name].shape)}, the "
                f"hidden-state half of the draft's is {want}"
            )
    if cfg.num_aux * cfg.target_hidden_size != draft.fc.weight.shape[1] or (
        cfg.target_hidden_size != hidden
    ):
        raise ValueError(f"{KEY}: fc is not num_aux x {hidden} -> {hidden}; no pick to start")


def init_layer(draft, index: int, pieces: dict, target_cfg: dict) -> None:
    """Copy the source layer `index` (`pieces`: read_source's) into `draft`, in place."""
    check(draft, index, pieces)
    cfg, hidden = draft.config, draft.config.hidden_size
    params = dict(draft.midlayer.named_parameters())
    deepest = cfg.aux_layer_ids.index(max(cfg.aux_layer_ids))  # the order the shards keep
    with torch.no_grad():
        for mine, theirs in WHOLE.items():
            params[mine].copy_(pieces[theirs].float())
        for name in HALF:
            params[name][:, hidden:].copy_(pieces[name].float())
        for mine, theirs in NORMS.items():
            params[mine].copy_(effective_norm_weight(pieces[theirs], target_cfg))
        draft.fc.weight.zero_()
        block = slice(deepest * hidden, (deepest + 1) * hidden)
        draft.fc.weight[:, block].copy_(torch.eye(hidden))
