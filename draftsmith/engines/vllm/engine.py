"""The vLLM engine: the bench stage with vLLM's own EAGLE-3 speculative decoding (role vllm-cpu).

Two in-process vLLM engines over the same target, one with `speculative_config` (method
eagle3, the draft directory as exported: `results/draft`, whose top-level
`eagle_aux_hidden_state_layer_ids` is vLLM's numbering) and one without, generate every prompt
at each `bench.concurrency` level (at most that many requests in flight, a new one entering as
one finishes: `closed_loop`), alternating which engine goes first; greedy, or at
`bench.temperature` > 0 vLLM's own speculative sampling. The prompts are the token ids our chat
template gives (the hf engine's exactly), the stop tokens the hf engine's.

Sampling: the draft samples its proposals (`draft_sample_method` "probabilistic", a proposal x
drawn from the draft's tempered distribution q) and vLLM's rejection sampler accepts x with
probability min(1, p(x) / q(x)): the standard rule, the hf engine's (draftsmith.algorithms.sampling), so
the two engines' sampled tau estimate the same quantity. vLLM's default, "greedy", proposes the
draft's argmax and accepts it with probability p(x), also lossless but another acceptance: at
temperature 0.7 close to the standard rule's on the embedded default's draft, almost none on
the tiny test draft, whose target is nearly flat (docs/report.md).
vLLM's draft applies the temperature only, not top-p (ours applies both to q): at top-p < 1
the acceptances differ, the outputs' distribution does not.

Acceptance comes from vLLM's own counters (`vllm:spec_decode_num_drafts`,
`..._num_accepted_tokens`, `..._num_accepted_tokens_per_pos`), read before and after each set:
a draft is one verification pass, and since a position can only be accepted after the ones
before it, "accepted at position j" is "accepted length >= j", which gives the histogram.
tau = (generated tokens - one prefill token per prompt) / drafts, the hf engine's quantity;
vLLM's own 1 + accepted / drafts differs only by tokens accepted past `max_new_tokens`.

vLLM on CPU: the distribution is `vllm-cpu` (its `vllm` console script is broken: use the
Python API or `python -m vllm.entrypoints.openai.api_server`). The KV cache is sized for the
largest level's requests (`kv_bytes` each) unless `VLLM_CPU_KVCACHE_SPACE` (GiB) is set, which vLLM prefers;
`VLLM_CPU_NUM_OF_RESERVED_CPU=0` (use every core) is set unless already set. On vLLM's CPU
build the stand-ins of draftsmith.engines.vllm.cpu are applied first: for any target the one
that makes its sampled verification read the temperature (vllm-cpu 0.32.0 reads uninitialised
memory there and accepted almost nothing), for an MLA target the backend choice and a KV block
size our Llama-style draft shares; anything else runs as shipped. A
wrapped (multimodal) target such as Kimi-K2.5 is served with `language_model_only`: vLLM
builds the wrapper around its text model, not the vision tower the text prompts never use.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import time
from pathlib import Path

from draftsmith.runtime.serverhosts import release_gpu_hosts

log = logging.getLogger("draftsmith.engines.vllm")
# what the workflow needs from this engine (draftsmith.engines.NEEDS, read without importing
# this module): sampling and concurrency levels in the bench, no settings section, one GPU
WORKFLOW = {"honours": ["bench.temperature", "bench.concurrency"]}

COUNTERS = (
    "vllm:spec_decode_num_drafts",
    "vllm:spec_decode_num_accepted_tokens",
    "vllm:spec_decode_num_accepted_tokens_per_pos",
)


def _counters(llm, k: int) -> tuple[int, int, list[int]]:
    """(drafts, accepted, accepted per position [k]) so far, from vLLM's metrics."""
    found = {m.name: m for m in llm.get_metrics() if m.name in COUNTERS}
    per_pos = list(getattr(found.get(COUNTERS[2]), "values", None) or [0] * k)
    return (
        int(getattr(found.get(COUNTERS[0]), "value", 0)),
        int(getattr(found.get(COUNTERS[1]), "value", 0)),
        [int(v) for v in per_pos] + [0] * (k - len(per_pos)),
    )


