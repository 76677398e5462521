"""Turn-by-turn regeneration: the driver every regeneration engine runs, below both the stage CLI
(`draftsmith.stages.regenerate`) and the engines (`draftsmith.engines`), which import it from here.

EAGLE-3 drafts learn the target's own distribution, so the assistant turns are regenerated with
the target: every user turn is answered again, turn by turn (turn 2 is asked with the regenerated
answer of turn 1 in its history); a conversation ending with a user turn gets its answer appended.

The seam between this driver and a backend is one function:

    generate_fn(prompts: list[list[{"role", "content"}]]) -> list[str | None]  (one per prompt)

A None reply means the prompt is too long to answer: its tokens plus one reply token would not
fit in the limit (the target's positions and `data.max_length`, the longest conversation the
data stage keeps; engines read it from the cfg they are given). That conversation ends with the
turns before; a conversation left without any answer is dropped. Engines cut replies that would
run past the limit. Both are counted in the range's report (`too_long_turns`, `capped_replies`,
`dropped_rows`, `dropped_ids`), never silent.
"""

from __future__ import annotations

from collections.abc import Callable

GenerateFn = Callable[[list[list[dict]]], list[str | None]]


class MissingAnswerError(ValueError):
    """Regeneration is off but a row has a user turn without a source answer."""


def new_stats() -> dict:
    """The counters every regeneration engine keeps (the same report fields for every backend)."""
    return {
        "prompts": 0,
        "new_tokens": 0,
        "prompt_tokens": 0,
        "seconds": 0.0,
        "hit_limit": 0,
        "empty": 0,
        "too_long_turns": 0,
        "capped_replies": 0,
    }


def regenerate(conversations: list[dict], generate_fn: GenerateFn) -> list[dict]:
    """Answer every user turn of every conversation again with `generate_fn`, turn by turn.

    Source assistant turns are discarded; round r asks all conversations that have an r-th user
    turn together, with their regenerated history. Returns new conversation dicts (same id/source).
    A None reply (prompt too long) ends that conversation before the unanswered turn; one left
    without an answer is dropped (see `dropped_ids`).
    """
    history, pending = [], []
    for conv in conversations:
        turns = conv["conversations"]
        system = [t for t in turns[:1] if t["role"] == "system"]
        history.append(list(system))
        pending.append([t for t in turns if t["role"] == "user"])
    rounds = max((len(p) for p in pending), default=0)
    for r in range(rounds):
        active = [i for i, p in enumerate(pending) if len(p) > r]
        prompts = [history[i] + [pending[i][r]] for i in active]
        replies = generate_fn(prompts)
        if len(replies) != len(prompts):
            raise RuntimeError(
                f"generate_fn returned {len(replies)} replies for {len(prompts)} prompts"
            )
        for i, prompt, reply in zip(active, prompts, replies, strict=True):
            if reply is None:
                pending[i] = pending[i][:r]  # no later turn: its history would be longer still
                continue
            history[i] = prompt + [{"role": "assistant", "content": reply}]
    return [
        {"id": conv["id"], "source": conv["source"], "conversations": turns}
        for conv, turns in zip(conversations, history, strict=True)
        if any(t["role"] == "assistant" for t in turns)
    ]


def dropped_ids(conversations: list[dict], regenerated: list[dict]) -> list[str]:
    """Ids of the rows regeneration dropped (not one turn fitted in the length limit)."""
    kept = {c["id"] for c in regenerated}
    return [c["id"] for c in conversations if c["id"] not in kept]


def copy_answers(conversations: list[dict]) -> list[dict]:
    """Regeneration switched off: keep the source answers; every user turn must have one."""
    for conv in conversations:
        if conv["conversations"][-1]["role"] != "assistant":
            raise MissingAnswerError(
                f"regenerate.enabled is false but row {conv['id']!r} of source "
                f"{conv['source']!r} ends with a user turn that has no source answer"
            )
    return [dict(conv) for conv in conversations]
