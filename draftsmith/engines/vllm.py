"""The vLLM engine: the bench stage with vLLM's own EAGLE-3 speculative decoding (role vllm-cpu).

Two in-process vLLM engines over the same target, one with `speculative_config` (method
eagle3, the draft directory as exported: `results/draft`, whose top-level
`eagle_aux_hidden_state_layer_ids` is vLLM's numbering) and one without, generate every prompt
greedily, one request at a time, alternating which goes first. The prompts are the token ids
our chat template gives (the hf engine's exactly), the stop tokens the hf engine's.

Acceptance comes from vLLM's own counters (`vllm:spec_decode_num_drafts`,
`..._num_accepted_tokens`, `..._num_accepted_tokens_per_pos`), read before and after each set:
a draft is one verification pass, and since a position can only be accepted after the ones
before it, "accepted at position j" is "accepted length >= j", which gives the histogram.
tau = (generated tokens - one prefill token per prompt) / drafts, the hf engine's quantity;
vLLM's own 1 + accepted / drafts differs only by tokens accepted past `max_new_tokens`.

vLLM on CPU: the distribution is `vllm-cpu` (its `vllm` console script is broken: use the
Python API or `python -m vllm.entrypoints.openai.api_server`). The KV cache is sized for one
request (`kv_bytes`) unless `VLLM_CPU_KVCACHE_SPACE` (GiB) is set, which vLLM prefers;
`VLLM_CPU_NUM_OF_RESERVED_CPU=0` (use every core) is set unless already set. On vLLM's CPU
build, for an MLA target, the stand-ins of draftsmith.engines.vllm_cpu are applied first (backend
choice and a KV block size our Llama-style draft shares); anything else runs as shipped. A
wrapped (multimodal) target such as Kimi-K2.5 is served with `language_model_only`: vLLM
builds the wrapper around its text model, not the vision tower the text prompts never use.
"""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path

from tqdm import tqdm

from draftsmith import algorithms

log = logging.getLogger("draftsmith.engines.vllm")
# what the workflow needs from this engine (draftsmith.engines.NEEDS, read without importing
# this module): nothing beyond the defaults (no settings section, one GPU at most)
WORKFLOW = {}

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
    from draftsmith.export import ExportError, check_export
    from draftsmith.target import target_config

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
    from draftsmith.target import target_config

    t = target_config(target)
    heads = t.get("num_key_value_heads") or t["num_attention_heads"]
    head_dim = t.get("head_dim") or t["hidden_size"] // t["num_attention_heads"]
    width = 2 if dtype in ("bfloat16", "float16") else 4
    per_token = (t["num_hidden_layers"] + 1) * 2 * heads * head_dim * width
    return max(64 << 20, 4 * max_len * per_token)


def _engines(target: Path, draft: Path, bench: dict, dtype: str, max_len: int):
    from vllm import LLM

    from draftsmith.engines import vllm_cpu

    common = dict(
        **vllm_cpu.engine_args(target, dtype),
        kv_cache_memory_bytes=kv_bytes(target, max_len, dtype),
        model=str(target),
        tokenizer=str(target),
        dtype=dtype,
        enforce_eager=True,
        max_model_len=max_len,
        disable_log_stats=False,
        seed=0,
    )
    method = (
        "dflash" if "dflash_config" in json.loads((draft / "config.json").read_text()) else "eagle3"
    )
    spec = {"method": method, "model": str(draft), "num_speculative_tokens": bench["num_steps"]}
    spec.update(vllm_cpu.draft_args(draft, target, dtype))  # an MLA draft's backend on CPU
    if vllm_cpu.is_wrapped(target):  # the bench sends text only: no vision tower is built
        common["language_model_only"] = True
    # the speculative engine last: each engine's Prometheus logger replaces the process-wide
    # vllm:* collectors, and its counters are the ones read
    base = LLM(**common)
    return LLM(**common, speculative_config=spec), base