def check_draft(draft: Path, target: Path) -> dict:
    """The export's (SGLang-contract) config after the contract check, matched against the
    target. `draft` is an export (`results/draft`) or its speculators copy, which is checked
    with the export it belongs to."""
    from draftsmith.algorithms.export import ExportError, check_export
    from draftsmith.targets.model import target_config

    export = draft
    if "speculators_model_type" in json.loads((draft / "config.json").read_text()):
        export = draft.parent
        if not (export / "config.json").is_file():
            raise SystemExit(f"{draft}: a speculators directory outside a draftsmith export")
    try:
        check_export(export)
    except ExportError as e:
        raise SystemExit(str(e)) from None
    c = json.loads((export / "config.json").read_text())
    t = target_config(target)
    want = (t["vocab_size"], t["hidden_size"])
    if (c["vocab_size"], c.get("target_hidden_size", c["hidden_size"])) != want:
        raise SystemExit(
            f"{draft}/config.json: the draft expects a target with vocab {c['vocab_size']} and "
            f"hidden size {c.get('target_hidden_size')}, {target} has {want[0]} and {want[1]}"
        )
    return c


def counted_passes(drafts: int, per_pos: list[int], k: int) -> list[int]:
    """The accepted-length histogram from vLLM's counters: `per_pos[j]` counts the passes that
    accepted position j, which (positions are accepted in order) is "accepted length > j"."""
    full = [drafts, *per_pos[:k]]  # full[j]: passes whose accepted length >= j
    return [full[a] - full[a + 1] for a in range(k)] + [full[k]]


def kv_bytes(target: Path, max_len: int, dtype: str) -> int:
    """KV cache for one request of `max_len` tokens (target + one draft layer), x4 slack, at
    least 64 MiB: requests run one at a time, so vLLM's default reservation is mostly waste."""
    from draftsmith.targets.model import target_config

    t = target_config(target)
    heads = t.get("num_key_value_heads") or t["num_attention_heads"]
    head_dim = t.get("head_dim") or t["hidden_size"] // t["num_attention_heads"]
    width = 2 if dtype in ("bfloat16", "float16") else 4
    per_token = (t["num_hidden_layers"] + 1) * 2 * heads * head_dim * width
    return max(64 << 20, 4 * max_len * per_token)


def spec_config(draft: Path, target: Path, bench, dtype: str, algorithm) -> dict:
    """vLLM's `speculative_config`: the draft's method, its proposals per pass and, when
    sampling, proposals drawn from the draft's distribution (the standard rule, ours)."""
    from draftsmith.engines.vllm import cpu as vllm_cpu

    serving = algorithm.serves("vllm")
    if serving.refused:
        raise SystemExit(f"{draft}: {serving.refused}")
    spec = {"method": serving.flag, "model": str(draft), "num_speculative_tokens": bench.num_steps}
    if float(bench.temperature) > 0:
        spec["draft_sample_method"] = "probabilistic"
    spec.update(vllm_cpu.draft_args(draft, target, dtype))  # an MLA draft's backend on CPU
    return spec


def _engines(target: Path, draft: Path, algorithm, bench, dtype: str, max_len: int, in_flight: int):
    from vllm import LLM

    from draftsmith.engines.vllm import cpu as vllm_cpu

    common = dict(
        **vllm_cpu.engine_args(target, dtype),
        kv_cache_memory_bytes=in_flight * kv_bytes(target, max_len, dtype),
        model=str(target),
        tokenizer=str(target),
        dtype=dtype,
        enforce_eager=True,
        max_model_len=max_len,
        disable_log_stats=False,
        seed=0,
    )
    spec = spec_config(draft, target, bench, dtype, algorithm)
    if vllm_cpu.is_wrapped(target):  # the bench sends text only: no vision tower is built
        common["language_model_only"] = True
    # the speculative engine last: each engine's Prometheus logger replaces the process-wide
    # vllm:* collectors, and its counters are the ones read
    base = LLM(**common)
    return LLM(**common, speculative_config=spec), base


