"""The `sglang` engine: regeneration and the EAGLE-3 benchmark through a real SGLang server.

The job runs in its stage's role interpreter (`sglang` on GPUs, `sglang-cpu` on a CPU-only
machine), launches `python -m sglang.launch_server` with that same interpreter once for the job
(`draftsmith.engines.server`: health, log streaming into the rule's log, restarts, shutdown by process
group) and talks to it over HTTP on 127.0.0.1.

Requests go to SGLang's native `/generate` with token ids, not to the OpenAI chat API: the
prompt is rendered by our own chat template code (`draftsmith.data.tokens.render`, the one the hf
engine and the tokenize stage use), so the regenerated text follows exactly the template the
draft is later trained on, and the reply comes back as token ids with SGLang's counters
(`completion_tokens`, `spec_verify_ct`, the accepted-length histogram) in `meta_info`. The chat
API would apply the server's idea of the template (and its reasoning / tool parsers) and
returns text only, so neither agreement with hf nor hit-the-limit accounting could be checked
token for token.

capture: `draftsmith.engines.sglang.capture` (a patched server dumps each row's states).

The server of a job is described by `draftsmith.engines.sglang.server.server_spec` (shared with
the capture engine): for role `sglang-cpu` it adds the CPU compatibility layer's environment and
launch flags; any other role launches stock SGLang.
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
from pathlib import Path

from draftsmith.data.regenerate import new_stats
from draftsmith.engines.server import Supervisor, http_json, run_requests
from draftsmith.engines.sglang.capture import capture_range  # noqa: F401 (the capture stage)
from draftsmith.engines.sglang.server import (
    CPU_ROLE,
    SGLangSettings,
    job_server,
    role_gpus,
    server_spec,
)
from draftsmith.runtime.progress import ProgressLog
from draftsmith.runtime.serverhosts import release_gpu_hosts

log = logging.getLogger("draftsmith.engines.sglang")
# what the workflow needs from this engine (draftsmith.engines.NEEDS, read without importing
# this module): sampling and concurrency levels in the bench, the `sglang` section's result keys
# in its jobs' params, sglang.tp_size GPUs per job, and for capture the patched SGLang (rule
# patch_sglang, rules/sglang.smk)
WORKFLOW = {
    "honours": ["bench.temperature", "bench.concurrency"],
    "settings": "sglang",
    "gpus": "sglang.tp_size",
    "gpus_why": "one SGLang server, sglang.tp_size {n}",
    "inputs": {"capture": {"patched": "results/sglang/patched.json"}},
}


def generate(url: str, payload: dict, timeout: float) -> dict:
    out = http_json(f"{url}/generate", payload, timeout=timeout)
    if not isinstance(out, dict) or "output_ids" not in out or "meta_info" not in out:
        raise ValueError(f"/generate answered without output_ids/meta_info: {str(out)[:300]}")
    return out


def cut_at_stop(ids: list[int], stops) -> tuple[list[int], bool]:
    """(ids up to and including the first stop token, whether one was found)."""
    for j, t in enumerate(ids):
        if t in stops:
            return ids[: j + 1], True
    return list(ids), False


def load_tokenizer(target, role: str, trust_remote_code: bool = False):
    """The target's tokenizer in this (the role's) interpreter."""
    if role == CPU_ROLE:
        # the role's torchvision is a CUDA build that transformers imports on the way to the
        # tokenizer: its op schemas come from the compatibility layer here too
        from draftsmith.engines.sglang.cpu.hook import declare_torchvision_ops

        declare_torchvision_ops()
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(target), trust_remote_code=trust_remote_code)


def tokenizer(target, job, stage: str):
    """The registry's tokenizer seam (draftsmith.engines.load_tokenizer) for this engine."""
    return load_tokenizer(target, getattr(job, stage).role, job.target.trust_remote_code)


def _generation_eos(target) -> list[int]:
    path = Path(target) / "generation_config.json"
    value = json.loads(path.read_text()).get("eos_token_id") if path.is_file() else None
    return [value] if isinstance(value, int) else list(value or [])


# ---------------------------------------------------------------- regenerate