def run_set(spec_llm, base_llm, prompts: list[list[int]], rows, bench: dict, stops) -> dict:
    """Both engines on every prompt, timed, and vLLM's counters over the set: the raw
    measurements `draftsmith.benchfigures.set_figures` turns into the report's figures."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    k = bench["num_steps"]
    params = SamplingParams(
        temperature=0.0, max_tokens=bench["max_new_tokens"], stop_token_ids=sorted(stops)
    )
    seconds, tokens = {"spec": 0.0, "base": 0.0}, {"spec": [], "base": []}
    before = _counters(spec_llm, k)
    for i, ids in enumerate(tqdm(prompts, desc="prompts", unit="prompt")):
        engines = {"spec": spec_llm, "base": base_llm}
        for name in ("spec", "base") if i % 2 == 0 else ("base", "spec"):
            t0 = time.perf_counter()
            out = engines[name].generate(
                [TokensPrompt(prompt_token_ids=ids)], params, use_tqdm=False
            )
            seconds[name] += time.perf_counter() - t0
            tokens[name].append(list(out[0].outputs[0].token_ids))
    after = _counters(spec_llm, k)
    drafts, accepted = after[0] - before[0], after[1] - before[1]
    per_pos = [a - b for a, b in zip(after[2], before[2], strict=True)]
    generated = sum(map(len, tokens["spec"]))
    return {
        "num_steps": k,
        "sampled": False,
        "spec_seconds": seconds["spec"],
        "base_seconds": seconds["base"],
        "prompts": [
            {
                "id": row["id"],
                "prompt_tokens": len(ids),
                "spec_ids": a,
                "base_ids": b,
                "spec_tokens": len(a),
                "base_tokens": len(b),
            }
            for row, ids, a, b in zip(rows, prompts, tokens["spec"], tokens["base"], strict=True)
        ],
        # counted per set: tau = (generated - one prefill token per prompt) / drafts
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


DRAFTING = {  # draft.algorithm of the export -> how vLLM's proposer drafts
    "eagle3": "EAGLE-3 speculative decoding (chain)",
    "eagle3.1": "EAGLE-3.1 speculative decoding (chain)",
    "dflash": "DFlash speculative decoding (one block forward per pass)",
}


def method_text(bench: dict, threads: int, version: str, algorithm: str = "eagle3") -> str:
    return (
        f"vLLM {version} (vllm-cpu, V1 engine in-process, eager) {DRAFTING[algorithm]}, "
        f"{bench['num_steps']} draft tokens per verification pass, greedy, at most "
        f"{bench['max_new_tokens']} new tokens per prompt, one request at a time, on cpu "
        f"({threads} threads). Acceptance from vLLM's "
        "spec_decode counters (drafts = verification passes; tau = tokens emitted by them / "
        "passes, the prefill's token excluded; the SGLang count includes it). "
        "Speedup = tokens/s with speculation / tokens/s of the same vLLM build without it, "
        "both measured in this run, warm-up excluded. Pass cost = wall time of one "
        "speculative step in plain decoding steps."
    )


def bench_sets(sets: dict, cfg: dict, *, target, draft, threads: int):
    """The bench stage on vLLM: speculative and plain greedy generation of every set."""
    bench = cfg["bench"]
    if bench["topk"] != 1:
        raise SystemExit(f"bench.topk {bench['topk']}: the vllm engine benchmarks chains")
    if threads:
        os.environ.setdefault("OMP_NUM_THREADS", str(threads))
    os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    import vllm
    from transformers import AutoTokenizer, GenerationConfig

    from draftsmith.engines import vllm_cpu
    from draftsmith.prompts import prompt_turns
    from draftsmith.specdec import prompt_ids, stop_ids

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
    max_len = longest + bench["max_new_tokens"] + bench["num_steps"] + 8
    dtype = cfg["target"].get("dtype", "float32")
    spec_llm, base_llm = _engines(target, draft, bench, dtype, max_len)
    first = next(iter(sets))
    run_set(spec_llm, base_llm, prompts[first][:1], sets[first][:1], bench, stops)  # warm-up
    results = {n: run_set(spec_llm, base_llm, prompts[n], sets[n], bench, stops) for n in sets}
    n_threads = torch.get_num_threads()
    info = {
        "backend": "vllm",
        "device": "cpu",
        "threads": n_threads,
        **_layer_ids(c),
        "draft_vocab_size": c.get("draft_vocab_size", c["vocab_size"]),
        "vllm_version": vllm.__version__,
        "vllm_cpu_stand_ins": stand_ins,
        "method": method_text(bench, n_threads, vllm.__version__, algorithms.of_export(c).NAME),
    }
    return results, info


def _layer_ids(c: dict) -> dict:
    """The draft's aux ids (SGLang numbering) and vLLM's; a DFlash draft's vLLM ids are its
    dflash_config.target_layer_ids + 1 (draftsmith.dflash_export)."""
    if "dflash_config" in c:
        ids = c["dflash_config"]["target_layer_ids"]
        return {"aux_layer_ids": ids, "vllm_aux_layer_ids": [i + 1 for i in ids]}
    return {
        "aux_layer_ids": c["eagle_config"]["eagle_aux_hidden_state_layer_ids"],
        "vllm_aux_layer_ids": c.get("eagle_aux_hidden_state_layer_ids"),
    }
