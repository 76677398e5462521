"""The real Snakefile on a tiny Kimi-K2.5-shaped checkpoint, every engine stage through SGLang's
CPU server (role sglang-cpu): `snakemake --cores all` regenerates the replies, captures
the hidden states (the patched server) and benchmarks the draft through SGLang, which serves
Kimi-K2.5's own wrapper class (`KimiK25ForConditionalGeneration` around its DeepSeek-V3 text
model). Once with the Llama-style draft, then with the MLA draft (`--config 'draft={"attention":
"mla"}'`, which plans only train, whose job exports, and bench again).

The checkpoint is laid out as Moonshot ships Kimi-K2.5 (draftsmith.targets.tinymodel `--wrap
kimi_k25 --tokenizer tiktoken`): config.json with `text_config` and a `vision_config` in both
naming sets, weights under `language_model.` beside a 1-layer MoonViT and projector under Kimi's
tensor names, a tiktoken rank file with its remote-code tokenizer class (no tokenizer.json),
Kimi's thinking chat template, preprocessor_config.json naming a remote processor. The target
stage converts the tokenizer and serves the wrapper text-only (`language_model_only`,
draftsmith.targets.layout.serve_text_only). The text model is test_workflow_kimi_vllm's (5
layers, hidden 128, the engines' MLA shapes, weights doubled, lm_head answering with round-trip
punctuation only), so that the draft learns the target's replies to the 8 benchmark prompts.

Every key the test does not name is at its default: `capture.aux_layer_ids` auto (ids [1, 2, 3]
for this class: draftsmith.config.checks.aux_layer_ids), the draft's shape, the data rules.
`regenerate.thinking: enabled` renders the prompts with the template's thinking switch on, the
mode the benchmark's prompts are rendered in (the template's default).

What is checked against our own engine (`hf`, transformers) on the same inputs, by a second
project that regenerates and captures with it:
- the regenerated rows are equal, row for row;
- the captured shards: token ids, masks and offsets equal; the aux and final states within
  TOLERANCE of the hf capture's (float32 kernels sum in another order; a MoE router whose two
  best scores are within rounding may pick another expert at a token, which moves that token's
  final state: at most OUTLIERS such tokens);
- the benchmark: outputs equal to plain greedy on every prompt, and SGLang's acceptance
  (passes, accepted-length histogram, tau) equal to our engine's on the same prompts and draft
  (trained.assert_same_acceptance), for both drafts.

The 8 prompts are two row ranges, so each stage's two range jobs show the sharing: one server
launch per stage (draftsmith.engines.sharedserver), and a targeted rebuild of one shard starts
one server and rebuilds only that shard.

.ci/run's SGLang step runs it (marked sglang, not extended): 6-8 minutes on 2 cores.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from roles import role_python
from test_sglang_capture import CPU_SERVER_ARGS as SERVER_ARGS
from test_workflow_kimi_vllm import BENCH, answer_only_with, build, round_trip_tokens
from trained import PROMPTS, assert_same_acceptance
from wf import planned_jobs, snakemake, tiny_config, write_config

pytestmark = [pytest.mark.slow, pytest.mark.workflow, pytest.mark.sglang]

MLA = ("--config", 'draft={"attention": "mla"}')
TOLERANCE = 1e-2  # absolute and relative, as tests/test_sglang_capture.py
OUTLIERS = 1  # final-state tokens per shard beyond TOLERANCE (a router near-tie)


def round_trip_target(path: Path) -> Path:
    """The tiny Kimi-K2.5 checkpoint of the module docstring: a DeepSeek-V3 text model whose
    lm_head answers only with single punctuation tokens no merge joins, wrapped."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from draftsmith.targets.tinymodel import make_tiny_target, wrap_target

    make_tiny_target(
        path, "deepseek_v3", num_layers=5, hidden_size=128, engine_shapes=True,
        tokenizer_kind="tiktoken",
    )  # fmt: skip
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(path, trust_remote_code=True)
    answer_only_with(model, round_trip_tokens(tok, tok.vocab_size))
    model.save_pretrained(path)
    return wrap_target(path, "kimi_k25")


