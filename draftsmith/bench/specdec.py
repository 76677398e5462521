"""Chain speculative decoding with an EAGLE-3 draft on a transformers target (the `hf` backend).

The engine is what SGLang's EAGLE worker does with top-k 1, in plain PyTorch at batch size 1:

1. The target prefills the prompt with a KV cache and captures the aux hidden states of every
   prompt token (transformers `output_hidden_states[i + 1]` for SGLang id i); its argmax is the
   first generated token.
2. The draft extends its own KV cache over the positions whose target features are known: at
   position p its input is `(embed(token[p + 1]), fc(aux[p]))`, so the output at the last position
   predicts the token after the one the target just produced.
3. The draft proposes `num_steps` tokens autoregressively from its own hidden states
   (pre-norm; post-norm for EAGLE-3.1, `Eagle3Draft.feedback`).
4. The target verifies `[last token, proposals...]` in one forward; the longest prefix of proposals
   equal to the target's argmax is accepted, plus the target's token at the first disagreement
   (the correction). Both caches are cropped back to the accepted positions and the draft is
   extended over them with the target's fresh aux states.

Greedy verification makes the output identical to plain greedy decoding of the target (the test
suite checks it token for token). `greedy_generate` is that baseline, with the same KV-cache
forward, for the speedup figure.

With a `Sampler` (bench.temperature > 0, draftsmith.algorithms.sampling) the same loop samples: the prefill's
token from the target's distribution, the proposals from the draft's (zero outside its
vocabulary), and verification is speculative sampling's rejection rule, so the output is
distributed as plain sampling of the target (`greedy_generate` with the sampler is that
baseline). Without one, nothing changes: the greedy path is the argmax path above.

Counting (the acceptance contract, docs/contracts/acceptance.md): one verification pass emits `accepted + 1` tokens
(fewer when the output hits `max_new_tokens` or a stop token). tau = tokens emitted by
verification passes / verification passes. The first token comes from the prefill, which is not a
verification pass, so it is excluded from tau; SGLang's `completion_tokens / spec_verify_ct`
counts it, `Trace.tau_sglang` reports that figure too.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from draftsmith.algorithms.sampling import Sampler
from draftsmith.bench.figures import acceptance_figures


@dataclass
class Trace:
    """What one speculative generation did, pass by pass."""

    num_steps: int
    prompt_len: int
    tokens: list[int] = field(default_factory=list)  # generated tokens, prefill token first
    accepted: list[int] = field(default_factory=list)  # accepted proposals per pass, 0..num_steps
    emitted: list[int] = field(default_factory=list)  # tokens each pass added to the output

    @property
    def passes(self) -> int:
        return len(self.accepted)

    @property
    def tau(self) -> float:
        """Tokens emitted by verification passes per verification pass."""
        return sum(self.emitted) / self.passes if self.passes else float("nan")

    @property
    def tau_sglang(self) -> float:
        """SGLang's `completion_tokens / spec_verify_ct` (includes the prefill's token)."""
        return len(self.tokens) / self.passes if self.passes else float("nan")


def summarize(traces: list[Trace]) -> dict:
    """Acceptance figures over a set of traces (all with the same num_steps).

    - `tau`: sum(emitted) / sum(passes), pooled over the set.
    - `accept_rate_by_pos[j]`: P(proposal j+1 accepted | proposals 1..j accepted), i.e. accepted
      at position j+1 over passes that reached it (what a per-position draft accuracy measures).
    - `reach_rate_by_pos[j]`: P(accepted length >= j+1) over all passes.
    - `accept_len_hist[a]`: number of passes that accepted exactly `a` proposals, a = 0..K.
    """
    if not traces:
        raise ValueError("summarize() needs at least one trace")
    k = traces[0].num_steps
    if any(t.num_steps != k for t in traces):
        raise ValueError("summarize(): traces mix different num_steps")
    hist = [0] * (k + 1)
    for t in traces:
        for a in t.accepted:
            if not 0 <= a <= k:
                raise ValueError(f"accepted length {a} outside [0, {k}]")
            hist[a] += 1
    emitted = sum(sum(t.emitted) for t in traces)
    generated = sum(len(t.tokens) for t in traces)
    return acceptance_figures(hist, emitted, generated, len(traces))


# --------------------------------------------------------------------------- target side


def stop_ids(model, tokenizer) -> set[int]:
    """End-of-generation tokens: the tokenizer's eos, the generation config's, and `<|im_end|>`."""
    ids: set[int] = set()
    for value in (tokenizer.eos_token_id, getattr(model.generation_config, "eos_token_id", None)):
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, (list, tuple)):
            ids.update(int(v) for v in value)
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    if isinstance(im_end, int) and im_end != tokenizer.unk_token_id:
        ids.add(im_end)
    if not ids:
        raise ValueError("the tokenizer and generation config define no eos token")
    return ids


def prompt_ids(tokenizer, messages: list[dict]) -> list[int]:
    """Chat-template the messages with a generation prompt and tokenize (no added specials)."""
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def target_forward(model, ids: torch.Tensor, cache, aux_ids: list[int] | None, last_only: bool):
    """One cached target forward. Returns (logits [T or 1, V], aux [T, 3H] or None)."""
    out = model(
        input_ids=ids,
        past_key_values=cache,
        use_cache=True,
        output_hidden_states=aux_ids is not None,
        logits_to_keep=1 if last_only else 0,
    )
    aux = None
    if aux_ids is not None:
        aux = torch.cat([out.hidden_states[i + 1][0] for i in aux_ids], dim=-1)
    return out.logits[0], aux


def _append(out: list[int], new: list[int], stops: set[int], max_new: int) -> int:
    """Append tokens up to max_new or the first stop token; return how many were added."""
    n = 0
    for tok in new:
        if len(out) >= max_new or (out and out[-1] in stops):
            break
        out.append(tok)
        n += 1
    return n


def _done(out: list[int], stops: set[int], max_new: int) -> bool:
    return len(out) >= max_new or (bool(out) and out[-1] in stops)


def _next(logits: torch.Tensor, sampler: Sampler | None) -> int:
    """The target's next token from its logits [V]: argmax, or a sample with `sampler`."""
    return int(logits.argmax()) if sampler is None else sampler.sample(sampler.probs(logits))