class SGLangGenerator:
    """generate_fn of `draftsmith.stages.regenerate` through the job's server; stats as HFGenerator's.

    Prompt + reply stay within `max_total` tokens (data.max_length): replies are capped to the
    room a prompt leaves, and a prompt with no room is not sent (None, counted).
    """

    def __init__(self, supervisor, tokenizer, stop_ids, regen, request_timeout: float, max_total=0):
        self.sup, self.tokenizer = supervisor, tokenizer
        self.stop_ids = sorted(stop_ids)
        self.max_new_tokens = int(regen.max_new_tokens)
        self.temperature = float(regen.temperature)
        self.concurrency = int(regen.batch_size)
        self.timeout = request_timeout
        self.max_total = int(max_total)
        self.thinking = regen.thinking
        self.stats = new_stats()

    def budget(self, prompt_len: int) -> int:
        if not self.max_total:
            return self.max_new_tokens
        return min(self.max_new_tokens, self.max_total - prompt_len)

    def payload(self, ids: list[int]) -> dict:
        sampling = {
            "max_new_tokens": self.budget(len(ids)),
            "temperature": self.temperature,
            "top_p": 1.0,
            "top_k": -1,
            "stop_token_ids": self.stop_ids,
        }
        return {"input_ids": ids, "sampling_params": sampling}

    def __call__(self, prompts: list[list[dict]]) -> list[str | None]:
        from tqdm import tqdm

        from draftsmith.data.tokens import render

        encoded = [
            list(
                self.tokenizer(
                    render(self.tokenizer, p, True, self.thinking), add_special_tokens=False
                ).input_ids
            )
            for p in prompts
        ]
        fits = [i for i, ids in enumerate(encoded) if self.budget(len(ids)) >= 1]
        self.stats["too_long_turns"] += len(prompts) - len(fits)
        if len(fits) < len(prompts):
            log.warning(
                "%d prompts have no room for a reply within %d tokens; they are not answered",
                len(prompts) - len(fits),
                self.max_total,
            )
        bar = tqdm(total=len(fits), desc="regenerate", unit="row")
        progress = ProgressLog(log, "regenerate", len(fits), "replies")
        t0, new_tokens = time.perf_counter(), [0]

        def done(_i, result):
            bar.update(1)
            new_tokens[0] += len(result["output_ids"])
            rate = new_tokens[0] / max(time.perf_counter() - t0, 1e-9)
            progress.update(progress.done + 1, new_tokens=new_tokens[0], tokens_per_s=f"{rate:.1f}")

        answers = run_requests(
            self.sup,
            [self.payload(encoded[i]) for i in fits],
            lambda url, p: generate(url, p, self.timeout),
            concurrency=self.concurrency,
            on_done=done,
        )
        self.stats["seconds"] += time.perf_counter() - t0
        bar.close()
        replies: list[str | None] = [None] * len(prompts)
        for i, answer in zip(fits, answers, strict=True):
            ids = encoded[i]
            out, ended = cut_at_stop(answer["output_ids"], self.stop_ids)
            finish = (answer["meta_info"].get("finish_reason") or {}).get("type")
            ended = ended or finish == "stop"
            room = self.budget(len(ids))
            self.stats["capped_replies"] += int(not ended and room < self.max_new_tokens)
            self.stats["new_tokens"] += len(out)
            self.stats["prompt_tokens"] += len(ids)
            self.stats["hit_limit"] += int(not ended)
            body = out[:-1] if out and out[-1] in self.stop_ids else out
            text = self.tokenizer.decode(body, skip_special_tokens=True).strip()
            self.stats["empty"] += int(not text)
            replies[i] = text
        self.stats["prompts"] += len(prompts)
        return replies

    def tokens_per_second(self) -> float:
        return self.stats["new_tokens"] / self.stats["seconds"] if self.stats["seconds"] else 0.0


def regenerate_rows(conversations, job, *, target, threads: int, seed: int, max_total: int):
    """The regenerate stage: one server for the range, every user turn answered again."""
    from draftsmith.data.regenerate import regenerate
    from draftsmith.data.tokens import end_of_turn_id

    regen, s = job.regenerate, job.engine
    if float(regen.temperature) > 0:
        log.warning("temperature > 0 through SGLang is sampled by the server, not seeded")
    tokenizer = load_tokenizer(target, regen.role, job.target.trust_remote_code)
    stops = {end_of_turn_id(tokenizer), *_generation_eos(target)}
    if tokenizer.eos_token_id is not None:
        stops.add(tokenizer.eos_token_id)
    t0 = time.perf_counter()
    spec = server_spec(job, "regenerate", target=target, threads=threads)
    with contextlib.ExitStack() as stack:
        sup = job_server(job, "regenerate", spec, stack)  # the stage's shared server, or its own
        gen = SGLangGenerator(
            sup, tokenizer, stops, regen, float(s.request_timeout), max_total=max_total
        )
        out = regenerate(conversations, gen)
    report = {
        "backend": "sglang",
        "threads": threads,
        "device": "cpu" if regen.role == CPU_ROLE else "server",
        "max_new_tokens": gen.max_new_tokens,
        "max_total_tokens": gen.max_total,
        "temperature": gen.temperature,
        "concurrency": gen.concurrency,
        **gen.stats,
        "wall_seconds": time.perf_counter() - t0,
        "tokens_per_second": gen.tokens_per_second(),
        **sup.stats(),
    }
    return out, report


