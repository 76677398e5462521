"""EAGLE-3's trainer (its spec's `trainer`): the draft built from the target's shapes, the
training-time-test objective (draftsmith.algorithms.eagle3.ttt) and one packed batch's losses.

The training loop (draftsmith.train.loop) calls these three for every algorithm:

    build_draft(job, inputs) -> draft         seeded by the loop; not yet on the device
    objective(draft, job, inputs, device)     the module DDP wraps
    losses(s, b, aux, gen) -> (ce, correct, counts, weights)
        s: the loop's Step (model, draft, embed, draft_rows, draft_index, autocast, device);
        b: the packed batch (draftsmith.algorithms.batches.pack_batch); counts of this process (the loop sums them over
        the ranks); weights: the loss weight of each position (EAGLE-3: 0.8**j per step).
"""

from __future__ import annotations

import torch

from draftsmith.algorithms.eagle3.model import DraftConfig, Eagle3Draft
from draftsmith.algorithms.eagle3.ttt import (
    TTTObjective,
    batch_teacher,
    step_masks,
    step_weights,
    teacher_positions,
)
from draftsmith.algorithms.eagle3.warmstart import init_layer, read_source
from draftsmith.targets.families import effective_norm_weight


def build_draft(job, inputs) -> Eagle3Draft:
    """The EAGLE-3 draft for the target (lm_head and norm from the target's with
    draft.init_from_target, the decoder layer from one of the target's with
    draft.init_layer_from_target, draftsmith.algorithms.eagle3.warmstart); `inputs.algorithm`,
    the spec, sets the switches (EAGLE-3.1's)."""
    try:
        dcfg = DraftConfig.from_target_config(
            inputs.target_cfg,
            job.draft.vocab_size,
            inputs.aux_ids,
            attention=job.draft.attention,
            spec=inputs.algorithm,
        )
    except ValueError as e:  # e.g. draft.attention mla for a target without MLA fields
        raise SystemExit(f"error: {e}") from None
    draft = Eagle3Draft(dcfg)
    draft.set_vocab(inputs.d2t, inputs.t2d)
    hot = inputs.d2t + torch.arange(inputs.d2t.shape[0])
    if job.draft.init_from_target:
        with torch.no_grad():
            draft.lm_head.weight.copy_(inputs.heads["lm_head"][hot])
            # a Gemma-style target applies its norm as 1 + w; the draft's norm is x * w
            draft.norm.weight.copy_(effective_norm_weight(inputs.heads["norm"], inputs.target_cfg))
    if job.draft.init_layer_from_target:
        try:
            index, pieces = read_source(inputs.target_dir, inputs.target_cfg, inputs.aux_ids)
            init_layer(draft, index, pieces, inputs.target_cfg)
        except ValueError as e:
            raise SystemExit(f"error: {e}") from None
    return draft


def objective(draft: Eagle3Draft, job, inputs, device) -> TTTObjective:
    return TTTObjective(draft, job.train.ttt_steps)


def losses(s, b, aux: torch.Tensor, gen: torch.Generator):
    """Soft cross-entropy against the target's distribution at each of the unrolled steps."""
    obj = s.model.module if hasattr(s.model, "module") else s.model
    steps = obj.steps
    masks = step_masks(b.seg, b.loss_mask, b.ok, steps, b.length).to(s.device)
    counts = masks.sum(dim=(1, 2)).float()
    teacher = batch_teacher(b, s.draft_rows, s.draft_index, teacher_positions(masks))
    embeds = s.embed[b.ids[:, : b.length + steps + 1].to(s.device)]
    with s.autocast:
        ce, correct = s.model(
            aux.to(s.device), embeds, b.pos.to(s.device), b.seg[:, : b.length].to(s.device),
            masks, teacher,
        )  # fmt: skip
    return ce, correct, counts, step_weights(steps)
