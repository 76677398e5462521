"""Training-time test (TTT): packed batches, the shifted masks, the teacher and the loss.

Alignment (EAGLE-3, as SGLang serves it). Within a row, the draft at position p and step j
(RoPE position p + j) reads the embedding of token x[p+j+1] and is trained toward the target's
distribution at position p+j+1, i.e. its prediction of token x[p+j+2]. So the loss mask of that
prediction is `loss_mask[p+j+2]`: the mask shifts with the inputs and the targets, and the first
assistant token (the one after the assistant header) is a trained prediction. A prediction is
also dropped when the target's argmax at p+j+1 is outside the draft vocabulary, or when
p+j+2 runs past the row.

Teacher: the target's softmax restricted to the draft vocabulary, computed from the stored
post-norm final states through the target's lm_head rows of the draft vocabulary, in chunks
(the full-vocabulary logits exist only chunk by chunk, when the argmax flags are computed).
A shard in storage mode `topk` holds the target's top-k log-probabilities instead: the entries
inside the draft vocabulary, renormalized (draftsmith.hidden.storage.topk_teacher), and the flag is
whether the top-1 id is in the draft vocabulary. With `topk_vocab: draft` it holds the
teacher's own top-k, exact, and the flag itself; the teacher lists k tokens and leaves the rest
of its mass, r = 1 - sum(p), unassigned.

Loss: sum over steps of 0.8**j * (soft cross-entropy summed over step j's kept predictions /
their global count). Accuracy: the draft's argmax equals the teacher's, per step. The soft
cross-entropy of a teacher that leaves mass r > 0 on its unlisted tokens U counts them as one
outcome: -sum_listed p_i log q_i - r log sum_U q_i (the exact cross-entropy between the teacher
and the draft both coarsened to "the listed tokens, each alone, and U"). A teacher that lists
every token, or renormalizes what it lists, has r = 0 (up to rounding: below TAIL_MIN) and the
term is not computed.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from draftsmith.algorithms.batches import Batch
from draftsmith.algorithms.eagle3.model import Eagle3Draft, TTTCache, block_causal_mask
from draftsmith.hidden.storage import topk_teacher

STEP_DECAY = 0.8
TAIL_MIN = 1e-5  # unassigned teacher mass below this is rounding, not a tail


@torch.no_grad()
def teacher_logprobs(
    last: torch.Tensor,
    draft_rows: torch.Tensor,
    chunk: int = 1024,
    need: torch.Tensor | None = None,
):
    """[..., H] post-norm states -> [..., K] fp32 log-softmax over the draft vocabulary rows.
    need: bool [...], the positions whose teacher is read (`teacher_positions`); the others
    are left 0 and are never read."""
    flat = last.reshape(-1, last.shape[-1])
    w = draft_rows.float()
    idx = None if need is None else need.reshape(-1).nonzero().flatten().to(flat.device)
    rows = flat if idx is None else flat[idx]
    got = torch.empty(rows.shape[0], draft_rows.shape[0], dtype=torch.float32, device=w.device)
    for s in range(0, rows.shape[0], chunk):
        got[s : s + chunk] = F.log_softmax(rows[s : s + chunk].float() @ w.T, dim=-1)
    if idx is None:
        out = got
    else:
        out = torch.zeros(flat.shape[0], draft_rows.shape[0], dtype=torch.float32, device=w.device)
        out[idx] = got
    return out.view(*last.shape[:-1], draft_rows.shape[0])


def teacher_positions(masks: torch.Tensor) -> torch.Tensor:
    """[B, L] bool from step_masks' [S, B, L]: the positions whose teacher some kept prediction
    reads (step j at position p reads the teacher at p + j + 1). Where no step reads it (the
    prompt's tokens, a row's end, an argmax outside the draft vocabulary), it is not computed."""
    steps, _, length = masks.shape
    need = torch.zeros(masks.shape[1:], dtype=torch.bool, device=masks.device)
    for j in range(steps):
        if j + 1 < length:
            need[:, j + 1 :] |= masks[j, :, : length - j - 1]
    return need


def step_masks(
    seg: torch.Tensor, loss_mask: torch.Tensor, ok: torch.Tensor, steps: int, length: int
):
    """[steps, B, L] bool: which (step, position) predictions are trained.

    seg, loss_mask, ok are [B, L + steps + 2] (tail-padded with seg -1). Step j at position p
    predicts token p+j+2 of the same row from the teacher at p+j+1.
    """
    base = seg[:, :length]
    out = []
    for j in range(steps):
        same_row = (base >= 0) & (seg[:, j + 2 : j + 2 + length] == base)
        out.append(same_row & loss_mask[:, j + 2 : j + 2 + length] & ok[:, j + 1 : j + 1 + length])
    return torch.stack(out)


@torch.no_grad()
def batch_teacher(
    batch: Batch,
    draft_rows: torch.Tensor,
    draft_index: torch.Tensor,
    need: torch.Tensor | None = None,
):
    """[B, L, K] fp32 teacher log-probs over the draft vocabulary, on draft_rows' device, from
    whichever teacher input the batch holds. draft_index [V]: draft id of each target id or -1.
    From a draft-vocabulary top-k the rows sum to 1 - r (the mass on unlisted tokens). need
    [B, L] bool: from stored final states, only these positions are computed (the others are
    never read; `teacher_positions`)."""
    device = draft_rows.device
    if batch.last is not None:
        return teacher_logprobs(batch.last.to(device), draft_rows, need=need)
    return topk_teacher(
        batch.topk_ids.to(device),
        batch.topk_logprobs.to(device),
        None if batch.topk_draft else draft_index.to(device),
        draft_rows.shape[0],
    )


class TTTObjective(nn.Module):
    """Unrolled draft steps over a packed batch; forward returns per-step sums (for DDP)."""

    def __init__(self, draft: Eagle3Draft, steps: int):
        super().__init__()
        self.draft = draft
        self.steps = steps

    def forward(self, aux, embeds, pos, seg, masks, teacher):
        """aux [B,L,3H_t], embeds [B,L+S+1,H] (target embedding of ids), pos [B,L],
        seg [B,L] row ids, masks [S,B,L] bool, teacher [B,L,K] log-probs.

        Returns (ce [S] summed soft cross-entropy, correct [S] top-1 agreements) of kept
        predictions. Step j >= 1 runs only on positions with a kept prediction at some step
        >= j (compact layout, see TTTCache); the others cannot influence any loss.
        """
        n_batch, length = pos.shape
        flat = masks.reshape(self.steps, n_batch * length)
        later = flat.flip(0).cumsum(0).flip(0) > 0  # a kept prediction at this step or later
        idx = torch.arange(n_batch * length, device=pos.device)
        cache = TTTCache(block_causal_mask(seg))
        hidden = self.draft.project(aux).reshape(1, n_batch * length, -1)
        zero = hidden.sum() * 0  # keeps every step's output in the graph when nothing is kept
        embeds = embeds.reshape(n_batch * (length + self.steps + 1), -1)
        pos = pos.reshape(-1)
        teacher = teacher.reshape(n_batch * length, -1)
        target_p, target_top = teacher.exp(), teacher.argmax(-1)  # once for all steps
        rest = tail_mass(teacher, target_p)
        ce, correct = [], []
        for j in range(self.steps):
            if j > 0:
                keep = later[j][idx]
                idx, hidden = idx[keep], hidden[:, keep]
                cache.select(idx)
            if idx.numel() == 0:
                ce.append(zero)
                correct.append(zero.detach())
                continue
            b = idx // length
            at = idx + b * (self.steps + 1) + j + 1  # row of embeds: token t + j + 1
            out = self.draft.step(embeds[at][None], hidden, (pos[idx] + j)[None], cache)
            kept = flat[j][idx]
            logq = F.log_softmax(self.draft.logits(out[0, kept]).float(), dim=-1)
            src = idx[kept] + j + 1  # the teacher at t + j + 1 (same row, so same pack)
            ce.append(soft_cross_entropy(teacher[src], target_p[src], rest[src], logq))
            correct.append((logq.argmax(-1) == target_top[src]).sum().float())
            hidden = self.draft.feedback(out)  # what the engines feed the next draft step
        return torch.stack(ce), torch.stack(correct)


def tail_mass(teacher: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """[N] the teacher mass on its unlisted (-inf) tokens, 0 where it lists every token or
    what is left is rounding (below TAIL_MIN). teacher [N, K] log-probs, p = teacher.exp()."""
    rest = (1 - p.sum(-1)).clamp(min=0)
    listed_all = torch.isfinite(teacher).all(-1)  # an exact teacher: only rounding is left
    return torch.where((rest > TAIL_MIN) & ~listed_all, rest, torch.zeros_like(rest))


def soft_cross_entropy(
    teacher: torch.Tensor, p: torch.Tensor, rest: torch.Tensor, logq: torch.Tensor
) -> torch.Tensor:
    """Summed soft cross-entropy of draft log-probs logq [N, K] against the teacher [N, K]
    (log-probs, -inf = unlisted; p = its exp, rest = tail_mass): -sum_listed p log q, and where
    rest > 0 also -rest * log(sum of q over the unlisted tokens), the tail as one outcome."""
    loss = -(p * logq).sum()
    tail = (rest > 0).nonzero().flatten()
    if tail.numel():
        unlisted = logq[tail].masked_fill(torch.isfinite(teacher[tail]), float("-inf"))
        loss = loss - (rest[tail] * unlisted.logsumexp(-1)).sum()
    return loss


def step_weights(steps: int) -> torch.Tensor:
    return STEP_DECAY ** torch.arange(steps, dtype=torch.float32)
