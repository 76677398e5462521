"""The real Snakefile on a tiny Kimi-K2.5-shaped target, end to end through vLLM's CPU build
: `snakemake --cores all` builds the draft (target_model, regenerate and capture with
the hf engine, vocab, train, export) and benchmarks it with `bench.backend: vllm`, once with the
Llama-style draft and once with the MLA draft (`--config 'draft={"attention": "mla"}'`, which
re-plans only train, whose job exports, and bench). For each: the bench report's outputs equal
plain greedy on every prompt, and vLLM's acceptance (passes, accepted-length histogram, tau)
equals our in-process hf engine's on the same prompts and draft
(trained.assert_same_acceptance), which also shows vLLM fed the draft the layers training
stored.

The target: a tiny DeepSeek-V3 with the shapes vLLM's CPU MLA kernels take (kv_lora_rank 512,
qk_rope_head_dim 64, YaRN, the MoE keys; `tinymodel --engine-shapes`), wrapped as Kimi-K2.5
ships it (`KimiK25ForConditionalGeneration`, `text_config`, weights under `language_model.`,
preprocessor_config.json; `tinymodel.wrap_target`). Its weights are scaled so that its greedy
output depends on the context, and its lm_head answers only with tokens whose text tokenizes
back to the same ids (round_trip_target): the workflow trains on the regenerated *text*, and a
random target's tokens mostly do not survive decode and re-encode (partial UTF-8 bytes, BPE
merges), which leaves a draft nothing to learn. The data are the benchmark's 8 prompts, so a
few epochs teach the draft the target's replies: it must draft (tau well above 1) for the
equality to prove anything.

CI (.ci/run's vLLM step) runs the two vLLM builds, 2-4 minutes on 2 cores. The same workflow
through SGLang (regenerate, capture and bench on its CPU server, both draft kinds) is
tests/test_workflow_kimi_sglang.py.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from roles import role_python
from trained import PROMPTS, assert_same_acceptance, run_bench
from wf import planned_jobs, snakemake, tiny_config, write_config

pytestmark = [pytest.mark.slow, pytest.mark.workflow]

IDS = [1, 2, 3]  # a 5-layer DeepSeek-V3: ids starting at 1 (docs/kimi.md, "Layer ids")
BENCH = {"num_steps": 3, "max_new_tokens": 24}
MLA = ("--config", 'draft={"attention": "mla"}')
# one ASCII punctuation character: a pre-token of its own or a run of them, never merged with
# a letter, a digit or whitespace by the byte-level BPE pre-tokenizer, and not stripped
PUNCT = re.compile(r"[!-/:-@\[-`{-~]")


def round_trip_tokens(tok, n: int | None = None) -> list[int]:
    """Ids below `n` (default: all of `tok`'s) of single ASCII punctuation tokens that no BPE
    merge joins with each other: any sequence of them decodes to a text that encodes back to
    the same ids."""
    ids = [i for i in range(len(tok) if n is None else n) if PUNCT.fullmatch(tok.decode([i]))]
    joined = {
        a
        for a in ids
        for b in ids
        if tok.encode(tok.decode([a, b]), add_special_tokens=False) != [a, b]
    }
    return [i for i in ids if i not in joined]


def round_trip_target(path: Path) -> Path:
    """The tiny DeepSeek-V3 of the module docstring, unwrapped: every other lm_head row is
    zero, a logit of 0 that the largest of the ~30 random kept logits beats (so no stop token
    either: every reply runs to max_new_tokens)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from draftsmith.targets.tinymodel import make_tiny_target

    make_tiny_target(path, "deepseek_v3", num_layers=5, hidden_size=128, engine_shapes=True)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    answer_only_with(model, round_trip_tokens(AutoTokenizer.from_pretrained(path)))
    model.save_pretrained(path)
    return path


def answer_only_with(model, keep: list[int]) -> None:
    """Weights doubled (greedy output then depends on the context, tests/trained.py) and every
    lm_head row but `keep`'s zeroed, in place."""
    assert len(keep) >= 24, keep
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.mul_(2.0)
        dropped = torch.ones(model.config.vocab_size, dtype=torch.bool)
        dropped[keep] = False
        model.lm_head.weight[dropped] = 0.0


def config(src: Path, prompts: Path, python: str) -> dict:
    """The tiny workflow config: the prompts as the only data source and as the benchmark set,
    the draft trained on the target's replies to them, benchmarked through vLLM."""
    train = {"ttt_steps": 3, "epochs": 24, "lr": 0.003, "warmup_ratio": 0.05}
    train.update(batch_tokens=256, checkpoint_seconds=0, precision="fp32")
    bench = {**BENCH, "backend": "vllm", "role": "vllm-cpu", "tau_floor": 1.5}
    bench.update(heldout_size=0, humaneval_size=0)
    bench["files"] = [{"name": "prompts", "path": str(prompts), "format": "prompt"}]
    cfg = tiny_config(
        src,
        data={
            "sources": [{"format": "prompt", "path": str(prompts)}],
            "heldout_rows": 0,
            "rows_per_shard": len(PROMPTS),
            "max_length": 160,
        },
        regenerate={"max_new_tokens": BENCH["max_new_tokens"], "batch_size": len(PROMPTS)},
        capture={"dtype": "float32", "batch_tokens": 2048, "aux_layer_ids": IDS},
        draft={"vocab_size": 64},
        train=train,
        bench=bench,
    )
    cfg["envs"] = {"cpu": {"python": ""}, "vllm-cpu": {"python": python}}
    return cfg


def build(work: Path, *args: str, timeout: int = 900) -> dict:
    """`snakemake --cores all` with `args`; the report's set (the engine's figures), the bench
    log, and the hf engine's figures on the same prompts and draft (read now: a later build
    replaces both)."""
    snakemake(work, "--cores", "all", *args, timeout=timeout)
    report = json.loads((work / "results" / "bench" / "report.json").read_text())
    ours = run_bench(work, "hf", "results/draft", {"bench": BENCH, "target": {}})["res"]["s"]
    return {
        "report": report,
        "theirs": report["sets"]["prompts"],
        "ours": ours,
        "log": (work / "logs" / "bench" / "bench.log").read_text(),
        "draft": json.loads((work / "results" / "draft" / "config.json").read_text()),
    }


@pytest.fixture(scope="module")
def project(tmp_path_factory) -> Path:
    python = role_python("vllm-cpu")  # first: a missing role skips (or fails) at once
    from draftsmith.targets.tinymodel import wrap_target

    root = tmp_path_factory.mktemp("kimi_vllm")
    plain = round_trip_target(root / "plain")
    src = wrap_target(shutil.copytree(plain, root / "src"), "kimi_k25")
    prompts = root / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    write_config(root / "run", config(src, prompts, python))
    return root / "run"


@pytest.fixture(scope="module")
def llama(project) -> dict:
    return build(project)


@pytest.fixture(scope="module")
def mla(project, llama) -> dict:
    """The MLA draft on the same project, after the Llama-style build: only train (which
    exports) and bench are planned again, the target, shards and vocabulary are reused."""
    jobs = planned_jobs(project, args=MLA)
    jobs.pop("all", None)
    assert jobs == {"train": 1, "bench": 1}, jobs
    return build(project, *MLA)


def check_served(run: dict, draft_class: str) -> None:
    """vLLM served the wrapper (its text model) with the draft on the layers training stored,
    every output equal to plain greedy, with our engine's acceptance; the draft drafts."""
    report, theirs, ours, log = run["report"], run["theirs"], run["ours"], run["log"]
    assert run["draft"]["architectures"] == [draft_class]
    assert report["backend"] == "vllm" and report["vllm_aux_layer_ids"] == [i + 1 for i in IDS]
    assert "Resolved architecture: KimiK25ForConditionalGeneration" in log, log[-3000:]
    assert f"Resolved architecture: {draft_class}" in log
    assert "Using CPU_MLA backend." in log
    assert "Using auxiliary layers from speculative config: (2, 3, 4)" in log
    assert theirs["identical_outputs"] == theirs["prompts"] == len(PROMPTS), theirs
    assert ours["identical_outputs"] == len(PROMPTS), ours
    assert ours["tau"] > 1.5 and sum(ours["accept_len_hist"][1:]) >= len(PROMPTS) * 4, ours
    assert_same_acceptance(theirs, ours, draft_class)
    print(
        f"{draft_class}: tau vLLM {theirs['tau']:.4f} hf {ours['tau']:.4f}, passes "
        f"{theirs['verify_passes']} / {ours['verify_passes']}, histogram "
        f"{theirs['accept_len_hist']} / {ours['accept_len_hist']}"
    )


@pytest.mark.vllm
def test_llama_draft_through_vllm_on_the_kimi_wrapped_target(project, llama):
    from draftsmith.targets.model import read_meta

    meta = read_meta(project / "results" / "target")
    assert meta["text_model"]["architectures"] == ["KimiK25ForConditionalGeneration"]
    assert meta["text_model"]["prefix"] == "language_model.model."
    check_served(llama, "LlamaForCausalLMEagle3")


@pytest.mark.vllm
def test_mla_draft_through_vllm_on_the_kimi_wrapped_target(mla):
    assert mla["report"]["config"]["draft"]["attention"] == "mla"
    check_served(mla, "Eagle3DeepseekV2ForCausalLM")
