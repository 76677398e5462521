"""What every trainer reads: the rows of the shards packed into batches (`pack_batch`), the
teacher's in-vocabulary flags of a shard (`teacher_ok`), and the weighted loss over a
trainer's positions (`weighted_loss`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


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


def weighted_loss(ce: torch.Tensor, counts: torch.Tensor, *, weights: torch.Tensor, scale=1.0):
    """sum_j w_j * ce_j / count_j with the trainer's per-position weights; counts are the
    global (all-process) kept predictions."""
    w = weights.to(ce.device)
    return (w * ce / counts.clamp(min=1)).sum() * scale
