"""The `hf` engine: the target as a transformers model in the job's own process.

- regenerate: `HFGenerator`, batched generation with left padding and a KV cache (greedy by
  default), prompts sorted by length so batches pad little; each row stops at its end-of-turn
  token.
- capture: the target's prefill over one row range with forward hooks on exactly the aux layers
  (SGLang "output of decoder layer i" = transformers `output_hidden_states[i + 1]`) and the base
  model's `last_hidden_state` as the post-norm state, so neither every layer's states nor the
  logits are materialized. Rows are right-padded without an attention mask: attention is causal,
  so a real token never sees a pad. The padded length is rounded up to a multiple of
  `PAD_MULTIPLE`, which makes a row's states bit-identical whichever rows share its batch (see
  `pad_rows`).
- bench: chain speculative decoding with the draft (`draftsmith.bench.specdec`) against plain greedy
  decoding (or speculative sampling against plain sampling), measured in
  `draftsmith.engines.hf.bench`, in this process or spread over worker processes on a CPU
  (`draftsmith.engines.hf.bench_pool`); `bench_sets` and `load_models` are re-exported here.

Works on CPU or one GPU (the device torch sees).
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

import torch
from tqdm import tqdm

from draftsmith.data.regenerate import new_stats
from draftsmith.engines.hf.bench import load_models  # re-exported
from draftsmith.engines.hf.bench_pool import bench_sets  # the bench stage (re-exported)
from draftsmith.hidden.capture_base import CaptureError, plan_batches
from draftsmith.hidden.storage import Storage
from draftsmith.hidden.writer import ShardWriter
from draftsmith.runtime.hardware import announce
from draftsmith.runtime.progress import ProgressLog

log = logging.getLogger("draftsmith.engines.hf")
# the work runs in the job's process: SIGINT/SIGTERM may end it at once (engines.stop_guard)
IN_PROCESS = True
# what the workflow needs from this engine (draftsmith.engines.NEEDS, read without importing
# this module): no settings of its own, one GPU at most; it alone samples in the benchmark and
# loads the target in regenerate.dtype
WORKFLOW = {"honours": ["bench.temperature", "bench.workers", "regenerate.dtype"]}


# glibc's mmap and trim thresholds of a capture job (draftsmith.runtime.heap): a prefill batch's
# activations stay on the heap instead of faulting in anew each batch (1.11x faster capture
# forwards, same bytes; 64:256 MiB was no faster); measured by
# benchmarks/bench_train_heap.py --stage capture (benchmarks/results/capture_heap_<kind>.md)
CAPTURE_HEAP = (16 << 20, 64 << 20)
# timed passes per form when regeneration routes a batch size's linear layers: a pass of every
# form over the target's weights at 32 rows takes about 0.2 s on one core
ROUTE_REPS = 3


# ---------------------------------------------------------------- regenerate


class HFGenerator:
    """transformers backend: batched greedy (or sampled) generation with left padding.

    Prompts are sorted by length before batching (less padding); replies come back in input
    order. `stats` accumulates generated tokens (up to and including the end-of-turn token),
    seconds, rows that hit `max_new_tokens`, empty replies, prompts too long to answer within
    `max_total` tokens (prompt + reply; the target's positions are a limit too) and replies cut
    to fit it.
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
        max_total: int = 0,
        progress: bool = True,
        thinking: str = "template",
        route: bool = False,
    ):
        from draftsmith.data.tokens import end_of_turn_id

        self.model, self.tokenizer = model, tokenizer
        self.max_new_tokens, self.temperature = int(max_new_tokens), float(temperature)
        self.batch_size, self.seed, self.progress = int(batch_size), int(seed), progress
        self.thinking = thinking  # regenerate.thinking: the template's switch, or its default
        positions = getattr(model.config.get_text_config(), "max_position_embeddings", None)
        limits = [int(n) for n in (max_total, positions) if n]
        self.max_total = min(limits) if limits else 0
        stop = {end_of_turn_id(tokenizer)}
        if tokenizer.eos_token_id is not None:
            stop.add(tokenizer.eos_token_id)
        gen_eos = getattr(model.generation_config, "eos_token_id", None)
        stop.update([gen_eos] if isinstance(gen_eos, int) else (gen_eos or []))
        self.stop_ids = sorted(stop)
        self.pad_id = (
            tokenizer.pad_token_id if tokenizer.pad_token_id is not None else self.stop_ids[0]
        )
        # decode steps and batches: what benchmarks/bench_default.py needs for the weight
        # bytes read per second (one read of the weights per step of a batch)
        self.stats = {**new_stats(), "batches": 0, "decode_steps": 0}
        # the KV cache written in place (draftsmith.runtime.kvcache); False: transformers' own
        # concatenating cache (benchmarks/bench_regen_batch.py compares the two)
        self.slab = True
        # route: each batch size's decode steps take the fastest form of every linear layer,
        # measured when a batch of that size first comes (draftsmith.runtime.gemm, CPU only)
        self.route, self.routes = route, []

    def _generation_config(self, max_new_tokens: int):
        from transformers import GenerationConfig

        kw = {"do_sample": self.temperature > 0}
        if self.temperature > 0:
            kw.update(temperature=self.temperature, top_k=0, top_p=1.0)
        return GenerationConfig(
            max_new_tokens=max_new_tokens,
            eos_token_id=self.stop_ids,
            pad_token_id=self.pad_id,
            use_cache=True,
            **kw,
        )

    def _encode(self, prompt: list[dict]) -> list[int]:
        from draftsmith.data.tokens import render

        text = render(self.tokenizer, prompt, add_generation_prompt=True, thinking=self.thinking)
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def budget(self, prompt_len: int) -> int:
        """New tokens a prompt may get: max_new_tokens, less where prompt + reply > max_total."""
        if not self.max_total:
            return self.max_new_tokens
        return min(self.max_new_tokens, self.max_total - prompt_len)

    def route_rows(self, rows: int) -> None:
        """Measure and install the linear layers' forms for decode steps of `rows` rows (once
        per row count); the log names what was chosen."""
        from draftsmith.runtime import gemm

        if not self.route or any(t["rows"] == rows for t in self.routes):
            return
        self.routes = gemm.route(self.model, [rows], reps=ROUTE_REPS, known=self.routes)
        chosen = [t for t in self.routes if t["rows"] == rows]
        log.info("linear layers at %s", gemm.summary(chosen) or f"{rows} rows: not measured")

    def generate_ids(self, batch: list[list[int]], max_new: int = 0) -> list[list[int]]:
        """Greedy/sampled continuation of each prompt (ids), cut after its first stop token."""
        width = max(len(p) for p in batch)
        input_ids = torch.full((len(batch), width), self.pad_id, dtype=torch.long)
        attention = torch.zeros((len(batch), width), dtype=torch.long)
        for i, p in enumerate(batch):
            input_ids[i, width - len(p) :] = torch.tensor(p, dtype=torch.long)
            attention[i, width - len(p) :] = 1
        from draftsmith.runtime.kvcache import slab_cache

        device = next(self.model.parameters()).device
        max_new = max_new or self.max_new_tokens
        cache = slab_cache(self.model, width + max_new) if self.slab else None
        with torch.inference_mode():
            out = self.model.generate(
                input_ids=input_ids.to(device),
                attention_mask=attention.to(device),
                generation_config=self._generation_config(max_new),
                past_key_values=cache,
            )
        self.stats["batches"] += 1
        self.stats["decode_steps"] += out.shape[1] - width
        replies = []
        for row in out[:, width:].tolist():
            cut = next((j for j, t in enumerate(row) if t in self.stop_ids), None)
            replies.append(row if cut is None else row[: cut + 1])
        return replies

    def __call__(self, prompts: list[list[dict]]) -> list[str | None]:
        if self.temperature > 0:
            torch.manual_seed(self.seed)
        encoded = [self._encode(p) for p in prompts]
        replies: list[str | None] = [None] * len(prompts)
        fits = [i for i in range(len(prompts)) if self.budget(len(encoded[i])) >= 1]
        too_long = len(prompts) - len(fits)
        if too_long:
            log.warning(
                "%d prompts have no room for a reply within %d tokens (longest: %d tokens); "
                "they are not answered",
                too_long,
                self.max_total,
                max(len(e) for e in encoded),
            )
        self.stats["too_long_turns"] += too_long
        order = sorted(fits, key=lambda i: len(encoded[i]))
        bar = tqdm(total=len(prompts), desc="regenerate", unit="row", disable=not self.progress)
        bar.update(too_long)
        progress_log = ProgressLog(log, "regenerate", len(prompts), "prompts", done=too_long)
        for start in range(0, len(order), self.batch_size):
            idx = order[start : start + self.batch_size]
            self.route_rows(len(idx))
            t0 = time.perf_counter()
            room = {i: self.budget(len(encoded[i])) for i in idx}
            new = self.generate_ids([encoded[i] for i in idx], max(room.values()))
            self.stats["seconds"] += time.perf_counter() - t0
            for i, ids in zip(idx, new, strict=True):
                if len(ids) > room[i] or (
                    room[i] < self.max_new_tokens
                    and len(ids) == room[i]
                    and ids[-1] not in self.stop_ids
                ):
                    ids = ids[: room[i]]
                    self.stats["capped_replies"] += 1
                ended = bool(ids) and ids[-1] in self.stop_ids
                self.stats["new_tokens"] += len(ids)
                self.stats["prompt_tokens"] += len(encoded[i])
                self.stats["hit_limit"] += int(not ended)
                body = ids[:-1] if ended else ids
                text = self.tokenizer.decode(body, skip_special_tokens=True).strip()
                self.stats["empty"] += int(not text)
                replies[i] = text
            bar.update(len(idx))
            progress_log.update(
                too_long + start + len(idx), new_tokens=self.stats["new_tokens"],
                tokens_per_s=f"{self.tokens_per_second():.1f}",
            )  # fmt: skip
            bar.set_postfix(tok_s=f"{self.tokens_per_second():.1f}")
        bar.close()
        self.stats["prompts"] += len(prompts)
        return replies

    def tokens_per_second(self) -> float:
        return self.stats["new_tokens"] / self.stats["seconds"] if self.stats["seconds"] else 0.0


