"""EAGLE-3's side of the in-process speculative decoder (its spec's `decoder`): the chain
drafter over the draft's KV cache (draftsmith.bench.specdec runs the target side and the
verification for every algorithm).

    runner(draft, model, aux_ids) -> DraftRunner
"""

from __future__ import annotations

import torch

from draftsmith.algorithms.eagle3.model import KVCache
from draftsmith.algorithms.sampling import Sampler


class DraftRunner:
    """The draft's side of the loop: its KV cache, the positions it holds, its last hidden state.

    `positions` counts the cache entries computed from target features (prompt and accepted
    tokens); the chain's speculative entries beyond it are cropped after each verification.
    """

    def __init__(self, draft, embed, aux_ids: list[int]):
        self.draft = draft
        self.embed = embed  # the target's input embedding (EAGLE-3 shares it)
        self.aux_ids = aux_ids
        self.cache = KVCache()
        self.positions = 0
        self.last_hidden: torch.Tensor | None = None  # [1, 1, H] at position positions - 1
        self._target_ids: torch.Tensor | None = None  # target id of each draft id (sampling)

    def _pos(self, start: int, n: int) -> torch.Tensor:
        return torch.arange(start, start + n, device=self.cache_device).unsqueeze(0)

    @property
    def cache_device(self) -> torch.device:
        return self.draft.fc.weight.device

    def extend(self, next_tokens: list[int], aux: torch.Tensor) -> None:
        """Feed positions [positions, positions+T) with target features.

        next_tokens[t] is the token that follows position positions+t; aux is [T, 3H].
        """
        self.cache.truncate(self.positions)
        n = len(next_tokens)
        emb = self.embed(torch.tensor([next_tokens], device=self.cache_device))
        hidden = self.draft.project(aux.unsqueeze(0).to(emb.dtype))
        out = self.draft.step(emb, hidden, self._pos(self.positions, n), self.cache)
        self.positions += n
        self.last_hidden = out[:, -1:]

    def _token(self, hidden: torch.Tensor) -> int:
        return int(self.draft.draft_to_target(self.draft.logits(hidden)[0, -1].argmax()))

    def propose(self, k: int) -> list[int]:
        """k chain proposals (top-1), each step fed the draft's own previous hidden state."""
        hidden = self.last_hidden
        props = [self._token(hidden)]
        for j in range(k - 1):
            emb = self.embed(torch.tensor([[props[-1]]], device=self.cache_device))
            fed = self.draft.feedback(hidden)  # the pre-norm output, or its norm (EAGLE-3.1)
            hidden = self.draft.step(emb, fed, self._pos(self.positions + j, 1), self.cache)
            props.append(self._token(hidden))
        return props

    def propose_sampled(self, k: int, sampler: Sampler) -> tuple[list[int], torch.Tensor]:
        """k chain proposals, each drawn from the draft's distribution q (after the sampler's
        temperature and top-p); returns them and q [k, V] over the target vocabulary."""
        vocab = int(self.draft.t2d.shape[0])
        if self._target_ids is None:
            draft_ids = torch.arange(self.draft.d2t.shape[0], device=self.cache_device)
            self._target_ids = self.draft.draft_to_target(draft_ids)
        hidden, props, qs = self.last_hidden, [], []
        for j in range(k):
            if j:
                emb = self.embed(torch.tensor([[props[-1]]], device=self.cache_device))
                pos = self._pos(self.positions + j - 1, 1)
                hidden = self.draft.step(emb, hidden, pos, self.cache)
            logits = self.draft.logits(hidden)[0, -1]
            tok, q = sampler.draft_pick(logits, self._target_ids, vocab)
            props.append(tok)
            qs.append(q)
        return props, torch.stack(qs)


def runner(draft, model, aux_ids: list[int]) -> DraftRunner:
    """The chain drafter for an EAGLE-3 draft; `model`: the target, whose input embedding the
    draft shares."""
    return DraftRunner(draft, model.get_input_embeddings(), aux_ids)
