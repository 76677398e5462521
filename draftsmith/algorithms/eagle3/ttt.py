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

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from draftsmith.algorithms.eagle3.model import Eagle3Draft, TTTCache, block_causal_mask
from draftsmith.hidden.storage import topk_teacher

STEP_DECAY = 0.8
TAIL_MIN = 1e-5  # unassigned teacher mass below this is rounding, not a tail


@torch.no_grad()
def teacher_argmax_in_vocab(
    last: torch.Tensor,
    lm_head: torch.Tensor,
    t2d: torch.Tensor,
    need: torch.Tensor,
    chunk: int = 512,
) -> torch.Tensor:
    """[N] bool: the target's full-vocabulary argmax at each needed token is in the draft vocab.

    last [N, H] (any float dtype, may be memory-mapped, on CPU), lm_head [V, H] on the compute
    device, t2d [V] and need [N] bool on CPU. Only [chunk, V] logits exist at a time.
    """
    ok = torch.zeros(last.shape[0], dtype=torch.bool)
    idx = need.nonzero().flatten()
    w = lm_head.float()  # its device is where the logits are computed
    for s in range(0, idx.numel(), chunk):
        sel = idx[s : s + chunk]
        top = (last[sel].to(w.device).float() @ w.T).argmax(-1)
        ok[sel] = t2d[top.cpu()]
    return ok


@torch.no_grad()
def teacher_ok(
    shard, lm_head: torch.Tensor, t2d: torch.Tensor, all_positions: bool = False
) -> torch.Tensor:
    """[T] bool for a shard in any storage mode: at each trained position, the target's
    full-vocabulary argmax is in the draft vocabulary (False at untrained positions).

    all_positions: at every position (train.loss_positions all; storage mode states only, the
    only one that keeps the final state of untrained positions)."""
    final = shard.storage.final
    if final == "states":
        need = torch.ones(shard.n_tokens, dtype=torch.bool) if all_positions else shard.trained
        return teacher_argmax_in_vocab(shard.last_hidden_states, lm_head, t2d, need)
    if all_positions:
        raise ValueError(
            f"{getattr(shard, 'path', 'shard')}: storage final {final!r} keeps no teacher at "
            "untrained positions; train.loss_positions all needs capture.storage.final states"
        )
    ok = torch.zeros(shard.n_tokens, dtype=torch.bool)
    rel, s0, s1 = shard.compact(0, shard.n_tokens)
    if final == "trained":
        every = torch.ones(s1 - s0, dtype=torch.bool)
        ok[rel] = teacher_argmax_in_vocab(shard.last_hidden_states, lm_head, t2d, every)
    elif shard.storage.draft_topk:
        ok[rel] = shard.teacher_in_vocab[s0:s1].bool()
    else:
        ids = shard.teacher_topk_ids.long()
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= t2d.shape[0]):
            raise ValueError(
                f"{getattr(shard, 'path', 'shard')}: top-k ids outside [0, {t2d.shape[0]}): "
                "corrupt shard or another target (python -m draftsmith shards verify)"
            )
        ok[rel] = t2d[ids[s0:s1, 0]]
    return ok


@torch.no_grad()
def teacher_logprobs(last: torch.Tensor, draft_rows: torch.Tensor, chunk: int = 1024):
    """[..., H] post-norm states -> [..., K] fp32 log-softmax over the draft vocabulary rows."""
    flat = last.reshape(-1, last.shape[-1])
    out = torch.empty(flat.shape[0], draft_rows.shape[0], dtype=torch.float32)
    w = draft_rows.float()
    for s in range(0, flat.shape[0], chunk):
        out[s : s + chunk] = F.log_softmax(flat[s : s + chunk].float() @ w.T, dim=-1)
    return out.view(*last.shape[:-1], draft_rows.shape[0])


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


