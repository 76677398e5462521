"""Speculative decoding: lossless against greedy, tau arithmetic, the sanity gate."""

from __future__ import annotations

import random

import pytest
import torch
from wf import with_defaults

from draftsmith.algorithms.eagle3.model import DraftConfig, Eagle3Draft
from draftsmith.bench.specdec import (
    Trace,
    greedy_generate,
    prompt_ids,
    speculative_generate,
    stop_ids,
    summarize,
)
from draftsmith.stages.bench import GateError, gate

AUX_IDS = [1, 2, 3]
PROMPTS = [
    "Explain how a binary search works.",
    "Write a short story about a lighthouse keeper.",
    "def add(a, b):",
    "What is the capital of France?",
]


@pytest.fixture(scope="module")
def target(tiny_target):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny forwards: thread sync costs more than it saves
    model = AutoModelForCausalLM.from_pretrained(tiny_target, dtype=torch.float32).eval()
    yield model, AutoTokenizer.from_pretrained(tiny_target)
    torch.set_num_threads(threads)


def random_draft(model, draft_vocab: int = 96, seed: int = 1, aux_ids=AUX_IDS) -> Eagle3Draft:
    """An untrained draft over a random draft vocabulary (lossless must hold regardless)."""
    cfg = DraftConfig.from_target_config(model.config.to_dict(), draft_vocab, aux_ids)
    torch.manual_seed(seed)
    draft = Eagle3Draft(cfg).eval()
    with torch.no_grad():
        for p in draft.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.1)
    ids = torch.randperm(cfg.vocab_size)[:draft_vocab].sort().values
    t2d = torch.zeros(cfg.vocab_size, dtype=torch.bool)
    t2d[ids] = True
    draft.set_vocab(ids - torch.arange(draft_vocab), t2d)
    return draft


def _ids(tokenizer, text):
    return prompt_ids(tokenizer, [{"role": "user", "content": text}])


@pytest.mark.parametrize("num_steps", [1, 3, 5])
def test_lossless_random_draft(target, num_steps):
    model, tokenizer = target
    draft = random_draft(model)
    stops = stop_ids(model, tokenizer)
    for text in PROMPTS:
        ids = _ids(tokenizer, text)
        base = greedy_generate(model, ids, 24, stops)
        trace = speculative_generate(model, draft, ids, 24, stops, num_steps, AUX_IDS)
        assert trace.tokens == base, text
        assert trace.passes == len(trace.tokens) - 1  # every pass emitted >= 1 token
        assert sum(trace.emitted) == len(trace.tokens) - 1
        assert all(0 <= a <= num_steps for a in trace.accepted)


def install_oracle(monkeypatch, model, tokenizer, error_rate: float, seed: int = 0) -> None:
    """Make speculative_generate's draft propose the target's own greedy continuation, each
    token replaced by a wrong one with probability `error_rate` (the real draft still runs).

    The runner sees every token after the prompt's first, which is ChatML's <|im_start|>."""
    rng = random.Random(seed)
    vocab = model.config.vocab_size
    first = tokenizer.convert_tokens_to_ids("<|im_start|>")

    from draftsmith.algorithms.eagle3 import decode

    class OracleRunner(decode.DraftRunner):
        def extend(self, next_tokens, aux):
            self.seen = getattr(self, "seen", [first]) + list(next_tokens)
            super().extend(next_tokens, aux)

        def propose(self, k):
            assert len(super().propose(k)) == k
            props = greedy_generate(model, self.seen, k, set())
            return [(t + 1) % vocab if rng.random() < error_rate else t for t in props]

    monkeypatch.setattr(decode, "DraftRunner", OracleRunner)


