"""Training-time test reads the teacher only where a kept prediction needs it
(draftsmith.algorithms.eagle3.ttt.teacher_positions): a teacher of NaN everywhere else gives the
same losses, so computing it only there changes nothing."""

from __future__ import annotations

import torch

from draftsmith.algorithms.batches import pack_batch
from draftsmith.algorithms.eagle3.model import DraftConfig, Eagle3Draft
from draftsmith.algorithms.eagle3.ttt import (
    TTTObjective,
    batch_teacher,
    step_masks,
    teacher_logprobs,
    teacher_positions,
)

STEPS, H = 3, 64


def packs(seed: int = 0) -> list[list[dict]]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for lengths in ((9, 14), (20,)):
        pack = []
        for n in lengths:
            mask = torch.zeros(n, dtype=torch.bool)
            mask[n // 3 :] = True
            pack.append(
                {
                    "input_ids": torch.randint(0, 255, (n,), generator=g),
                    "loss_mask": mask,
                    "ok": torch.rand(n, generator=g) > 0.2,
                    "aux": torch.randn(n, 3 * H, generator=g),
                    "last": torch.randn(n, H, generator=g),
                }
            )
        out.append(pack)
    return out


def test_the_teacher_is_read_only_where_a_kept_prediction_needs_it():
    torch.manual_seed(0)
    cfg = DraftConfig.tiny()
    draft = Eagle3Draft(cfg)
    rows = torch.randn(cfg.draft_vocab_size, H)
    b = pack_batch(packs(), STEPS, 3 * H, H)
    masks = step_masks(b.seg, b.loss_mask, b.ok, STEPS, b.length)
    need = teacher_positions(masks)
    assert 0 < int(need.sum()) < need.numel()
    assert not need[b.seg[:, : b.length] < 0].any()  # never in padding
    full = teacher_logprobs(b.last, rows)
    sparse = batch_teacher(b, rows, torch.zeros(0), need)
    torch.testing.assert_close(sparse[need], full[need], rtol=1e-6, atol=1e-6)
    assert not sparse[~need].any()  # not computed
    poisoned = full.masked_fill(~need[..., None], float("nan"))
    embed = torch.randn(cfg.vocab_size, H)
    embeds = embed[b.ids[:, : b.length + STEPS + 1]]
    obj = TTTObjective(draft, STEPS)
    args = (b.aux, embeds, b.pos, b.seg[:, : b.length], masks)
    ce, correct = obj(*args, full)
    ce_p, correct_p = obj(*args, poisoned)
    assert torch.isfinite(ce).all() and float(correct.sum()) >= 0
    assert torch.equal(ce, ce_p) and torch.equal(correct, correct_p)