@dataclass
class Batch:
    """One process's share of an optimizer step: packs of rows, [B, L] (+ tail padding)."""

    aux: torch.Tensor  # [B, L, 3H_t] float32
    last: torch.Tensor | None  # [B, L, H_t] stored dtype (storage final states / trained)
    topk_ids: torch.Tensor | None  # [B, L, k] target (or draft) ids, -1 = none (final topk)
    topk_logprobs: torch.Tensor | None  # [B, L, k] float32, -inf = none
    ids: torch.Tensor  # [B, L + S + 2] int64 (0 in padding)
    seg: torch.Tensor  # [B, L + S + 2] row number within the pack, -1 = padding
    pos: torch.Tensor  # [B, L] position within the row
    loss_mask: torch.Tensor  # [B, L + S + 2] bool
    ok: torch.Tensor  # [B, L + S + 2] bool (teacher argmax in the draft vocab)
    tokens: int  # real tokens in the batch
    topk_draft: bool = False  # topk_ids are draft ids, log-probs exact (topk_vocab draft)

    @property
    def length(self) -> int:
        return self.pos.shape[1]


def pack_batch(packs: list[list[dict]], steps: int, aux_width: int, hidden: int) -> Batch:
    """packs: per pack, rows as dicts of 1-d/2-d tensors (input_ids, loss_mask, ok, aux, and
    the teacher input `Shard.teacher` gives: last, or topk_ids + topk_logprobs).

    An empty `packs` gives one all-padding pack (a process with no share still joins the step).
    """
    packs = packs or [[]]
    length = max(1, max(sum(r["input_ids"].numel() for r in p) for p in packs))
    b, tail = len(packs), length + steps + 2
    first = next((r for p in packs for r in p), {"last": torch.zeros(0, hidden)})
    draft_topk = "draft_topk_ids" in first
    ids_key = "draft_topk_ids" if draft_topk else "topk_ids"
    k = first[ids_key].shape[1] if ids_key in first else 0
    batch = Batch(
        aux=torch.zeros(b, length, aux_width),
        last=torch.zeros(b, length, hidden, dtype=first["last"].dtype) if not k else None,
        topk_ids=torch.full((b, length, k), -1, dtype=torch.long) if k else None,
        topk_logprobs=torch.full((b, length, k), float("-inf")) if k else None,
        ids=torch.zeros(b, tail, dtype=torch.long),
        seg=torch.full((b, tail), -1, dtype=torch.long),
        pos=torch.zeros(b, length, dtype=torch.long),
        loss_mask=torch.zeros(b, tail, dtype=torch.bool),
        ok=torch.zeros(b, tail, dtype=torch.bool),
        tokens=0,
        topk_draft=draft_topk,
    )
    for i, pack in enumerate(packs):
        at = 0
        for r, row in enumerate(pack):
            n = row["input_ids"].numel()
            sl = slice(at, at + n)
            batch.aux[i, sl] = row["aux"].float()
            if k:
                batch.topk_ids[i, sl] = row[ids_key]
                batch.topk_logprobs[i, sl] = row["topk_logprobs"]
            else:
                batch.last[i, sl] = row["last"]
            batch.ids[i, sl] = row["input_ids"]
            batch.seg[i, sl] = r
            batch.pos[i, sl] = torch.arange(n)
            batch.loss_mask[i, sl] = row["loss_mask"].bool()
            batch.ok[i, sl] = row["ok"]
            at += n
        batch.tokens += at
    return batch


@torch.no_grad()
def batch_teacher(batch: Batch, draft_rows: torch.Tensor, draft_index: torch.Tensor):
    """[B, L, K] fp32 teacher log-probs over the draft vocabulary, on draft_rows' device, from
    whichever teacher input the batch holds. draft_index [V]: draft id of each target id or -1.
    From a draft-vocabulary top-k the rows sum to 1 - r (the mass on unlisted tokens)."""
    device = draft_rows.device
    if batch.last is not None:
        return teacher_logprobs(batch.last.to(device), draft_rows)
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


def weighted_loss(ce: torch.Tensor, counts: torch.Tensor, scale: float = 1.0, weights=None):
    """sum_j w_j * ce_j / count_j, w_j = 0.8**j unless `weights` are given (an algorithm's own);
    counts are the global (all-process) kept predictions."""
    w = (step_weights(ce.shape[0]) if weights is None else weights).to(ce.device)
    return (w * ce / counts.clamp(min=1)).sum() * scale