# ---------------------------------------------------------------- bench


def speculative_args(bench, draft, spec) -> list[str]:
    """EAGLE-3 flags from bench.num_steps / topk / num_draft_tokens (0: a chain's K + 1);
    `bench`: the BenchSettings (draftsmith.config.settings); `spec`: the draft's algorithm
    (its SGLang flag, or why SGLang cannot serve it)."""
    k, topk = int(bench.num_steps), int(bench.topk)
    n = int(bench.num_draft_tokens) or (k + 1 if topk == 1 else 0)
    if not n:
        raise SystemExit(f"bench.topk {topk} > 1 needs bench.num_draft_tokens (a tree size)")
    serving = spec.serves("sglang")
    if serving.refused:
        raise SystemExit(f"{draft}: {serving.refused}")
    return [
        "--speculative-algorithm",
        serving.flag,
        "--speculative-draft-model-path",
        str(Path(draft).resolve()),
        "--speculative-num-steps",
        str(k),
        "--speculative-eagle-topk",
        str(topk),
        "--speculative-num-draft-tokens",
        str(n),
        "--decode-log-interval",
        "1",  # the server's cumulative acceptance counters are updated at each logged step
    ]


def draft_info(draft, target) -> dict:
    """aux ids and vocab of the exported draft, checked against the target it must serve."""
    from draftsmith.algorithms.export import ExportError, check_export

    try:
        check_export(draft)
    except ExportError as e:
        raise SystemExit(str(e)) from None
    dc = json.loads((Path(draft) / "config.json").read_text())
    tc = json.loads((Path(target) / "config.json").read_text())
    tc = tc.get("text_config", tc)
    if (dc["vocab_size"], dc.get("target_hidden_size", tc["hidden_size"])) != (
        tc["vocab_size"],
        tc["hidden_size"],
    ):
        raise SystemExit(
            f"{draft}/config.json: the draft expects a target with vocab {dc['vocab_size']} "
            f"and hidden size {dc.get('target_hidden_size')}, {target} has {tc['vocab_size']} "
            f"and {tc['hidden_size']}: the draft was trained for another target"
        )
    return {
        "aux_layer_ids": list(dc["eagle_config"]["eagle_aux_hidden_state_layer_ids"]),
        "draft_vocab_size": dc["draft_vocab_size"],
    }


def server_accept_length(url: str) -> float | None:
    """`avg_spec_accept_length` of /get_server_info (cumulative over the server's life)."""
    info = http_json(f"{url}/get_server_info", timeout=60)
    states = info.get("internal_states") or [{}]
    value = states[0].get("avg_spec_accept_length")
    return None if value is None else float(value)


def timed_sender(sampling: dict, timeout: float):
    """send(url, ids) for run_requests: the answer with `latency`, the seconds from sending the
    request to its answer (queueing in the server included, waiting in our pool excluded)."""

    def send(url, ids):
        t0 = time.perf_counter()
        answer = generate(url, {"input_ids": ids, "sampling_params": sampling}, timeout)
        answer["latency"] = time.perf_counter() - t0
        return answer

    return send