def config(src: Path, prompts: Path, python: str, engine: str) -> dict:
    """The project: the prompts as the only data source and the benchmark set; regenerate and
    capture on `engine` (sglang, or hf for the comparison), the bench through SGLang."""
    role = "sglang-cpu" if engine == "sglang" else "cpu"
    train = {"ttt_steps": 3, "epochs": 24, "lr": 0.003, "warmup_ratio": 0.05}
    train.update(batch_tokens=256, checkpoint_seconds=0, precision="fp32")
    bench = {**BENCH, "backend": "sglang", "role": "sglang-cpu", "tau_floor": 1.5}
    bench.update(heldout_size=0, humaneval_size=0, topk=1, num_draft_tokens=0, concurrency=1)
    bench["files"] = [{"name": "prompts", "path": str(prompts), "format": "prompt"}]
    cfg = tiny_config(
        src,
        data={
            "sources": [{"format": "prompt", "path": str(prompts)}],
            "heldout_rows": 0,
            "rows_per_shard": len(PROMPTS) // 2,  # two ranges: one server per stage for both
            "max_length": 192,
        },
        regenerate={
            "backend": engine,
            "role": role,
            "thinking": "enabled",
            "max_new_tokens": BENCH["max_new_tokens"],
            "batch_size": len(PROMPTS),
            "dtype": "float32",  # as SGLang serves the target: the rows are compared
        },
        capture={"backend": engine, "role": role, "dtype": "float32", "batch_tokens": 2048},
        train=train,
        bench=bench,
        sglang={"extra_args": SERVER_ARGS},
    )
    cfg["target"]["trust_remote_code"] = True  # as the preset: the directory ships code
    cfg["draft"] = {"vocab_size": 64}
    cfg["envs"] = {"cpu": {"python": ""}, "sglang-cpu": {"python": python}}
    return cfg


@pytest.fixture(scope="module")
def projects(tmp_path_factory) -> dict:
    python = role_python("sglang-cpu")  # first: a missing role skips (or fails) at once
    root = tmp_path_factory.mktemp("kimi_sglang")
    src = round_trip_target(root / "src")
    prompts = root / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    for engine in ("sglang", "hf"):
        write_config(root / engine, config(src, prompts, python, engine))
    return {"sglang": root / "sglang", "hf": root / "hf", "src": src}


@pytest.fixture(scope="module")
def llama(projects) -> dict:
    return build(projects["sglang"], timeout=2400)


@pytest.fixture(scope="module")
def mla(projects, llama) -> dict:
    """The MLA draft on the same project: only train (which exports) and bench again."""
    jobs = planned_jobs(projects["sglang"], args=MLA)
    jobs.pop("all", None)
    assert jobs == {"train": 1, "bench": 1}, jobs
    return build(projects["sglang"], *MLA, timeout=2400)


@pytest.fixture(scope="module")
def hf_capture(projects) -> Path:
    """The same rows regenerated and captured by our own engine (the second project)."""
    ranges = [p.stem for p in (projects["sglang"] / "results" / "hidden").glob("rows_*.json")]
    outputs = [f"results/hidden/{r}.safetensors" for r in ranges]
    snakemake(projects["hf"], "--cores", "all", *outputs, timeout=1200)
    return projects["hf"]


def server_records(work: Path, stage: str) -> list[dict]:
    """The server figures each range job of `stage` recorded (regeneration's range reports,
    the shards' manifests)."""
    if stage == "regenerate":
        files = sorted((work / "results" / "data").glob("rows_*.report.json"))
        return [json.loads(f.read_text()) for f in files]
    files = sorted((work / "results" / "hidden").glob("rows_*.json"))
    return [json.loads(f.read_text())["server"] for f in files]


def launches(records: list[dict]) -> int:
    """Server launches behind the jobs' records: a shared server's once (by its host), a job's
    own server each time."""
    hosts = {
        r["server_host_pid"]: r["server_launches"] for r in records if r.get("server_host_pid")
    }
    own = sum(r["server_launches"] for r in records if not r.get("server_host_pid"))
    return own + sum(hosts.values())