def regen_dtype(job, target: Path) -> tuple[str, str]:
    """regenerate.dtype resolved (`auto`: measured, draftsmith.runtime.hardware)."""
    from draftsmith.runtime.hardware import cpu_facts, resolve_regen_dtype
    from draftsmith.runtime.precision import cached_probe, decode_seconds, decode_shapes
    from draftsmith.targets.layout import text_config

    def probe() -> dict:
        cfg = text_config(json.loads((target / "config.json").read_text()))
        shapes = decode_shapes(cfg, job.regenerate.batch_size)
        return cached_probe(shapes, cpu_facts().model, timer=decode_seconds)

    device = "cuda" if torch.cuda.is_available() else "cpu"
    return resolve_regen_dtype(job.regenerate.dtype, job.target.dtype, device, probe)


def regenerate_rows(conversations, job, *, target, threads: int, seed: int, max_total: int):
    """The regenerate stage: load the target, answer every user turn again.

    Prompt + reply stay within `max_total` (data.max_length) and the target's positions
    (HFGenerator).
    """
    from draftsmith.data.regenerate import regenerate
    from draftsmith.engines.hf.attention import use_decode_attention
    from draftsmith.runtime import gemm
    from draftsmith.runtime.files import set_threads
    from draftsmith.targets.model import load_target

    regen = job.regenerate
    set_threads(threads)
    dtype, why = regen_dtype(job, Path(target))
    log.info("regenerate.dtype %s (%s)", dtype, why)
    model, tokenizer = load_target(target, dtype=getattr(torch, dtype))
    if model.device.type == "cpu":  # draftsmith.engines.hf.attention: measured on CPUs only
        use_decode_attention(model)
    cpu = announce(log, "regenerate", dtype, "regenerate.dtype", model.device.type)
    gen = HFGenerator(
        model,
        tokenizer,
        max_new_tokens=regen.max_new_tokens,
        temperature=regen.temperature,
        batch_size=regen.batch_size,
        seed=seed,
        max_total=int(max_total),
        thinking=regen.thinking,
        route=model.device.type == "cpu",
    )
    t0 = time.perf_counter()
    out = regenerate(conversations, gen)
    report = {
        "backend": "hf",
        "threads": threads,
        "device": str(next(model.parameters()).device),
        "max_new_tokens": gen.max_new_tokens,
        "max_total_tokens": gen.max_total,
        "temperature": gen.temperature,
        "batch_size": gen.batch_size,
        "dtype": dtype,
        "dtype_why": why,
        "cpu": cpu,
        **({"linear_routes": gemm.summary(gen.routes)} if gen.routes else {}),
        **gen.stats,
        "wall_seconds": time.perf_counter() - t0,
        "tokens_per_second": gen.tokens_per_second(),
    }
    return out, report