def serve_sets(spec, sets_ids: dict, sampling: dict, bench, s: SGLangSettings, speculative: bool):
    """One server for every set: a warm-up request, then each set timed at every
    bench.concurrency level in turn.

    Returns (name, level) -> {"answers", "seconds", "server_accept_length"} plus the supervisor
    stats. A level during which the server was restarted is run again (timing and counters
    whole).
    """
    from draftsmith.config.checks import concurrency_levels

    timeout = float(s.request_timeout)
    first = next(iter(sets_ids.values()))[0]
    send = timed_sender(sampling, timeout)
    out = {}
    with Supervisor(spec, retries=s.retries) as sup:
        warm = timed_sender(
            {**sampling, "max_new_tokens": min(16, sampling["max_new_tokens"])}, timeout
        )
        verifies = 0  # verify passes this launch served so far (its counters cover them all)
        warmed = 0  # the launch the last warm-up ran on
        for name, prompts in sets_ids.items():
            for level in concurrency_levels(bench.concurrency):
                while True:
                    if warmed != sup.launches:  # first set, or a relaunched server
                        w = run_requests(sup, [first], warm, concurrency=1)
                        warmed = sup.launches
                        verifies = w[0]["meta_info"].get("spec_verify_ct", 0)
                    launches = sup.launches
                    before = server_accept_length(sup.url) if speculative else None
                    t0 = time.perf_counter()
                    answers = run_requests(sup, prompts, send, concurrency=level)
                    seconds = time.perf_counter() - t0
                    if sup.launches == launches:
                        break
                    log.warning("%s: the server restarted during the set; running it again", name)
                figures = {"answers": answers, "seconds": seconds, "server_accept_length": None}
                if speculative:
                    after = server_accept_length(sup.url)
                    n = sum(a["meta_info"].get("spec_verify_ct", 0) for a in answers)
                    if after is not None and n:
                        figures["server_accept_length"] = (
                            after * (verifies + n) - (before or 0.0) * verifies
                        ) / n
                    verifies += n
                out[name, level] = figures
                log.info(
                    "%s at concurrency %d: %d prompts in %.1f s (%s)",
                    name, level, len(prompts), seconds, spec.name,
                )  # fmt: skip
        stats = sup.stats()
    return out, stats


def set_measurements(prompts, ids, base: dict, spec: dict, stops, k: int) -> dict:
    """The raw measurements of one set at one concurrency level (draftsmith.bench.figures) from
    both servers' answers: SGLang's per-request counters (completion_tokens, spec_verify_ct,
    the accepted-drafts histogram), the outputs cut at the first stop token, each request's
    latency."""
    measured = []
    for i, (b, sp) in enumerate(zip(base["answers"], spec["answers"], strict=True)):
        meta = sp["meta_info"]
        mine = [0] * (k + 1)
        for a, n in enumerate(meta.get("spec_correct_drafts_histogram") or []):
            if a > k:
                raise ValueError(f"SGLang reports {a} accepted drafts with num_steps {k}")
            mine[a] += n
        tokens = int(meta["completion_tokens"])
        measured.append(
            {
                "id": ids[i],
                "prompt_tokens": len(prompts[i]),
                "spec_ids": cut_at_stop(sp["output_ids"], stops)[0],
                "base_ids": cut_at_stop(b["output_ids"], stops)[0],
                "spec_tokens": tokens,
                "base_tokens": int(b["meta_info"]["completion_tokens"]),
                "spec_latency": sp["latency"],
                "base_latency": b["latency"],
                "verify_passes": int(meta.get("spec_verify_ct", 0)),
                "accept_len_hist": mine,
                # the first token comes from the prefill, not a verification pass
                "emitted": max(0, tokens - 1),
            }
        )
    return {
        "num_steps": k,
        "sampled": False,
        "spec_seconds": spec["seconds"],
        "base_seconds": base["seconds"],
        "prompts": measured,
        "figures": ["accept_length"],
        "extra": {"server_accept_length": spec["server_accept_length"]},
    }


def set_levels(prompts, ids, base: dict, spec: dict, stops, bench) -> dict:
    """A set's raw measurements: its first level's, with every level under `by_concurrency`."""
    from draftsmith.config.checks import concurrency_levels

    k, sampled = int(bench.num_steps), float(bench.temperature) > 0
    levels = [
        {
            **set_measurements(prompts, ids, base[c], spec[c], stops, k),
            "concurrency": c,
            "sampled": sampled,
        }
        for c in concurrency_levels(bench.concurrency)
    ]
    return {**levels[0], "by_concurrency": levels}


def check_server_counter(name: str, raw: dict) -> None:
    """Warn when /get_server_info's accept length disagrees with the per-request counters."""
    from draftsmith.bench.figures import accept_length, pooled_counters

    srv = raw["extra"]["server_accept_length"]
    if srv is None:
        return
    mine = accept_length(pooled_counters(raw["prompts"], raw["num_steps"])["accept_len_hist"])
    if abs(srv - mine) > 1e-6 * max(1.0, srv):
        log.warning(
            "%s: SGLang's /get_server_info gives accept length %.4f, its per-request counters %.4f",
            name,
            srv,
            mine,
        )


# What SGLang 0.5.23 does at temperature > 0 on CPU (pinned by tests/test_bench_concurrency_sglang.py):
# eagle_utils._verify_uses_greedy returns True for is_cpu, so verification commits the target's
# argmax; only the prefill's token is sampled
CPU_GREEDY_VERIFY = (
    "SGLang 0.5.23 on CPU verifies speculative tokens greedily at any temperature "
    "(sglang.srt.speculative.eagle_utils._verify_uses_greedy: is_cpu): past the prefill's "
    "sampled token the speculative output is the target's greedy continuation, so its tau is "
    "greedy acceptance, not speculative sampling's"
)