def check_served(run: dict, draft_class: str) -> None:
    """SGLang served the wrapper with the draft, every output equal to plain greedy, with our
    engine's acceptance; the draft drafts."""
    report, theirs, ours = run["report"], run["theirs"], run["ours"]
    assert run["draft"]["architectures"] == [draft_class]
    assert report["backend"] == "sglang", report["backend"]
    # SGLang built Kimi-K2.5's own wrapper class, and the draft's
    assert "type=KimiK25ForConditionalGeneration" in run["log"], run["log"][-3000:]
    assert f"type={draft_class}" in run["log"]
    assert theirs["identical_outputs"] == theirs["prompts"] == len(PROMPTS), theirs
    assert ours["identical_outputs"] == len(PROMPTS), ours
    assert ours["tau"] > 1.5 and sum(ours["accept_len_hist"][1:]) >= len(PROMPTS) * 4, ours
    assert_same_acceptance(theirs, ours, draft_class)
    print(
        f"{draft_class}: tau SGLang {theirs['tau']:.4f} hf {ours['tau']:.4f}, passes "
        f"{theirs['verify_passes']} / {ours['verify_passes']}, histogram "
        f"{theirs['accept_len_hist']} / {ours['accept_len_hist']}"
    )


def test_sglang_regenerates_and_captures_the_kimi_checkpoint_as_our_engine(
    projects, llama, hf_capture
):
    from draftsmith.hidden.shards import open_shard
    from draftsmith.targets.model import read_meta

    work = projects["sglang"]
    meta = read_meta(work / "results" / "target")
    assert meta["text_model"]["architectures"] == ["KimiK25ForConditionalGeneration"]
    assert meta["served_config"] == {"language_model_only": True}
    assert meta["tokenizer"], meta  # the tiktoken tokenizer made fast
    for stage in ("regenerate", "capture"):  # one server per stage for its two range jobs
        records = server_records(work, stage)
        assert len(records) == 2 and launches(records) == 1, (stage, records)
        assert sum(r["server_started_by_this_job"] for r in records) == 1, records
        host_logs = list((work / "state" / "servers").glob("*/host.log"))
        assert any("type=KimiK25ForConditionalGeneration" in f.read_text() for f in host_logs)
    rows = sorted((work / "results" / "data").glob("rows_*.jsonl"))
    assert rows
    for f in rows:
        ours = (hf_capture / "results" / "data" / f.name).read_text().splitlines()
        theirs = f.read_text().splitlines()
        assert len(theirs) == len(PROMPTS) // 2 and theirs == ours, f.name
    for f in sorted((work / "results" / "hidden").glob("rows_*.safetensors")):
        hf, sg = open_shard(hf_capture / "results" / "hidden" / f.name), open_shard(f)
        for name in ("input_ids", "loss_mask", "row_offsets"):
            assert torch.equal(getattr(hf, name), getattr(sg, name)), name
        assert sg.manifest["backend"] == "sglang" and hf.manifest["backend"] == "hf"
        assert sg.manifest["aux_layer_ids"] == hf.manifest["aux_layer_ids"] == [1, 2, 3]
        for name, outliers in (("aux_hidden_states", 0), ("last_hidden_states", OUTLIERS)):
            a, b = getattr(hf, name).float(), getattr(sg, name).float()
            off = ~torch.isclose(a, b, rtol=TOLERANCE, atol=TOLERANCE).all(dim=-1)
            worst = float((a - b).abs()[~off].max())
            print(f"{f.name} {name}: max |diff| {worst:.2e} within, {int(off.sum())} tokens off")
            assert int(off.sum()) <= outliers, (name, off.nonzero().flatten().tolist())


def test_llama_draft_through_sglang_on_the_kimi_checkpoint(llama):
    check_served(llama, "LlamaForCausalLMEagle3")


def test_mla_draft_through_sglang_on_the_kimi_checkpoint(mla):
    assert mla["report"]["config"]["draft"]["attention"] == "mla"
    check_served(mla, "Eagle3DeepseekV2ForCausalLM")