# ---------------------------------------------------------------- capture


def decoder_parts(model) -> tuple[torch.nn.Module, torch.nn.ModuleList]:
    """(base model, its decoder layers) of a transformers causal LM (Llama, DeepSeek-V3, ...),
    or of the text model inside a multimodal wrapper (draftsmith.targets.layout.MODULE_PATHS)."""
    from draftsmith.targets.layout import MODULE_PATHS, decoder_modules

    found = decoder_modules(model)
    if found is None:
        raise CaptureError(
            f"{type(model).__name__}: no decoder-only text model at "
            f"{', '.join('.' + p for p in MODULE_PATHS)} (expected .layers and .norm there)"
        )
    return found


# Batch invariance of the capture. Causal attention keeps pads out of a real token's states, but
# torch's CPU kernels are not invariant to the padded length. Measured (Xeon, torch 2.13): causal
# SDPA over a prefix gives the same bits as over the full length only when the prefix is a
# multiple of 16 tokens (the AVX-512 float32 vector width), and a float32 GEMM of 1 or 2 rows
# rounds differently from a larger one; so a row captured alone differed from the same row in a
# batch by up to 2e-6 (float32) and one bf16 ulp. Padded to a multiple of 16, the states are
# bit-identical alone and batched, float32 and bfloat16, rows of 1 to 770 tokens
# (tests/test_capture_batching.py). GPU kernels are not covered by that measurement, nor are a
# mixture-of-experts target's expert GEMMs, whose row counts are the tokens routed to each
# expert: in float32 they differ by an ulp or two (pinned by the same test file).
PAD_MULTIPLE = 16