def closed_loop(llm, prompts: list[list[int]], params, level: int, tag: str) -> dict:
    """Every prompt through `llm`'s engine with at most `level` requests in flight, a new one
    entering as one finishes (a server's clients at that concurrency): the outputs, each
    request's latency (added to its last token) and the wall seconds of the whole run.
    `params(i)`: prompt i's SamplingParams."""
    from vllm.inputs import TokensPrompt

    engine = llm.llm_engine
    waiting = list(range(len(prompts)))[::-1]
    running: dict[str, tuple[int, float]] = {}
    outputs: list = [None] * len(prompts)
    latency = [0.0] * len(prompts)
    t0 = time.perf_counter()
    while waiting or running:
        while waiting and len(running) < level:
            i = waiting.pop()
            rid = f"{tag}-{i}"
            engine.add_request(rid, TokensPrompt(prompt_token_ids=prompts[i]), params(i))
            running[rid] = (i, time.perf_counter())
        if not engine.has_unfinished_requests():
            raise RuntimeError(f"vLLM finished no output for requests {sorted(running)}")
        for out in engine.step():
            if out.finished and out.request_id in running:
                i, start = running.pop(out.request_id)
                latency[i] = time.perf_counter() - start
                outputs[i] = list(out.outputs[0].token_ids)
    return {"outputs": outputs, "latency": latency, "seconds": time.perf_counter() - t0}


def sampling_params(bench, stops):
    """params(i) of prompt i: greedy, or (bench.temperature > 0) sampled with top_p and the
    seed bench.seed + i (the same on both engines: each side's draws reproducible); `bench`:
    the BenchSettings (draftsmith.config.settings)."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    t = float(bench.temperature)

    def params(i: int):
        common = dict(
            max_tokens=bench.max_new_tokens,
            stop_token_ids=sorted(stops),
            output_kind=RequestOutputKind.FINAL_ONLY,
        )
        if t == 0:
            return SamplingParams(temperature=0.0, **common)
        top_p, seed = float(bench.top_p), int(bench.seed) + i
        return SamplingParams(temperature=t, top_p=top_p, seed=seed, **common)

    return params


def run_level(spec_llm, base_llm, prompts, rows, bench, stops, level: int, order: int):
    """Both engines on every prompt at `level` requests in flight, timed, and vLLM's counters
    over the level: the raw measurements `draftsmith.bench.figures` turns into figures."""
    k = bench.num_steps
    params = sampling_params(bench, stops)
    runs = {}
    before = _counters(spec_llm, k)
    for name in ("spec", "base") if order % 2 == 0 else ("base", "spec"):
        llm = spec_llm if name == "spec" else base_llm
        runs[name] = closed_loop(llm, prompts, params, level, f"{name}{level}")
    after = _counters(spec_llm, k)
    drafts, accepted = after[0] - before[0], after[1] - before[1]
    per_pos = [a - b for a, b in zip(after[2], before[2], strict=True)]
    spec, base = runs["spec"], runs["base"]
    generated = sum(map(len, spec["outputs"]))
    return {
        "num_steps": k,
        "concurrency": level,
        "sampled": float(bench.temperature) > 0,
        "spec_seconds": spec["seconds"],
        "base_seconds": base["seconds"],
        "prompts": [
            {
                "id": row["id"],
                "prompt_tokens": len(ids),
                "spec_ids": a,
                "base_ids": b,
                "spec_tokens": len(a),
                "base_tokens": len(b),
                "spec_latency": sl,
                "base_latency": bl,
            }
            for row, ids, a, b, sl, bl in zip(
                rows,
                prompts,
                spec["outputs"],
                base["outputs"],
                spec["latency"],
                base["latency"],
                strict=True,
            )  # fmt: skip
        ],
        # counted per level: tau = (generated - one prefill token per prompt) / drafts
        "counters": {
            "accept_len_hist": counted_passes(drafts, per_pos, k),
            "emitted": generated - len(prompts),
        },
        "extra": {
            # vLLM's own mean acceptance length also counts tokens a last pass accepted beyond
            # max_tokens
            "vllm_mean_acceptance_length": 1 + accepted / drafts if drafts else float("nan"),
            "accepted_tokens": accepted,
        },
    }


def run_set(spec_llm, base_llm, prompts: list[list[int]], rows, bench, stops) -> dict:
    """A set at every bench.concurrency level: its first level's measurements, with every
    level's under `by_concurrency` (draftsmith.bench.figures)."""
    from draftsmith.config.checks import concurrency_levels

    levels = [
        run_level(spec_llm, base_llm, prompts, rows, bench, stops, c, order)
        for order, c in enumerate(concurrency_levels(bench.concurrency))
    ]
    return {**levels[0], "by_concurrency": levels}