def test_the_remote_processor_works_against_the_stages_fast_tokenizer(projects, llama):
    """The checkpoint's processor, loaded as remote code from results/target, wraps the fast
    tokenizer the target stage wrote and exposes what SGLang's Kimi-K2.5 processor reads."""
    from transformers import AutoProcessor, PreTrainedTokenizerFast

    target = projects["sglang"] / "results" / "target"
    proc = AutoProcessor.from_pretrained(target, trust_remote_code=True)
    assert isinstance(proc.tokenizer, PreTrainedTokenizerFast)
    assert proc.media_processor.media_proc_cfg["patch_size"] == 14
    text = "Hello <|media_pad|>"
    assert proc(text=text)["input_ids"] == proc.tokenizer(text)["input_ids"]


def test_sglang_serves_the_checkpoint_as_shipped_through_its_processor(projects, llama):
    """The tiny checkpoint itself (no served config: SGLang builds Kimi-K2.5's multimodal
    processor from the remote processor, whose tokenizer is the remote tiktoken class, with
    --trust-remote-code): the server starts and its greedy replies to the 8 prompts, as token
    ids rendered by our template code, equal transformers' on the same weights."""
    import io

    import requests
    from trained import rows

    from draftsmith.bench.specdec import greedy_generate, prompt_ids
    from draftsmith.data.prompts import prompt_turns
    from draftsmith.engines.server import ServerSpec, Supervisor
    from draftsmith.engines.sglang import cpu as sglang_cpu
    from draftsmith.targets.model import load_target

    python, src = role_python("sglang-cpu"), projects["src"]
    assert "language_model_only" not in json.loads((src / "config.json").read_text())
    model, tok = load_target(projects["sglang"] / "results" / "target", dtype=torch.float32)
    prompts = [prompt_ids(tok, prompt_turns(row)) for row in rows(PROMPTS)]
    n = BENCH["max_new_tokens"]
    with torch.no_grad():
        want = [greedy_generate(model, ids, n, set()) for ids in prompts]

    def command(port: int) -> list[str]:
        return [
            python, "-m", "sglang.launch_server", "--model-path", str(src), "--host",
            "127.0.0.1", "--port", str(port), "--trust-remote-code", *sglang_cpu.LAUNCH_ARGS,
            "--dtype", "float32", *SERVER_ARGS,
        ]  # fmt: skip

    spec = ServerSpec("sglang", command, sglang_cpu.server_env(threads=1), startup_timeout=900)
    log = io.StringIO()
    with Supervisor(spec, retries=0, log_stream=log) as sup:
        params = {"max_new_tokens": n, "temperature": 0, "ignore_eos": True}
        got = [
            requests.post(
                f"{sup.url}/generate",
                json={"input_ids": ids, "sampling_params": params},
                timeout=600,
            ).json()["output_ids"]
            for ids in prompts
        ]
    text = log.getvalue()
    assert "type=KimiK25ForConditionalGeneration" in text, text[-3000:]
    assert "Multimodal processor" in text, text[-3000:]  # the processor was built
    assert got == want


def test_a_targeted_rebuild_of_one_shard_starts_one_server(projects, mla):
    """`snakemake results/hidden/<range>.safetensors` after the shard is deleted: one server
    launch, that shard captured again (equal states), the other range untouched."""
    from draftsmith.hidden.shards import open_shard

    work = projects["sglang"]
    shards = sorted((work / "results" / "hidden").glob("rows_*.safetensors"))
    assert len(shards) == 2
    gone, kept = shards
    before = open_shard(gone).aux_hidden_states.clone()
    kept_mtime = kept.stat().st_mtime_ns
    gone.unlink()
    snakemake(work, "--cores", "all", f"results/hidden/{gone.name}", timeout=1200)
    record = json.loads(gone.with_suffix(".json").read_text())["server"]
    assert record["server_started_by_this_job"] and record["server_launches"] == 1, record
    assert kept.stat().st_mtime_ns == kept_mtime
    assert torch.equal(open_shard(gone).aux_hidden_states, before)
