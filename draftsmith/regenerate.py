"""Regeneration: the target rewrites the assistant turns of one row range.

EAGLE-3 drafts learn the target's own distribution, so the assistant turns are regenerated with
the target: every user turn is answered again, turn by turn (turn 2 is asked with the regenerated
answer of turn 1 in its history); a conversation ending with a user turn gets its answer appended.

The seam between the workflow and a backend is one function:

    generate_fn(prompts: list[list[{"role", "content"}]]) -> list[str]   (one reply per prompt)

`regenerate(conversations, generate_fn)` drives it; `HFGenerator` is the transformers backend
(batched, left-padded, KV cache, greedy by default, stops each row at its end-of-turn token).
An SGLang backend only has to provide another `generate_fn`.

CLI (rule regenerate): `python -m draftsmith.regenerate --cfg <json> --range rows_<a>-<b>
--target results/target --out results/data/rows_<a>-<b>.jsonl --report <...>.report.json`.
"""

from __future__ import annotations

import argparse
import json
import logging
import time
from collections.abc import Callable

log = logging.getLogger("draftsmith.regenerate")

GenerateFn = Callable[[list[list[dict]]], list[str]]


class MissingAnswerError(ValueError):
    """Regeneration is off but a row has a user turn without a source answer."""


def regenerate(conversations: list[dict], generate_fn: GenerateFn) -> list[dict]:
    """Answer every user turn of every conversation again with `generate_fn`, turn by turn.

    Source assistant turns are discarded; round r asks all conversations that have an r-th user
    turn together, with their regenerated history. Returns new conversation dicts (same id/source).
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
            history[i] = prompt + [{"role": "assistant", "content": reply}]
    return [
        {"id": conv["id"], "source": conv["source"], "conversations": turns}
        for conv, turns in zip(conversations, history, strict=True)
    ]


def copy_answers(conversations: list[dict]) -> list[dict]:
    """Regeneration switched off: keep the source answers; every user turn must have one."""
    for conv in conversations:
        if conv["conversations"][-1]["role"] != "assistant":
            raise MissingAnswerError(
                f"regenerate.enabled is false but row {conv['id']!r} of source "
                f"{conv['source']!r} ends with a user turn that has no source answer"
            )
    return [dict(conv) for conv in conversations]


class HFGenerator:
    """transformers backend: batched greedy (or sampled) generation with left padding.

    Prompts are sorted by length before batching (less padding); replies come back in input
    order. `stats` accumulates generated tokens (up to and including the end-of-turn token),
    seconds, rows that hit `max_new_tokens` and empty replies.
    """

    def __init__(
        self,
        model,
        tokenizer,
        *,
        max_new_tokens: int = 128,
        temperature: float = 0.0,
        batch_size: int = 32,
        seed: int = 0,
        progress: bool = True,
    ):
        from draftsmith.tokens import end_of_turn_id

        self.model, self.tokenizer = model, tokenizer
        self.max_new_tokens, self.temperature = int(max_new_tokens), float(temperature)
        self.batch_size, self.seed, self.progress = int(batch_size), int(seed), progress
        stop = {end_of_turn_id(tokenizer)}
        if tokenizer.eos_token_id is not None:
            stop.add(tokenizer.eos_token_id)
        gen_eos = getattr(model.generation_config, "eos_token_id", None)
        stop.update([gen_eos] if isinstance(gen_eos, int) else (gen_eos or []))
        self.stop_ids = sorted(stop)
        self.pad_id = (
            tokenizer.pad_token_id if tokenizer.pad_token_id is not None else self.stop_ids[0]
        )
        self.stats = {
            "prompts": 0,
            "new_tokens": 0,
            "prompt_tokens": 0,
            "seconds": 0.0,
            "hit_limit": 0,
            "empty": 0,
        }

    def _generation_config(self):
        from transformers import GenerationConfig

        kw = {"do_sample": self.temperature > 0}
        if self.temperature > 0:
            kw.update(temperature=self.temperature, top_k=0, top_p=1.0)
        return GenerationConfig(
            max_new_tokens=self.max_new_tokens,
            eos_token_id=self.stop_ids,
            pad_token_id=self.pad_id,
            use_cache=True,
            **kw,
        )

    def _encode(self, prompt: list[dict]) -> list[int]:
        from draftsmith.tokens import render

        text = render(self.tokenizer, prompt, add_generation_prompt=True)
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def generate_ids(self, batch: list[list[int]]) -> list[list[int]]:
        """Greedy/sampled continuation of each prompt (ids), cut after its first stop token."""
        import torch

        width = max(len(p) for p in batch)
        input_ids = torch.full((len(batch), width), self.pad_id, dtype=torch.long)
        attention = torch.zeros((len(batch), width), dtype=torch.long)
        for i, p in enumerate(batch):
            input_ids[i, width - len(p) :] = torch.tensor(p, dtype=torch.long)
            attention[i, width - len(p) :] = 1
        device = next(self.model.parameters()).device
        with torch.inference_mode():
            out = self.model.generate(
                input_ids=input_ids.to(device),
                attention_mask=attention.to(device),
                generation_config=self._generation_config(),
            )
        replies = []
        for row in out[:, width:].tolist():
            cut = next((j for j, t in enumerate(row) if t in self.stop_ids), None)
            replies.append(row if cut is None else row[: cut + 1])
        return replies

    def __call__(self, prompts: list[list[dict]]) -> list[str]:
        import torch
        from tqdm import tqdm

        if self.temperature > 0:
            torch.manual_seed(self.seed)
        encoded = [self._encode(p) for p in prompts]
        order = sorted(range(len(prompts)), key=lambda i: len(encoded[i]))
        replies: list[str] = [""] * len(prompts)
        bar = tqdm(total=len(prompts), desc="regenerate", unit="row", disable=not self.progress)
        for start in range(0, len(order), self.batch_size):
            idx = order[start : start + self.batch_size]
            t0 = time.perf_counter()
            new = self.generate_ids([encoded[i] for i in idx])
            self.stats["seconds"] += time.perf_counter() - t0
            for i, ids in zip(idx, new, strict=True):
                ended = bool(ids) and ids[-1] in self.stop_ids
                self.stats["new_tokens"] += len(ids)
                self.stats["prompt_tokens"] += len(encoded[i])
                self.stats["hit_limit"] += int(not ended)
                body = ids[:-1] if ended else ids
                text = self.tokenizer.decode(body, skip_special_tokens=True).strip()
                self.stats["empty"] += int(not text)
                replies[i] = text
            bar.update(len(idx))
            bar.set_postfix(tok_s=f"{self.tokens_per_second():.1f}")
        bar.close()
        self.stats["prompts"] += len(prompts)
        return replies

    def tokens_per_second(self) -> float:
        return self.stats["new_tokens"] / self.stats["seconds"] if self.stats["seconds"] else 0.0


def write_jsonl(path, rows: list[dict]) -> None:
    from draftsmith.common import atomic_path

    with atomic_path(path) as tmp, open(tmp, "w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")


def main(argv: list[str] | None = None) -> None:
    from draftsmith.common import atomic_write_json, init_logging, parse_cfg, set_threads, versions
    from draftsmith.config import parse_range
    from draftsmith.prompts import SourceError, load_sources, rows_for_range

    ap = argparse.ArgumentParser(description="Regenerate the assistant turns of one row range.")
    ap.add_argument("--cfg", required=True, help="JSON with the data and regenerate sections")
    ap.add_argument("--range", required=True, help="rows_<a>-<b>")
    ap.add_argument("--target", required=True, help="target HF directory")
    ap.add_argument("--out", required=True, help="results/data/rows_<a>-<b>.jsonl")
    ap.add_argument("--report", required=True, help="results/data/rows_<a>-<b>.report.json")
    ap.add_argument("--threads", type=int, default=0)
    args = ap.parse_args(argv)
    init_logging("draftsmith.regenerate")
    cfg = parse_cfg(args.cfg)
    regen = cfg.get("regenerate", {})
    a, b = parse_range(args.range)
    try:
        rows = rows_for_range(load_sources(cfg), a, b)
    except SourceError as e:
        raise SystemExit(str(e)) from None
    report = {"range": args.range, "rows": len(rows), "enabled": bool(regen.get("enabled", True))}
    if not report["enabled"]:
        try:
            out = copy_answers(rows)
        except MissingAnswerError as e:
            raise SystemExit(str(e)) from None
        log.info(
            "%s: regeneration off, %d rows copied with their source answers", args.range, len(out)
        )
    else:
        if regen.get("backend", "hf") != "hf":
            raise SystemExit(f"regenerate.backend {regen.get('backend')!r} is not implemented")
        set_threads(args.threads)
        from draftsmith.target import load_target

        model, tokenizer = load_target(args.target)
        gen = HFGenerator(
            model,
            tokenizer,
            max_new_tokens=regen.get("max_new_tokens", 128),
            temperature=regen.get("temperature", 0.0),
            batch_size=regen.get("batch_size", 32),
            seed=int(regen.get("seed", 0)) + a,
        )
        t0 = time.perf_counter()
        out = regenerate(rows, gen)
        wall = time.perf_counter() - t0
        report.update(
            backend="hf",
            threads=args.threads,
            device=str(next(model.parameters()).device),
            max_new_tokens=gen.max_new_tokens,
            temperature=gen.temperature,
            batch_size=gen.batch_size,
            **gen.stats,
            wall_seconds=wall,
            tokens_per_second=gen.tokens_per_second(),
        )
        log.info(
            "%s: %d rows, %d turns, %d new tokens in %.1f s generate (%.1f s wall): "
            "%.1f tokens/s; %d hit max_new_tokens, %d empty",
            args.range,
            len(rows),
            gen.stats["prompts"],
            gen.stats["new_tokens"],
            gen.stats["seconds"],
            wall,
            gen.tokens_per_second(),
            gen.stats["hit_limit"],
            gen.stats["empty"],
        )
    report["versions"] = versions()
    write_jsonl(args.out, out)
    atomic_write_json(args.report, report)


if __name__ == "__main__":
    main()