@pytest.mark.parametrize("num_steps,error_rate", [(2, 0.3), (4, 0.2), (6, 0.5)])
def test_lossless_with_accepting_draft(target, monkeypatch, num_steps, error_rate):
    """A draft that proposes greedy's continuation with random errors: every acceptance length
    happens, so both caches are cropped at every offset; the output must still equal greedy."""
    model, tokenizer = target
    draft = random_draft(model)
    stops = stop_ids(model, tokenizer)
    install_oracle(monkeypatch, model, tokenizer, error_rate, seed=num_steps)
    lengths = set()
    for text in PROMPTS:
        ids = _ids(tokenizer, text)
        assert ids[0] == tokenizer.convert_tokens_to_ids("<|im_start|>")
        base = greedy_generate(model, ids, 40, stops)
        trace = speculative_generate(model, draft, ids, 40, stops, num_steps, AUX_IDS)
        assert trace.tokens == base, text
        assert sum(trace.emitted) == len(trace.tokens) - 1
        lengths.update(trace.accepted)
        if len(base) == 40:
            assert trace.tau > 1.2  # the oracle's proposals were accepted
    assert {0, num_steps} <= lengths


def test_packed_verification_routes_only_the_verify_rows_and_stays_lossless(target, monkeypatch):
    """The bench's routing (hf_bench.route_linears) with the packed form faked fastest
    everywhere: only the target's verification rows (num_steps + 1) take it, greedy's single
    row and the draft keep F.linear/transposed; the outputs still equal greedy's and the
    accepted lengths are those of the unrouted run."""
    from draftsmith.engines.hf.bench import route_linears
    from draftsmith.runtime import gemm

    if gemm.pack(torch.zeros(4, 4), 3) is None:
        pytest.skip("no oneDNN linear in this torch build")
    model, tokenizer = target
    draft, k = random_draft(model), 2
    stops = stop_ids(model, tokenizer)
    ids = [_ids(tokenizer, text) for text in PROMPTS]
    plain = [speculative_generate(model, draft, i, 32, stops, k, AUX_IDS).accepted for i in ids]
    monkeypatch.setattr(
        gemm, "_pass_seconds", lambda form, group, x: 0.1 if form == "packed" else 1
    )
    try:
        summary = route_linears(model, draft, k, "cpu")
        assert "3 rows: " in summary["target"] and "packed" in summary["target"].split("3 rows")[1]
        assert "packed" not in summary["target"].split("2 rows")[0]
        assert "packed" not in summary["draft"]
        assert any("packed_weight" in m.__dict__ for m in model.modules())
        for i, accepted in zip(ids, plain, strict=True):
            trace = speculative_generate(model, draft, i, 32, stops, k, AUX_IDS)
            assert trace.tokens == greedy_generate(model, i, 32, stops)
            assert trace.accepted == accepted
        assert "packed" not in route_linears(model, draft, k, "cpu", verify_packed=False)["target"]
    finally:
        gemm.unroute(model)
        gemm.unroute(draft)