def method_text(bench, role: str, threads: int) -> str:
    from draftsmith.config.checks import concurrency_levels

    where = f"CPU ({threads} threads, role {role})" if role == CPU_ROLE else f"role {role}"
    t = float(bench.temperature)
    how = f"sampling at temperature {t}, top-p {bench.top_p}" if t > 0 else "greedy"
    levels = ", ".join(map(str, concurrency_levels(bench.concurrency)))
    return (
        f"SGLang EAGLE-3 speculative decoding ({bench.num_steps} steps, top-k "
        f"{bench.topk}), {how}, at most {bench.max_new_tokens} new tokens per prompt, "
        f"{levels} request(s) in flight at a time, on {where}: the target is served once "
        "without and once with --speculative-algorithm EAGLE3 and the trained draft, the same "
        "prompts through /generate on both, a warm-up request excluded. tau (SGLang count) = "
        "sum(completion_tokens) / sum(meta_info.spec_verify_ct); tau excludes each prompt's "
        "prefill token; acceptance by position from SGLang's accepted-drafts histogram, "
        "checked against /get_server_info's avg_spec_accept_length. Speedup = tokens/s with "
        "speculation / tokens/s without, both measured in this run. Pass cost = wall time of "
        "one verification pass in plain decoding steps: speedup = tau (SGLang count) / pass cost."
    )


def bench_sets(sets: dict, job, *, target, draft, spec, threads: int):
    """The bench stage: the target served without, then with the draft (`spec`: its algorithm,
    resolved once by the stage, draftsmith.algorithms.open_draft); SGLang's own counters."""
    from draftsmith.bench.specdec import prompt_ids
    from draftsmith.data.prompts import prompt_turns

    bench, s = job.bench, job.engine
    info = draft_info(draft, target)
    tokenizer = load_tokenizer(target, bench.role, job.target.trust_remote_code)
    stops = {tokenizer.convert_tokens_to_ids("<|im_end|>"), *_generation_eos(target)}
    stops = {t for t in stops | {tokenizer.eos_token_id} if isinstance(t, int)}
    stops.discard(tokenizer.unk_token_id)
    sets_ids = {
        name: [prompt_ids(tokenizer, prompt_turns(row)) for row in rows]
        for name, rows in sets.items()
    }
    sampling = {
        "max_new_tokens": int(bench.max_new_tokens),
        "temperature": float(bench.temperature),
        "top_p": float(bench.top_p),
        "stop_token_ids": sorted(stops),
    }
    # our own warm-up request replaces SGLang's start-up one, so the speculative server's
    # cumulative counters hold exactly the requests this job sent
    skip = ["--skip-server-warmup"]
    plain = server_spec(job, "bench", target=target, threads=threads, extra_args=skip)
    eagle = server_spec(
        job,
        "bench",
        target=target,
        threads=threads,
        extra_args=[*skip, *speculative_args(bench, draft, spec)],
    )
    eagle.name = "sglang-eagle3"
    if role_gpus(job, "bench"):  # the run's idle servers give back their GPUs first
        release_gpu_hosts()
    base, base_stats = serve_sets(plain, sets_ids, sampling, bench, s, speculative=False)
    answers, spec_stats = serve_sets(eagle, sets_ids, sampling, bench, s, speculative=True)
    results = {}
    for name in sets:
        b = {c: v for (n, c), v in base.items() if n == name}
        sp = {c: v for (n, c), v in answers.items() if n == name}
        ids = [r["id"] for r in sets[name]]
        results[name] = set_levels(sets_ids[name], ids, b, sp, stops, bench)
    for name, raw in results.items():
        for level in raw["by_concurrency"]:
            check_server_counter(f"{name} at concurrency {level['concurrency']}", level)
    role = bench.role
    info_sampling = {}
    if sampling["temperature"] > 0:
        info_sampling["sampling"] = {
            "temperature": sampling["temperature"],
            "top_p": sampling["top_p"],
            "seeded": False,
        }
        if role == CPU_ROLE:
            info_sampling["engine_notes"] = [CPU_GREEDY_VERIFY]
    return results, {
        **info_sampling,
        "backend": "sglang",
        "device": "cpu" if role == CPU_ROLE else "server",
        "threads": threads,
        **info,
        "method": method_text(bench, role, threads),
        "servers": {"baseline": base_stats, "eagle3": spec_stats},
        "speculative_args": speculative_args(bench, draft, spec),
    }
