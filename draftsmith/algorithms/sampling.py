"""Speculative sampling (bench.temperature > 0 in the hf engine): the standard rejection rule.

Leviathan et al. 2023 / Chen et al. 2023. With p the target's distribution and q the draft's at
a position, both after temperature and top-p (`warp`), a proposal x drawn from q is accepted with
probability min(1, p(x) / q(x)); at the first rejection the token is drawn from the residual
norm(max(0, p - q)); when all K proposals are accepted the bonus token is drawn from the target's
next distribution. The emitted tokens are then distributed exactly as sampling from p one token
at a time (tests/test_sampling.py checks it with a chi-square test). The draft's vocabulary is a
subset of the target's (draftsmith.data.vocab): q is zero outside it, so those tokens are never
proposed and come only from the residual.

Greedy (temperature 0) never comes here: specdec keeps its argmax path bit for bit.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def warp(logits: torch.Tensor, temperature: float, top_p: float = 1.0) -> torch.Tensor:
    """Probabilities [..., V] (float32) of logits [..., V] after temperature, then top-p.

    Top-p keeps the smallest set of most probable tokens whose mass reaches top_p (the most
    probable token always; ties broken by the sort's order), renormalised.
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0 to sample, got {temperature}")
    if not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    if top_p >= 1:
        return probs
    sorted_p, order = probs.sort(dim=-1, descending=True)
    before = sorted_p.cumsum(dim=-1) - sorted_p  # mass of the more probable tokens
    sorted_p = sorted_p.masked_fill(before >= top_p, 0.0)
    kept = torch.zeros_like(probs).scatter(-1, order, sorted_p)
    return kept / kept.sum(dim=-1, keepdim=True)


def accept_mask(px: torch.Tensor, qx: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Accept a proposal with probability min(1, p(x)/q(x)): u ~ U[0, 1) against the ratio.

    u * q < p is the same test without a division (q(x) > 0 for a token drawn from q; where
    p(x) >= q(x) it always holds)."""
    return u * qx < px


def residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """norm(max(0, p - q)) over the last dimension, p itself where p <= q everywhere (then no
    rejection can happen: the row is never sampled, but stays a distribution)."""
    r = (p - q).clamp_min(0.0)
    total = r.sum(dim=-1, keepdim=True)
    return torch.where(total > 0, r / total.clamp_min(torch.finfo(r.dtype).tiny), p)


def verify(
    p: torch.Tensor, q: torch.Tensor, props: torch.Tensor, generator: torch.Generator | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Speculative sampling's verification of B chains of K proposals.

    p [B, K+1, V]: the target's distributions after each verified token (row j predicts the
    token after proposal j; row K is the bonus position); q [B, K, V]: the draft's at each
    proposal, over the target vocabulary; props [B, K]: the proposals (drawn from q).
    Returns (accepted [B] in 0..K, tokens [B, K+1]): tokens[b, :a] are the accepted proposals and
    tokens[b, a] the residual's (or, at a = K, the bonus) sample; entries after a are -1.
    """
    b, k = props.shape
    px = p[:, :k].gather(-1, props.unsqueeze(-1)).squeeze(-1)
    qx = q.gather(-1, props.unsqueeze(-1)).squeeze(-1)
    u = torch.rand(b, k, generator=generator, device=p.device, dtype=p.dtype)
    ok = accept_mask(px, qx, u)
    accepted = ok.long().cumprod(dim=-1).sum(dim=-1)  # leading accepted proposals
    # the distribution of the token at position a: the residual at a rejection, p at a = K
    rows = torch.cat([residual(p[:, :k], q), p[:, k:]], dim=1)
    pick = rows.gather(1, accepted.view(b, 1, 1).expand(b, 1, p.shape[-1])).squeeze(1)
    extra = torch.multinomial(pick, 1, generator=generator).squeeze(-1)
    pos = torch.arange(k + 1, device=p.device).unsqueeze(0)
    padded = torch.cat([props, props.new_full((b, 1), -1)], dim=1)
    tokens = torch.where(pos < accepted.unsqueeze(1), padded, -1)
    tokens = torch.where(pos == accepted.unsqueeze(1), extra.unsqueeze(1), tokens)
    return accepted, tokens


@dataclass
class Sampler:
    """bench.temperature / bench.top_p with a seeded generator on the model's device."""

    temperature: float
    top_p: float
    generator: torch.Generator

    @classmethod
    def make(cls, temperature: float, top_p: float, seed: int, device) -> Sampler:
        gen = torch.Generator(device=torch.device(device))
        gen.manual_seed(int(seed))
        return cls(float(temperature), float(top_p), gen)

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        return warp(logits, self.temperature, self.top_p)

    def sample(self, probs: torch.Tensor) -> int:
        """One token from a distribution [V]."""
        return int(torch.multinomial(probs, 1, generator=self.generator))

    def draft_pick(self, logits: torch.Tensor, target_ids: torch.Tensor, vocab: int):
        """(target id, q over the target vocabulary [V]) from the draft's logits [Vd], whose
        token i is target token target_ids[i]; q is zero outside the draft vocabulary."""
        qd = self.probs(logits)
        q = qd.new_zeros(vocab).scatter(0, target_ids, qd)
        return int(target_ids[self.sample(qd)]), q

    def verify(self, logits: torch.Tensor, q: torch.Tensor, props: list[int]):
        """(accepted, new tokens) of one chain: logits [K+1, V] the target's verification
        forward, q [K, V], props the K proposals."""
        p = self.probs(logits)
        ids = torch.tensor([props], device=p.device)
        a, tokens = verify(p.unsqueeze(0), q.unsqueeze(0).to(p.dtype), ids, self.generator)
        a = int(a[0])
        return a, tokens[0, : a + 1].tolist()
