"""DFlash's objective: blocks at random anchors, plain token labels, decaying slot weights.

Per pack of rows (draftsmith.algorithms.batches.pack_batch, the same batches and shards as EAGLE-3), up to
`draft.dflash.anchors` anchor positions a are drawn at random (seeded per step and process)
among the positions whose next token is trained (loss mask) in the same row. The block at a is
what decoding builds after the target accepted token a: slot 0 holds token x[a], slots
k = 1..B-1 the mask token, at row positions a..a+B-1; its context is the aux states of the
positions before a in the same row (the target's features of the tokens it has seen). Slot k is
trained toward the token x[a+k] (cross-entropy through the target's frozen lm_head over the full
vocabulary), kept where a+k is in the same row and trained. One forward holds every block of a
pack: queries are all the blocks' slots, keys the pack's context followed by the slots, with
the visibility rule of `block_visibility`.

Loss: sum over k of w_k * (summed cross-entropy of slot k / its global count), w_k =
exp(-(k-1)/gamma) (`draft.dflash.decay`, DFlash's position decay). No teacher logits and no
final state are read: the shards' teacher part goes unused.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from draftsmith.algorithms.dflash.model import DFlashConfig, DFlashDraft

if TYPE_CHECKING:
    from draftsmith.config.settings import JobSettings


def build_draft(job: JobSettings, inputs) -> DFlashDraft:
    """The draft for the target of `inputs` (draftsmith.train.data.Inputs): block size
    train.ttt_steps + 1, the configured aux layer ids (capture.aux_layer_ids)."""
    d = job.draft.dflash
    dcfg = DFlashConfig.from_target_config(
        inputs.target_cfg,
        inputs.aux_ids,
        layers=d.layers,
        block_size=job.train.ttt_steps + 1,
        mask_token_id=d.mask_token_id,
    )
    draft = DFlashDraft(dcfg)
    if job.draft.init_from_target:
        with torch.no_grad():  # the target's final norm, as it applies it, before its lm_head
            from draftsmith.targets.families import effective_norm_weight

            draft.norm.weight.copy_(effective_norm_weight(inputs.heads["norm"], inputs.target_cfg))
    return draft


def draw_anchors(b, n: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """[P, A] anchor indices into each pack and [P, A] bool (a real anchor), A <= n."""
    length = b.length
    seg, lm = b.seg, b.loss_mask
    ok = (
        (seg[:, :length] >= 0) & (seg[:, 1 : length + 1] == seg[:, :length]) & lm[:, 1 : length + 1]
    )
    picks = []
    for row in ok:
        cand = row.nonzero().flatten()
        order = torch.randperm(cand.numel(), generator=gen)[:n]
        picks.append(cand[order].sort().values)
    width = max(1, max(p.numel() for p in picks))
    anchors = torch.zeros(len(picks), width, dtype=torch.long)
    real = torch.zeros(len(picks), width, dtype=torch.bool)
    for i, p in enumerate(picks):
        anchors[i, : p.numel()], real[i, : p.numel()] = p, True
    return anchors, real


def block_visibility(seg: torch.Tensor, anchors: torch.Tensor, block: int) -> torch.Tensor:
    """[P, A*B, L + A*B] bool: slot (i, k) sees context position p iff p < anchors[i] in the
    same row, and every slot of block i (block-bidirectional); nothing of other blocks."""
    p, length = seg.shape[0], seg.shape[1]
    a = anchors.shape[1]
    ar = torch.arange(length)
    seg_a = seg.gather(1, anchors)  # [P, A]
    ctx = (ar[None, None] < anchors[..., None]) & (seg[:, None, :] == seg_a[..., None])
    ctx = ctx.repeat_interleave(block, dim=1)  # [P, A*B, L]
    blk = torch.eye(a, dtype=torch.bool).repeat_interleave(block, 0).repeat_interleave(block, 1)
    return torch.cat([ctx, blk[None].expand(p, -1, -1)], dim=-1)


class DFlashObjective(nn.Module):
    """The draft plus the target's frozen embedding and lm_head (buffers, never saved with the
    draft); forward returns per-slot sums (ce, correct) for k = 1..B-1 (for DDP)."""

    def __init__(self, draft: DFlashDraft, embed, lm_head, anchors: int = 32, decay: float = 7.0):
        super().__init__()
        self.draft = draft
        self.anchors, self.decay = anchors, decay
        self.register_buffer("embed", embed, persistent=False)
        self.register_buffer("lm_head", lm_head, persistent=False)

    def forward(self, aux, pos, slot_ids, slot_pos, visible, labels, kept):
        """aux [P,L,n*H_t], pos [P,L] row positions, slot_ids / slot_pos [P,A,B],
        visible [P,A*B,L+A*B], labels / kept [P,A,B] (slot 0 never kept)."""
        p, a, block = slot_ids.shape
        ctx_kv = self.draft.context_kv(self.draft.context(aux), pos)
        out = self.draft(
            self.embed[slot_ids.reshape(p, a * block)],
            slot_pos.reshape(p, a * block),
            ctx_kv,
            visible,
        ).view(p, a, block, -1)
        zero = out.sum() * 0  # keeps the graph whole when nothing is kept
        ce, correct = [], []
        for k in range(1, block):
            sel = kept[:, :, k]
            if not bool(sel.any()):
                ce.append(zero)
                correct.append(zero.detach())
                continue
            logits = (out[:, :, k][sel] @ self.lm_head.T).float()
            ce.append(F.cross_entropy(logits, labels[:, :, k][sel], reduction="sum"))
            correct.append((logits.argmax(-1) == labels[:, :, k][sel]).sum().float())
        return torch.stack(ce), torch.stack(correct)


def objective(draft: DFlashDraft, job: JobSettings, inputs, device) -> DFlashObjective:
    heads, d = inputs.heads, job.draft.dflash
    embed, lm_head = heads["embed"].to(device), heads["lm_head"].to(device)
    return DFlashObjective(draft, embed, lm_head, d.anchors, d.decay)


def batch_losses(model, b, aux: torch.Tensor, gen: torch.Generator, device):
    """(ce, correct, counts of this process, loss weights), each [B-1], for packed batch `b`;
    `model` is the DFlashObjective (or its DDP wrapper)."""
    obj = model.module if hasattr(model, "module") else model
    block, mask_id = obj.draft.config.block_size, obj.draft.config.mask_token_id
    anchors, real = draw_anchors(b, obj.anchors, gen)
    k = torch.arange(block)
    at = anchors[..., None] + k  # [P, A, B] index into the pack (the tail padding covers it)
    if at.max() >= b.ids.shape[1]:
        raise ValueError(f"block size {block} exceeds the packed tail (train.ttt_steps + 1)")
    tokens = b.ids.gather(1, at.flatten(1)).view(at.shape)
    same = b.seg.gather(1, at.flatten(1)).view(at.shape) == b.seg.gather(1, anchors)[..., None]
    kept = same & b.loss_mask.gather(1, at.flatten(1)).view(at.shape) & real[..., None]
    kept[..., 0] = False
    slot_ids = torch.where(k == 0, tokens, torch.full_like(tokens, mask_id))
    slot_pos = b.pos.gather(1, anchors)[..., None] + k
    visible = block_visibility(b.seg[:, : b.length], anchors, block)
    ce, correct = model(
        aux.to(device),
        b.pos.to(device),
        slot_ids.to(device),
        slot_pos.to(device),
        visible.to(device),
        tokens.to(device),
        kept.to(device),
    )
    counts = kept[..., 1:].sum(dim=(0, 1)).float().to(device)
    weights = torch.exp(-torch.arange(block - 1, dtype=torch.float32) / obj.decay)
    return ce, correct, counts, weights


def losses(s, b, aux: torch.Tensor, gen: torch.Generator):
    """The trainer's `losses` (draftsmith.algorithms.eagle3.train describes the three
    functions): batch_losses under the loop's autocast."""
    with s.autocast:
        return batch_losses(s.model, b, aux, gen, s.device)