def pad_rows(
    input_ids: torch.Tensor, offsets: list[int], rows: list[int], multiple: int = PAD_MULTIPLE
) -> torch.Tensor:
    """[B, L] right-padded token ids, L the longest row rounded up to `multiple` (pad id 0:
    padded positions are never stored)."""
    longest = max(offsets[r + 1] - offsets[r] for r in rows)
    longest = -(-longest // multiple) * multiple
    batch = torch.zeros(len(rows), longest, dtype=torch.long)
    for b, r in enumerate(rows):
        a, e = offsets[r], offsets[r + 1]
        batch[b, : e - a] = input_ids[a:e]
    return batch


@torch.inference_mode()
def forward_states(model, batch: torch.Tensor, ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """aux [B, L, 3H] (outputs of layers `ids`, in order) and last [B, L, H] (post-norm)."""
    base, layers = decoder_parts(model)
    grabbed: dict[int, torch.Tensor] = {}

    def grab(i):
        def hook(_module, _inputs, output):
            grabbed[i] = output[0] if isinstance(output, tuple) else output

        return hook

    handles = [layers[i].register_forward_hook(grab(i)) for i in sorted(set(ids))]
    try:
        out = base(input_ids=batch.to(base.device), use_cache=False)
    finally:
        for h in handles:
            h.remove()
    aux = torch.cat([grabbed[i] for i in ids], dim=-1)
    return aux, out.last_hidden_state


def capture_shard(
    model,
    tokens: dict[str, torch.Tensor],
    out: str | Path,
    ids: list[int],
    dtype: str,
    batch_tokens: int,
    manifest: dict,
    progress: bool = True,
    storage: Storage | None = None,
    draft_ids: torch.Tensor | None = None,
) -> dict:
    """Run the prefill over every row of `tokens` and write the shard at `out`; return the manifest.

    `storage` (default: the reference layout) is the shard's storage mode; a top-k mode takes
    the teacher's top-k from the float32 final state and the model's own lm_head (over the
    draft vocabulary `draft_ids`, the target id of each draft id, for `topk_vocab: draft`).
    """
    hidden = int(model.config.get_text_config().hidden_size)
    storage = storage or Storage()
    lm_head = model.get_output_embeddings().weight if storage.final == "topk" else None
    offsets = tokens["row_offsets"].tolist()
    lengths = [b - a for a, b in zip(offsets, offsets[1:], strict=False)]
    batches = plan_batches(lengths, batch_tokens)
    t0 = time.perf_counter()
    with ShardWriter(
        out,
        input_ids=tokens["input_ids"],
        loss_mask=tokens["loss_mask"],
        row_offsets=tokens["row_offsets"],
        hidden_size=hidden,
        dtype=dtype,
        manifest={**manifest, "aux_layer_ids": list(ids), "backend": "hf"},
        storage=storage,
        lm_head=lm_head,
        draft_ids=draft_ids,
    ) as writer:
        progress_log = ProgressLog(log, f"capture {Path(out).stem}", len(lengths), "rows")
        done = tokens_done = 0
        for rows in tqdm(batches, desc=Path(out).stem, unit="batch", disable=not progress):
            aux, last = forward_states(model, pad_rows(tokens["input_ids"], offsets, rows), ids)
            for b, r in enumerate(rows):
                n = lengths[r]
                writer.write(offsets[r], aux[b, :n], last[b, :n])
            done, tokens_done = done + len(rows), tokens_done + sum(lengths[r] for r in rows)
            rate = tokens_done / max(time.perf_counter() - t0, 1e-9)
            progress_log.update(done, tokens=tokens_done, tokens_per_s=f"{rate:.0f}")
        writer.manifest["capture_seconds"] = round(time.perf_counter() - t0, 3)
        writer.manifest["batches"] = len(batches)
    return writer.manifest


def capture_range(
    tokens, job, *, target, out, ids, manifest: dict, threads: int, draft_ids=None
) -> dict:
    """The capture stage: load the target and write the shard of one row range (`job`: the
    JobSettings of the engine seam, draftsmith.engines; draft_ids: the draft vocabulary, for a
    top-k teacher stored over it)."""
    from draftsmith.runtime import heap
    from draftsmith.runtime.files import set_threads
    from draftsmith.targets.model import load_target

    set_threads(threads)
    heap.settle(*CAPTURE_HEAP)
    dtype = getattr(torch, job.target.dtype)
    model, _ = load_target(target, dtype=dtype)
    announce(
        log, "capture forward", str(dtype).removeprefix("torch."), "target.dtype", model.device.type
    )
    cap = job.capture
    return capture_shard(
        model,
        tokens,
        out,
        ids,
        cap.dtype,
        int(cap.batch_tokens),
        manifest={**manifest, "forward_dtype": str(dtype).removeprefix("torch.")},
        storage=Storage.from_config(cap.storage.as_dict()),
        draft_ids=draft_ids,
    )


__all__ = ["HFGenerator", "bench_sets", "capture_range", "load_models", "regenerate_rows"]