def method_text(bench, threads: int, version: str, algorithm) -> str:
    from draftsmith.config.checks import concurrency_levels

    t = float(bench.temperature)
    how = (
        f"speculative sampling (proposals drawn from the draft's tempered distribution, "
        f"vLLM's rejection sampler) at temperature {t}, top-p {bench.top_p} "
        f"(the target's), seed {bench.seed} + prompt index"
        if t > 0
        else "greedy"
    )
    levels = ", ".join(map(str, concurrency_levels(bench.concurrency)))
    return (
        f"vLLM {version} (vllm-cpu, V1 engine in-process, eager): "
        f"{algorithm.drafting_words(bench.num_steps)}, {how}, at most "
        f"{bench.max_new_tokens} new tokens per prompt, {levels} request(s) in flight (a "
        f"new request enters as one finishes), on cpu "
        f"({threads} threads). Acceptance from vLLM's "
        "spec_decode counters (drafts = verification passes; tau = tokens emitted by them / "
        "passes, the prefill's token excluded; the SGLang count includes it). "
        "Speedup = tokens/s with speculation / tokens/s of the same vLLM build without it, "
        "both measured in this run, warm-up excluded. Pass cost = wall time of one "
        "speculative step in plain decoding steps."
    )


def bench_sets(sets: dict, job, *, target, draft, spec, threads: int):
    """The bench stage on vLLM: speculative and plain greedy generation of every set (`job`: the
    JobSettings of the engine seam, draftsmith.engines; `spec`: the draft's algorithm, resolved
    once by the stage, draftsmith.algorithms.open_draft)."""
    bench = job.bench
    if bench.topk != 1:
        raise SystemExit(f"bench.topk {bench.topk}: the vllm engine benchmarks chains")
    release_gpu_hosts()  # vLLM runs in this process: the run's idle servers give back GPUs
    if threads:
        os.environ.setdefault("OMP_NUM_THREADS", str(threads))
    os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    import vllm
    from transformers import AutoTokenizer, GenerationConfig

    from draftsmith.bench.specdec import prompt_ids, stop_ids
    from draftsmith.config.checks import concurrency_levels
    from draftsmith.data.prompts import prompt_turns
    from draftsmith.engines.vllm import cpu as vllm_cpu

    target, draft = Path(target), Path(draft)
    c = check_draft(draft, target)
    stand_ins = vllm_cpu.install(target)
    tokenizer = AutoTokenizer.from_pretrained(target)

    class _Model:  # stop_ids reads the generation config only
        try:
            generation_config = GenerationConfig.from_pretrained(target)
        except OSError:  # no generation_config.json
            generation_config = GenerationConfig()

    stops = stop_ids(_Model, tokenizer)
    prompts = {
        n: [prompt_ids(tokenizer, prompt_turns(r)) for r in rows] for n, rows in sets.items()
    }
    longest = max(len(p) for ps in prompts.values() for p in ps)
    max_len = longest + bench.max_new_tokens + bench.num_steps + 8
    dtype = job.target.dtype
    in_flight = max(concurrency_levels(bench.concurrency))
    spec_llm, base_llm = _engines(target, draft, spec, bench, dtype, max_len, in_flight)
    first = next(iter(sets))
    warm = dataclasses.replace(bench, concurrency=1)
    run_set(spec_llm, base_llm, prompts[first][:1], sets[first][:1], warm, stops)  # warm-up
    results = {n: run_set(spec_llm, base_llm, prompts[n], sets[n], bench, stops) for n in sets}
    n_threads = torch.get_num_threads()
    info = {
        "backend": "vllm",
        "device": "cpu",
        "threads": n_threads,
        **spec.exporter.layer_ids(c),
        "draft_vocab_size": c.get("draft_vocab_size", c["vocab_size"]),
        "vllm_version": vllm.__version__,
        "vllm_cpu_stand_ins": stand_ins,
        "method": method_text(bench, n_threads, vllm.__version__, spec),
    }
    t = float(bench.temperature)
    if t > 0:
        info["sampling"] = {
            "temperature": t,
            "top_p": float(bench.top_p),
            "seed": int(bench.seed),
        }
    return results, info