@torch.inference_mode()
def greedy_generate(
    model, ids: list[int], max_new: int, stops: set[int], sampler: Sampler | None = None
) -> list[int]:
    """Plain decoding with a KV cache, one target forward per token (the baseline): greedy, or
    sampled with `sampler`."""
    from transformers import DynamicCache

    device = model.device
    cache = DynamicCache()
    x = torch.tensor([ids], device=device)
    out: list[int] = []
    while True:
        logits, _ = target_forward(model, x, cache, None, last_only=True)
        out.append(_next(logits[-1], sampler))
        if _done(out, stops, max_new):
            return out
        x = torch.tensor([[out[-1]]], device=device)


# --------------------------------------------------------------------------- draft side


def draft_runner(draft, model, aux_ids: list[int], spec=None):
    """The draft's side of the loop: its algorithm's decoder (the spec's `decoder`); `spec` as
    the caller resolved it (the bench stage opens the draft once), else the one its config
    names."""
    if spec is None:
        from draftsmith import algorithms

        spec = algorithms.of_draft(draft.config)
    return spec.part("decoder").runner(draft, model, aux_ids)


@torch.inference_mode()
def speculative_generate(
    model,
    draft,
    ids: list[int],
    max_new: int,
    stops: set[int],
    num_steps: int,
    aux_ids: list[int],
    sampler: Sampler | None = None,
    spec=None,
) -> Trace:
    """Chain speculative decoding (greedy verification, lossless; speculative sampling with
    `sampler`); returns the trace. `spec`: the draft's algorithm (`draft_runner`)."""
    from transformers import DynamicCache

    if num_steps < 1:
        raise ValueError(f"bench.num_steps must be >= 1, got {num_steps}")
    device = model.device
    trace = Trace(num_steps=num_steps, prompt_len=len(ids))
    cache = DynamicCache()
    logits, aux = target_forward(model, torch.tensor([ids], device=device), cache, aux_ids, True)
    out = trace.tokens
    out.append(_next(logits[-1], sampler))
    runner = draft_runner(draft, model, aux_ids, spec)
    if sampler is not None and not hasattr(runner, "propose_sampled"):
        raise ValueError(
            f"bench.temperature > 0: speculative sampling is not implemented for a "
            f"{draft.config.algorithm} draft (greedy only)"
        )
    runner.extend(ids[1:] + [out[-1]], aux)
    while not _done(out, stops, max_new):
        if sampler is None:
            props = runner.propose(num_steps)
        else:
            props, q = runner.propose_sampled(num_steps, sampler)
        verify = torch.tensor([[out[-1]] + props], device=device)
        logits, aux = target_forward(model, verify, cache, aux_ids, last_only=False)
        if sampler is None:
            best = logits.argmax(dim=-1).tolist()  # best[j]: the target's token after verify[j]
            a = 0
            while a < num_steps and props[a] == best[a]:
                a += 1
            new = props[:a] + [best[a]]
        else:
            a, new = sampler.verify(logits, q, props)
        cache.crop(-(num_steps - a))  # keep [last token, accepted proposals]
        trace.accepted.append(a)
        trace.emitted.append(_append(out, new, stops, max_new))
        if not _done(out, stops, max_new):
            runner.extend(new, aux[: a + 1])
    return trace
