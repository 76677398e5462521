"""The DFlash draft's side of our chain speculative decoding (draftsmith.bench.specdec).

Same interface as EAGLE-3's `DraftRunner` (draftsmith.algorithms.eagle3.decode), so the target side, the greedy verification (the
longest prefix of proposals equal to the target's argmax, plus its token at the first
disagreement: lossless) and the counting of tau are the EAGLE-3 path's, unchanged:

- `extend(next_tokens, aux)`: the target's aux states of the positions it has just computed
  (prompt, or the verified [last token, accepted proposals]) join the context; each layer's
  context K/V for them is computed once and kept (the context never holds speculative tokens,
  so nothing is ever cropped). The last of `next_tokens` is the token after the context: the
  known first slot of the next block.
- `propose(k)`: one forward over the block [known token, k masks] at the positions right after
  the context (k <= block_size - 1), each slot seeing the whole context and the whole block;
  slot j's argmax through the target's lm_head is proposal j.
"""

from __future__ import annotations

import torch


class DFlashRunner:
    def __init__(self, draft, embed, lm_head):
        self.draft = draft
        self.embed = embed  # the target's input embedding module (shared)
        self.lm_head = lm_head  # the target's output embedding module (shared)
        self.kv: list | None = None  # per layer (K, V) [1, nkv, C, d]
        self.positions = 0  # context length C
        self.token: int | None = None  # the known token at position C

    @property
    def device(self) -> torch.device:
        return self.draft.fc.weight.device

    def extend(self, next_tokens: list[int], aux: torch.Tensor) -> None:
        n = aux.shape[0]
        ctx = self.draft.context(aux[None].to(self.device, self.draft.fc.weight.dtype))
        pos = torch.arange(self.positions, self.positions + n, device=self.device)[None]
        new = self.draft.context_kv(ctx, pos)
        if self.kv is None:
            self.kv = new
        else:
            self.kv = [
                (torch.cat([k, nk], dim=2), torch.cat([v, nv], dim=2))
                for (k, v), (nk, nv) in zip(self.kv, new, strict=True)
            ]
        self.positions += n
        self.token = next_tokens[-1]

    def propose(self, k: int) -> list[int]:
        block = self.draft.config.block_size
        if not 1 <= k <= block - 1:
            raise ValueError(
                f"a DFlash draft of block size {block} proposes 1..{block - 1}, not {k}"
            )
        ids, pos = self.draft.block_inputs(self.token, self.positions, k + 1, self.device)
        out = self.draft(self.embed(ids), pos, self.kv)
        return self.lm_head(out[0, 1:]).argmax(-1).tolist()


def runner(draft, model, aux_ids: list[int]) -> DFlashRunner:
    """The in-process decoder's side for a DFlash draft (its spec's `decoder`): the target's
    embedding and lm_head shared; the aux ids are the draft's own (its config)."""
    return DFlashRunner(draft, model.get_input_embeddings(), model.get_output_embeddings())