def test_lossless_deepseek_v3(tiny_deepseek_target, monkeypatch):
    """The MLA target of Kimi-K2.5's architecture: its cache crops and aux capture work too."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    model = AutoModelForCausalLM.from_pretrained(tiny_deepseek_target).eval()
    tokenizer = AutoTokenizer.from_pretrained(tiny_deepseek_target)
    draft = random_draft(model, draft_vocab=64, aux_ids=[0, 1, 2])
    stops = stop_ids(model, tokenizer)
    install_oracle(monkeypatch, model, tokenizer, error_rate=0.3)
    try:
        for text in PROMPTS[:2]:
            ids = _ids(tokenizer, text)
            base = greedy_generate(model, ids, 24, stops)
            trace = speculative_generate(model, draft, ids, 24, stops, 3, [0, 1, 2])
            assert trace.tokens == base, text
            assert max(trace.accepted) == 3 and min(trace.accepted) == 0
    finally:
        torch.set_num_threads(threads)


def test_tau_arithmetic_hand_made_trace():
    # K = 3; four passes accepting 3, 0, 1, 2 proposals; the last pass was cut by max_new.
    t1 = Trace(num_steps=3, prompt_len=10, tokens=list(range(10)), accepted=[3, 0, 1, 2])
    t1.emitted = [4, 1, 2, 2]
    assert t1.passes == 4
    assert t1.tau == pytest.approx(9 / 4)
    assert t1.tau_sglang == pytest.approx(10 / 4)
    t2 = Trace(num_steps=3, prompt_len=5, tokens=list(range(5)), accepted=[3], emitted=[4])
    s = summarize([t1, t2])
    assert s["verify_passes"] == 5
    assert s["generated_tokens"] == 15
    assert s["tau"] == pytest.approx(13 / 5)
    assert s["accept_len_hist"] == [1, 1, 1, 2]
    # reached position 1: 4 passes of 5; position 2: 3 of 4; position 3: 2 of 3
    assert s["accept_rate_by_pos"] == pytest.approx([4 / 5, 3 / 4, 2 / 3])
    assert s["reach_rate_by_pos"] == pytest.approx([4 / 5, 3 / 5, 2 / 5])
    assert s["reached_by_pos"] == [5, 4, 3]
    # a position no pass reached has no rate (None), not a rate of zero
    never = summarize([Trace(num_steps=3, prompt_len=1, tokens=[1, 2], accepted=[0], emitted=[1])])
    assert never["accept_rate_by_pos"] == [0.0, None, None]
    assert never["reached_by_pos"] == [1, 0, 0]
    assert s["mean_accepted"] == pytest.approx((3 + 0 + 1 + 2 + 3) / 5)
    with pytest.raises(ValueError, match="num_steps"):
        summarize([t1, Trace(num_steps=2, prompt_len=1, accepted=[1], emitted=[2])])
    with pytest.raises(ValueError, match="outside"):
        summarize([Trace(num_steps=2, prompt_len=1, accepted=[3], emitted=[4])])


def test_trace_of_real_run_is_consistent(target):
    model, tokenizer = target
    draft = random_draft(model)
    stops = stop_ids(model, tokenizer)
    traces = [
        speculative_generate(model, draft, _ids(tokenizer, p), 16, stops, 3, AUX_IDS)
        for p in PROMPTS
    ]
    s = summarize(traces)
    assert s["verify_passes"] == sum(t.passes for t in traces)
    assert sum(s["accept_len_hist"]) == s["verify_passes"]
    assert s["tau"] == pytest.approx(sum(sum(t.emitted) for t in traces) / s["verify_passes"])


def _set(tau):
    return {"tau": tau}


def test_gate_rejects_tau_near_one():
    with pytest.raises(GateError) as err:
        gate({"heldout": _set(1.8), "humaneval": _set(1.02)}, 1.05)
    msg = str(err.value)
    assert "humaneval: tau 1.020" in msg and "heldout" not in msg.split("(")[1].split(";")[0]
    for cause in ("layer ids", "EAGLE3", "d2t"):
        assert cause in msg
    with pytest.raises(GateError, match="tau 1.000"):  # exactly 1.0 fails whatever the floor
        gate({"heldout": _set(1.0)}, 0.5)
    with pytest.raises(GateError):
        gate({"heldout": _set(float("nan"))}, 1.05)
    gate({"heldout": _set(1.8), "humaneval": _set(1.3)}, 1.05)  # passes


# --------------------------------------------------------------------------- the bench CLI


def _bench_inputs(tmp_path, tiny_target, model, num_heldout=3):
    """A target dir with its meta file, an exported random draft, metrics, stamp, sources."""
    import json
    import shutil

    from draftsmith.algorithms.export import export_draft, target_embedding, verifier_ref
    from draftsmith.targets.model import write_meta

    target_dir = tmp_path / "target"
    shutil.copytree(tiny_target, target_dir)
    write_meta(target_dir, "path", str(tiny_target))
    draft_dir = tmp_path / "draft"
    export_draft(
        random_draft(model),
        draft_dir,
        provenance={},
        embed=target_embedding(target_dir),
        verifier=verifier_ref(target_dir),
    )
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text(
        "".join(
            json.dumps(
                {"step": i, "loss": 5.0 / i, "acc_per_pos": [0.1 * i / 20, 0.05], "lr": 1e-3}
            )
            + "\n"
            for i in range(1, 21)
        )
    )
    stamp = tmp_path / "cpu.json"
    stamp.write_text(json.dumps({"role": "cpu", "ok": True}))
    rows = tmp_path / "rows.jsonl"
    rows.write_text(
        "".join(
            json.dumps({"id": f"r{i}", "conversations": [{"role": "user", "content": p}]}) + "\n"
            for i, p in enumerate(PROMPTS * 2)
        )
    )
    cfg = with_defaults(
        {
            "bench": {
                "role": "cpu",
                "num_steps": 3,
                "max_new_tokens": 12,
                "tau_floor": 1.05,
                "heldout_size": num_heldout,
                "humaneval_size": 2,
                "files": [],
            },
            "data": {
                "sources": [{"format": "specforge", "path": str(rows)}],
                "heldout_rows": num_heldout,
            },
            "target": {"dtype": "float32"},
        }
    )
    out = tmp_path / "bench"
    argv = [
        "--cfg", json.dumps(cfg), "--draft", str(draft_dir), "--target", str(target_dir),
        "--metrics", str(metrics), "--env-stamp", str(stamp), "--threads", "1",
        "--report-json", str(out / "report.json"), "--report-md", str(out / "report.md"),
        "--summary-html", str(out / "summary.html"), "--acceptance", str(out / "acc.png"),
        "--hist", str(out / "hist.png"), "--training", str(out / "training.png"),
    ]  # fmt: skip
    return argv, out


def test_bench_cli_report(target, tiny_target, tmp_path, monkeypatch):
    import json

    from draftsmith.stages import bench as bench

    model, tokenizer = target
    install_oracle(monkeypatch, model, tokenizer, error_rate=0.3)
    argv, out = _bench_inputs(tmp_path, tiny_target, model)
    offline = (
        tmp_path / "offline_acceptance.json"
    )  # what train writes (draftsmith.algorithms.eagle3.offline)
    offline.write_text(json.dumps({"rows": 5, "tau_est_by_k": [1.5, 1.7, 1.8, 1.85]}))
    bench.main([*argv, "--offline", str(offline)])
    report = json.loads((out / "report.json").read_text())
    assert list(report["sets"]) == ["heldout", "humaneval"]
    est = report["offline_estimate"]  # at bench.num_steps 3, next to each set's measured tau
    assert est["tau_est"] == 1.8 and est["num_steps"] == 3
    for name, r in report["sets"].items():
        assert est["gaps"][name] == {"tau": r["tau"], "gap": pytest.approx(r["tau"] - 1.8)}
    held = report["sets"]["heldout"]
    assert held["prompts"] == 3 and report["set_ids"]["heldout"] == [
        "r1",
        "r4",
        "r6",
    ]  # evenly spaced
    assert held["identical_outputs"] == 3  # lossless on the real CLI path as well
    assert held["tau"] > 1.05 and held["speedup"] > 0
    assert held["speedup"] == pytest.approx(held["tau_sglang"] / held["pass_cost"])
    assert sum(held["accept_len_hist"]) == held["verify_passes"]
    assert report["training"]["steps"] == 20
    assert report["env_stamp"] == {"role": "cpu", "ok": True}
    assert len(report["target_fingerprint"]) == 64
    md = (out / "report.md").read_text()
    assert "| heldout | 3 |" in md and "![acc](acc.png)" in md
    assert "Offline estimate from training (K = 3, 5 held-out training rows" in md
    assert "tau_est 1.800" in (out / "summary.html").read_text()
    assert (out / "summary.html").read_text().count("data:image/png;base64,") == 3
    # the floor beside the measured pass cost: 1 + 3 chain forwards x the draft's byte share
    floor = report["pass_floor"]
    assert floor["draft_forwards"] == 3 and 0 < floor["draft_share"] < 1, floor
    assert floor["floor"] == pytest.approx(1 + 3 * floor["draft_share"])
    assert f"Pass cost floor: {floor['floor']:.2f} greedy steps = 1 + 3 draft" in md
    assert "Pass cost floor:" in (out / "summary.html").read_text()
    for name in ("acc.png", "hist.png", "training.png"):
        assert (out / name).read_bytes()[:4] == b"\x89PNG"


def test_bench_cli_gate_writes_nothing(target, tiny_target, tmp_path):
    """An untrained draft on a random target is (almost) never accepted: the gate fails the job
    with the causes and leaves no report behind."""
    from draftsmith.stages import bench as bench

    model, _ = target
    argv, out = _bench_inputs(tmp_path, tiny_target, model, num_heldout=2)
    with pytest.raises(SystemExit) as err:
        bench.main(argv)
    assert "sanity gate failed" in str(err.value) and "layer ids" in str(err.value)
    assert not out.exists() or not any(out.iterdir())


def test_gate_message_names_an_untrained_or_random_target_and_the_smoke_switch():
    with pytest.raises(GateError) as err:
        gate({"heldout": _set(1.0)}, 0.0)  # tau_floor 0 still refuses tau == 1.0
    msg = str(err.value)
    assert "untrained or random-weight target" in msg and "bench.smoke: true" in msg


def test_bench_smoke_reports_a_failed_gate_without_failing(target, tiny_target, tmp_path):
    """bench.smoke: the gate is checked and reported, the report is written, the job succeeds."""
    import json

    from draftsmith.stages import bench as bench

    model, _ = target
    argv, out = _bench_inputs(tmp_path, tiny_target, model, num_heldout=2)
    i = argv.index("--cfg") + 1
    cfg = json.loads(argv[i])
    cfg["bench"].update(smoke=True, humaneval_size=0)
    argv[i] = json.dumps(cfg)
    bench.main([*argv, "--captions", str(out / "captions")])
    report = json.loads((out / "report.json").read_text())
    assert "**Smoke run**" in (out / "captions" / "summary.rst").read_text()
    assert report["gate"]["smoke"] is True and report["gate"]["passed"] is False
    assert "heldout" in report["gate"]["failed"]
    md = (out / "report.md").read_text()
    assert md.splitlines()[2].startswith("**SMOKE RUN (bench.smoke: true): the sanity gate failed")
    assert "SMOKE RUN" in (out / "summary.html").read_text()


def test_bench_workers_measure_what_one_process_does(target, tiny_target, tmp_path):
    """bench.workers 2 on a 2-thread job: two one-thread worker processes share the prompts;
    every prompt's outputs, verification passes and acceptance equal those of the whole job in
    one one-thread process, in the same order; the report names the processes."""
    import json

    from draftsmith.stages import bench as bench

    model, _ = target
    reports = {}
    for workers, threads in ((2, "2"), (1, "1")):
        argv, out = _bench_inputs(tmp_path / f"w{workers}", tiny_target, model, num_heldout=3)
        i = argv.index("--cfg") + 1
        cfg = json.loads(argv[i])
        cfg["bench"].update(smoke=True, workers=workers)
        argv[i] = json.dumps(cfg)
        argv[argv.index("--threads") + 1] = threads
        bench.main(argv)
        reports[workers] = json.loads((out / "report.json").read_text())
    pooled, single = reports[2], reports[1]
    assert (pooled["workers"], pooled["threads"]) == (2, 2)
    assert "2 processes of 1 thread each" in pooled["method"]
    assert (single["workers"], single["threads"]) == (1, 1)
    for name in ("heldout", "humaneval"):
        a, b = pooled["sets"][name], single["sets"][name]
        assert a["per_prompt"] == b["per_prompt"] and len(a["per_prompt"]) > 1
        assert a["identical_outputs"] == len(a["per_prompt"])  # lossless in the workers too
        assert a["spec_seconds"] > 0 and a["baseline_seconds"] > 0
        assert "why" in a["speedup_verdict"]  # the load meter's verdict (figures: test_hardware)


def test_bench_worker_count():
    from draftsmith.engines.hf.bench_pool import worker_count

    gib = 2**30
    # auto: one process with every thread (workers side by side skew the speedup)
    n, why = worker_count("auto", "cpu", 2, 24, gib, 20 * gib)
    assert n == 1 and "one process with the job's 2 thread(s)" in why
    assert worker_count("auto", "cpu", 8, 24, gib, None)[0] == 1
    assert worker_count("auto", "cuda", 8, 24, None, None)[0] == 1
    assert worker_count(2, "cuda", 8, 24, None, None)[0] == 1
    assert worker_count(1, "cpu", 2, 24, gib, 20 * gib)[0] == 1
    assert worker_count(2, "cpu", 2, 24, gib, 20 * gib)[0] == 2
    assert worker_count(4, "cpu", 2, 24, gib, 20 * gib)[0] == 2  # no more than the threads
    assert worker_count(8, "cpu", 8, 3, gib, 20 * gib)[0] == 3  # no more than the prompts
    n, why = worker_count(8, "cpu", 8, 24, 4 * gib, 10 * gib)  # memory for two copies
    assert n == 2 and "10.0 GiB free holds 2 x 4.0 GiB" in why
    assert worker_count(2, "cpu", 2, 24, 4 * gib, gib)[0] == 1  # never fewer than one
    assert worker_count(2, "cpu", 2, 24, gib, None)[0] == 2  # memory unknown


def test_a_failing_bench_worker_ends_the_job_with_its_error(target, tiny_target, tmp_path):
    """A worker that cannot load the draft: the job stops with that worker's message (which names
    the file), not with a hang or a traceback of the queue."""
    import json

    from draftsmith import algorithms
    from draftsmith.config import settings
    from draftsmith.engines.hf.bench_pool import bench_sets

    model, _ = target
    argv, _ = _bench_inputs(tmp_path, tiny_target, model, num_heldout=2)
    cfg = json.loads(argv[argv.index("--cfg") + 1])
    cfg["bench"]["workers"] = 2
    (tmp_path / "draft" / "config.json").write_text("{not json")
    rows = [{"id": f"r{i}", "conversations": [{"role": "user", "content": p}]}
            for i, p in enumerate(PROMPTS)]  # fmt: skip
    job = settings.stage_job(cfg, "bench")
    target_dir = argv[argv.index("--target") + 1]
    with pytest.raises(SystemExit) as err:
        spec = algorithms.get("eagle3")
        bench_sets(
            {"s": rows}, job, target=target_dir, draft=tmp_path / "draft", spec=spec, threads=2
        )
    assert "bench worker" in str(err.value) and "config.json" in str(err.value), err.value
    assert "Traceback" not in str(err.value)


def test_pass_floor_counts_linear_bytes_once_and_a_block_drafter_once():
    """linear_bytes reads each linear weight once (a tied lm_head shares the embedding's
    storage: counted as the linear layer, not twice) and skips embeddings; a chain drafter's
    floor counts num_steps forwards, a block drafter's (DFlash) one."""
    from draftsmith import algorithms
    from draftsmith.engines.hf.bench import linear_bytes, pass_floor

    class Toy(torch.nn.Module):
        def __init__(self, width: int, tied: bool):
            super().__init__()
            self.embed = torch.nn.Embedding(50, width)
            self.proj = torch.nn.Linear(width, width, bias=False)
            self.head = torch.nn.Linear(width, 50, bias=False)
            if tied:
                self.head.weight = self.embed.weight

    target, draft = Toy(8, tied=True), Toy(4, tied=False)
    assert linear_bytes(target) == (8 * 8 + 50 * 8) * 4
    assert linear_bytes(draft) == (4 * 4 + 50 * 4) * 4
    sizes = linear_bytes(target), linear_bytes(draft)
    share = sizes[1] / sizes[0]
    chain = pass_floor(*sizes, 3, algorithms.get("eagle3"))
    assert chain == {"draft_share": share, "draft_forwards": 3, "floor": 1 + 3 * share}
    assert pass_floor(*sizes, 3, algorithms.get("dflash"))["draft_forwards"] == 1
