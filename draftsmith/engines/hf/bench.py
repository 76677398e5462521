"""The `hf` engine's bench stage: chain speculative decoding with the draft (`draftsmith.bench.specdec`)
against plain greedy decoding of the target, both timed in this process, batch size 1; with
bench.temperature > 0, speculative sampling against plain sampling (`draftsmith.algorithms.sampling`).
It returns raw measurements; `draftsmith.bench.figures` computes the figures.

These are the measurements of one process; `draftsmith.engines.hf.bench_pool` runs them in this
process or spread over worker processes (its `bench_sets` is the registry's entry point, which
`draftsmith.engines.hf.engine` re-exports with `load_models`).
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import torch
from tqdm import tqdm

from draftsmith.runtime.load import LoadMeter

log = logging.getLogger("draftsmith.engines.hf")


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure_prompt(
    model, tokenizer, draft, row, index: int, bench, aux_ids, meter, algorithm
) -> tuple:
    """(record, {"spec": s, "base": s}) of prompt `index` of its set: its speculative and its
    plain run, each timed (and its load metered) in this process (`algorithm`: the draft's
    spec, as the stage resolved it)."""
    from draftsmith.bench.specdec import greedy_generate, prompt_ids, speculative_generate, stop_ids
    from draftsmith.data.prompts import prompt_turns

    stops = stop_ids(model, tokenizer)
    k, max_new = bench.num_steps, bench.max_new_tokens
    ids = prompt_ids(tokenizer, prompt_turns(row))
    # prompt i samples with seed + i on both sides (None: greedy)
    sp, bs = (sampler(bench, index, model.device) for _ in range(2))
    runs = {
        "spec": lambda: speculative_generate(
            model, draft, ids, max_new, stops, k, aux_ids, sp, algorithm
        ),
        "base": lambda: greedy_generate(model, ids, max_new, stops, bs),
    }
    results, seconds = {}, {}
    # alternate the order so drift (thermal, caches) does not favour one side
    for name in ("spec", "base") if index % 2 == 0 else ("base", "spec"):
        with meter.phase(name):  # the meter's own reads stay out of the timed span
            _sync(model.device)
            t0 = time.perf_counter()
            results[name] = runs[name]()
            _sync(model.device)
            seconds[name] = time.perf_counter() - t0
    trace, base = results["spec"], results["base"]
    record = {
        "id": row["id"],
        "prompt_tokens": trace.prompt_len,
        "spec_ids": trace.tokens,
        "base_ids": base,
        "spec_tokens": len(trace.tokens),
        "base_tokens": len(base),
        "verify_passes": trace.passes,
        "accept_len_hist": [trace.accepted.count(a) for a in range(k + 1)],
        "emitted": sum(trace.emitted),
    }
    return record, seconds


def set_measurements(bench, prompts: list[dict], seconds: list[dict], load: dict) -> dict:
    """A set's raw measurements (`draftsmith.bench.figures.set_figures` turns them into the
    report's figures) from its prompts' records and timings, in prompt order."""
    return {
        "num_steps": bench.num_steps,
        # sampled outputs are compared in distribution (tests/test_sampling.py), not here
        "sampled": sampling(bench) is not None,
        "spec_seconds": sum(s["spec"] for s in seconds),
        "base_seconds": sum(s["base"] for s in seconds),
        "prompts": prompts,
        "extra": {"load": load},
    }


def run_set(model, tokenizer, draft, rows, bench, aux_ids: list[int], algorithm) -> dict:
    """Speculative and baseline generation of every row, timed, in this process."""
    meter = LoadMeter()  # other processes' CPU use while each side was timed
    measured = [
        measure_prompt(model, tokenizer, draft, row, i, bench, aux_ids, meter, algorithm)
        for i, row in enumerate(tqdm(rows, desc="prompts", unit="prompt"))
    ]
    records, seconds = [m[0] for m in measured], [m[1] for m in measured]
    return set_measurements(bench, records, seconds, meter.summary())


def sampling(bench) -> dict | None:
    """{temperature, top_p, seed} when the benchmark samples (bench.temperature > 0), else None
    (`bench`: the BenchSettings, draftsmith.config.settings)."""
    temperature = float(bench.temperature)
    if temperature <= 0:
        return None
    return {
        "temperature": temperature,
        "top_p": float(bench.top_p),
        "seed": int(bench.seed),
    }


def sampler(bench, index: int, device):
    """The Sampler of prompt `index` (seeded bench.seed + index), or None when greedy."""
    from draftsmith.algorithms.sampling import Sampler

    s = sampling(bench)
    return (
        None if s is None else Sampler.make(s["temperature"], s["top_p"], s["seed"] + index, device)
    )


def warm_up(model, tokenizer, draft, row, bench, aux_ids: list[int], algorithm) -> None:
    """One untimed pass of both paths (allocator, kernels, lazy init)."""
    from draftsmith.bench.specdec import greedy_generate, prompt_ids, speculative_generate, stop_ids
    from draftsmith.data.prompts import prompt_turns

    ids = prompt_ids(tokenizer, prompt_turns(row))
    stops = stop_ids(model, tokenizer)
    n = min(bench.max_new_tokens, 16)
    sp, bs = (sampler(bench, 0, model.device) for _ in range(2))
    speculative_generate(model, draft, ids, n, stops, bench.num_steps, aux_ids, sp, algorithm)
    greedy_generate(model, ids, n, stops, bs)


def load_models(target_dir: Path, draft_dir: Path, target_dtype: str, device: str, algorithm=None):
    """(target, tokenizer, draft) in `target_dtype` (target.dtype), the draft checked against the
    target it must serve (`algorithm`: its spec where the caller resolved it)."""
    from draftsmith.algorithms.export import ExportError, load_export
    from draftsmith.config.checks import aux_layer_ids
    from draftsmith.targets.model import TargetError, load_target

    dtype = getattr(torch, target_dtype)
    try:
        model, tokenizer = load_target(target_dir, dtype=dtype, device=device)
        draft = load_export(draft_dir, spec=algorithm).to(device=device, dtype=dtype)
    except (ExportError, TargetError) as e:
        raise SystemExit(str(e)) from None
    tc, dc = model.config, draft.config
    try:
        aux_layer_ids(dc.aux_layer_ids, tc.num_hidden_layers)
    except ValueError as e:
        raise SystemExit(f"{draft_dir}/config.json: {e}") from None
    if (dc.vocab_size, dc.target_hidden_size) != (tc.vocab_size, tc.hidden_size):
        raise SystemExit(
            f"{draft_dir}/config.json: the draft expects a target with vocab {dc.vocab_size} and "
            f"hidden size {dc.target_hidden_size}, {target_dir} has {tc.vocab_size} and "
            f"{tc.hidden_size}: the draft was trained for another target"
        )
    return model, tokenizer, draft


def route_linears(
    model, drafter, num_steps: int | list[int], device: str, verify_packed: bool = True
) -> dict:
    """On a CPU, the faster form of each linear layer at the row counts the loop runs (1 to
    num_steps + 1: decode steps, verification, draft extension), measured
    (draftsmith.runtime.gemm); the summary of what was chosen, for the log and report.
    `num_steps` may list several K (benchmarks/bench_num_steps.py decodes at each): every K's
    verification rows are routed.

    The target's verification (num_steps + 1 rows) may also take oneDNN's prepacked form
    (`verify_packed`): with MKL on an AMD EPYC, 3 rows cost 1.8x one row with F.linear or the
    transposed product and 1.25x packed, which is most of a speculative pass's cost above its
    floor (benchmarks/bench_pass_cost.py). The greedy steps (1 row) and the draft keep F.linear
    or the transposed product, so the baseline's outputs are computed as before; verification
    differs in rounding only, and the lossless check still compares token for token."""
    from draftsmith.runtime import gemm

    if device != "cpu":
        return {}
    forms = ("linear", "transposed")
    verifies = sorted({k + 1 for k in ([num_steps] if isinstance(num_steps, int) else num_steps)})
    top = verifies[-1]
    plain = [r for r in range(1, top + 1) if not (verify_packed and r in verifies)]
    target = gemm.route(model, plain, forms=forms)
    if verify_packed:
        target = gemm.route(model, verifies, forms=(*forms, "packed"), known=target)
    routes = {"target": target, "draft": gemm.route(drafter, range(1, top + 1), forms=forms)}
    summaries = {name: gemm.summary(table) for name, table in routes.items()}
    for name, text in summaries.items():
        log.info("linear layers of the %s, measured: %s", name, text)
    return summaries


def cpu_forms(model, drafter, num_steps: int | list[int], device: str) -> dict:
    """What the bench times with on a CPU: the target's few-query attention
    (draftsmith.engines.hf.attention, both sides) and the linear layers' routes
    (`route_linears`, whose summaries it returns); nothing elsewhere."""
    if device != "cpu":
        return {}
    from draftsmith.engines.hf.attention import use_decode_attention

    use_decode_attention(model)
    return route_linears(model, drafter, num_steps, device)


def linear_bytes(module) -> int:
    """Bytes of the weights a forward of `module` reads in full: its linear layers' (embedding
    tables are looked up a row per token; a tied lm_head is counted once, as a linear layer)."""
    seen = {}
    for m in module.modules():
        if isinstance(m, torch.nn.Linear):
            seen[m.weight.data_ptr()] = m.weight.numel() * m.weight.element_size()
    return sum(seen.values())


def pass_floor(target_bytes: int, draft_bytes: int, num_steps: int, spec) -> dict:
    """The cost a speculative pass cannot go below where a forward costs the bytes it reads
    (memory-bound decoding), in greedy steps: 1 (the target verifying num_steps + 1 tokens reads
    its weights once, as a greedy step does) + forwards x c, with c the draft's linear-layer
    bytes over the target's (linear_bytes) and forwards the draft's forwards per pass
    (num_steps for a chain, 1 for a block drafter that proposes every token in one forward:
    the hf flag of `spec`, the draft's algorithm)."""
    forwards = 1 if spec.serves("hf").flag == "block" else num_steps
    share = draft_bytes / target_bytes
    return {"draft_share": share, "draft_forwards": forwards, "floor": 1 + forwards * share}


def prepare(model, tokenizer, drafter, bench, device: str, warm_row: dict, algorithm) -> dict:
    """On a CPU, the target's few-query attention and its linear layers' routes (`cpu_forms`);
    both paths warmed up on `warm_row`; the facts the report needs of the loaded draft: routes,
    aux ids, draft vocab size, the linear layers' bytes of the target and the draft (for
    pass_floor)."""
    facts = {
        "routes": cpu_forms(model, drafter, bench.num_steps, device),
        "aux_ids": list(drafter.config.aux_layer_ids),
        "draft_vocab_size": drafter.config.draft_vocab_size,
        "linear_bytes": {"target": linear_bytes(model), "draft": linear_bytes(drafter)},
    }
    warm_up(model, tokenizer, drafter, warm_row, bench, facts["aux_ids"], algorithm)
    return facts


def method_text(bench, device: str, threads: int, spec, workers: int = 1) -> str:
    """The report's method line (`threads`: the job's, over `workers` processes; `spec`: the
    draft's algorithm, whose words say how it drafts)."""
    s = sampling(bench)
    where = f"{threads} threads"
    if workers > 1:
        where = (
            f"{workers} processes of {threads // workers} thread"
            f"{'s' if threads // workers > 1 else ''} each, the prompts shared "
            "between them, each prompt's two runs timed in one process"
        )
    verify, base, step = "greedy verification", "greedy decoding", "greedy decoding"
    if s is not None:
        verify = (
            f"speculative sampling at temperature {s['temperature']:g}, top-p {s['top_p']:g} "
            "(a proposal accepted with probability min(1, p/q), else the residual max(0, p - q) "
            f"sampled; seed {s['seed']} + prompt index)"
        )
        base, step = "sampling (same temperature and top-p)", "sampling"
    return (
        f"{spec.drafting_words(bench.num_steps)} (top-k 1), {verify}, at most "
        f"{bench.max_new_tokens} new tokens per prompt, batch size 1, on {device} ({where}), "
        "transformers in-process (hf engine). tau = tokens emitted by verification passes / "
        "verification passes (the prefill's token excluded; the SGLang count includes it). "
        "Speedup = tokens/s with "
        f"speculation / tokens/s of plain {base} with KV cache, both measured in this "
        "run, warm-up excluded. Pass cost = wall time of one speculative pass (draft chain and "
        f"verification, prefill amortised) in {step} steps: speedup = tau (SGLang count) / "
        "pass cost exactly."
    )
