"""The GPU presets in config/: each passes `snakemake -n` against a target directory holding only
a config and tokenizer files written here (no weights), and the dry run prints the shards' disk
estimate."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]

KIMI_CONFIG = {
    "architectures": ["KimiK25ForConditionalGeneration"],
    "model_type": "kimi_k25",
    "auto_map": {"AutoConfig": "configuration_kimi_k25.KimiK25Config"},
    "text_config": {
        "model_type": "deepseek_v3",
        "architectures": ["DeepseekV3ForCausalLM"],
        "hidden_size": 7168,
        "intermediate_size": 18432,
        "moe_intermediate_size": 2048,
        "num_hidden_layers": 61,
        "num_attention_heads": 64,
        "num_key_value_heads": 64,
        "n_routed_experts": 384,
        "n_shared_experts": 1,
        "num_experts_per_tok": 8,
        "first_k_dense_replace": 1,
        "kv_lora_rank": 512,
        "q_lora_rank": 1536,
        "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 64,
        "v_head_dim": 128,
        "vocab_size": 163840,
        "max_position_embeddings": 262144,
        "rms_norm_eps": 1e-5,
    },
    "vision_config": {"model_type": "moonvit"},
}
LLAMA_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "vocab_size": 128256,
    "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
}


def kimi_dir(path: Path) -> Path:
    """Kimi-K2.5's config.json layout with its published values, and a tiny tokenizer laid out
    as Kimi's (tiktoken rank file, remote-code class, reserved specials; no tokenizer.json)."""
    from draftsmith.targets.tinymodel import write_tiktoken_tokenizer

    path.mkdir()
    (path / "config.json").write_text(json.dumps(KIMI_CONFIG))
    write_tiktoken_tokenizer(path)
    assert not (path / "tokenizer.json").exists()
    return path


def llama_dir(path: Path) -> Path:
    from draftsmith.targets.tinymodel import make_tokenizer

    path.mkdir()
    (path / "config.json").write_text(json.dumps(LLAMA_CONFIG))
    make_tokenizer().save_pretrained(path)
    return path


@pytest.mark.slow
@pytest.mark.workflow
@pytest.mark.parametrize(
    "preset, make, bytes_per_token, ids",
    [
        ("kimi-k25-sglang.yaml", kimi_dir, 4 * 7168 * 2 + 9, "auto"),
        ("llama31-8b-sglang.yaml", llama_dir, 4 * 4096 * 2 + 9, "auto"),
    ],
)
def test_preset_dry_run_prints_plan_disk_estimate_and_gpu_layout(
    tmp_path, preset, make, bytes_per_token, ids
):
    target = make(tmp_path / "model")
    assert not list(target.glob("*.safetensors"))
    preset_cfg = yaml.safe_load((ROOT / "config" / preset).read_text())
    assert preset_cfg["capture"]["backend"] == "sglang"
    assert preset_cfg["capture"]["aux_layer_ids"] == ids
    assert preset_cfg["draft"]["vocab_size"] == 32000 and preset_cfg["data"]["max_length"] == 2048
    proc = dry_run(tmp_path, preset, {"target": {**preset_cfg["target"], "path": str(target)}})
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    line = next(ln for ln in out.splitlines() if "hidden-state shards (upper bound" in ln)
    assert f"x {bytes_per_token} B/token" in line or f"x {bytes_per_token + 1} B/token" in line
    # the plan: every stage's jobs, the capture on the patched SGLang
    for rule in ("target_model", "regenerate", "tokenize", "capture", "train", "bench"):
        assert f"rule {rule}" in out, rule
    assert "rule patch_sglang" in out
    layout = next(ln for ln in out.splitlines() if ln.startswith("GPU layout"))
    n = preset_cfg["sglang"]["tp_size"]
    assert n == preset_cfg["train"]["nproc"] == preset_cfg["envs"]["sglang"]["gpus"]
    server = f"(sglang: one SGLang server, sglang.tp_size {n})"
    procs = "8 training processes" if n == 8 else "1 training process"
    assert layout == (
        f"GPU layout, GPUs per job: regenerate {n} {server}; capture {n} {server}; train {n} "
        f"(sglang: {procs} per node, train.nproc); bench {n} {server}; per node: "
        f"envs.sglang.gpus {n} (jobs whose GPUs fill the node run one at a time)"
    )


def dry_run(tmp_path: Path, preset: str, override: dict) -> subprocess.CompletedProcess:
    over = tmp_path / "override.yaml"
    over.write_text(yaml.safe_dump(override))
    work = tmp_path / "work"
    work.mkdir(exist_ok=True)
    return subprocess.run(
        [sys.executable, "-m", "snakemake", "-n", "-s", str(ROOT / "Snakefile"),
         "--directory", str(work), "--configfile", str(ROOT / "config" / preset), str(over)],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip


@pytest.mark.slow
@pytest.mark.workflow
def test_kimi_dry_run_refuses_ids_sglang_reads_as_other_layers(tmp_path):
    """[2, 30, 58] (vLLM's numbering of the preset's layers, a likely slip) would make SGLang's
    DeepSeek model file capture the inputs of layers 2, 30, 58 while training stores 3, 31, 59:
    refused when the workflow is parsed, before anything runs."""
    preset_cfg = yaml.safe_load((ROOT / "config" / "kimi-k25-sglang.yaml").read_text())
    target = kimi_dir(tmp_path / "model")
    override = {
        "target": {**preset_cfg["target"], "path": str(target)},
        "capture": {**preset_cfg["capture"], "aux_layer_ids": [2, 30, 58]},
    }
    proc = dry_run(tmp_path, "kimi-k25-sglang.yaml", override)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert "capture.aux_layer_ids:" in out and "deepseek_v2.py" in out, out[-3000:]
    assert "KimiK25ForConditionalGeneration -> DeepseekV3ForCausalLM" in out
    assert "use capture.aux_layer_ids [1, 30, 58]" in out


@pytest.mark.slow
@pytest.mark.workflow
def test_kimi_preset_plans_every_stage_on_sglang_for_the_tiny_checkpoint(tmp_path):
    """The preset with only target.path set, on the tiny Kimi-K2.5-shaped checkpoint
    (tinymodel --wrap kimi_k25 --tokenizer tiktoken, 5 layers): the dry run plans every stage,
    regeneration, capture (the patched server) and the benchmark on SGLang, with no manual
    step; `auto` gives the 5-layer DeepSeek class ids SGLang reads as trained ([1, 2, 3])."""
    from draftsmith.targets.layerids import resolve_setting
    from draftsmith.targets.tinymodel import make_tiny_target

    src = make_tiny_target(
        tmp_path / "model", "deepseek_v3", num_layers=5, wrap="kimi_k25", tokenizer_kind="tiktoken"
    )
    preset_cfg = yaml.safe_load((ROOT / "config" / "kimi-k25-sglang.yaml").read_text())
    proc = dry_run(
        tmp_path, "kimi-k25-sglang.yaml", {"target": {**preset_cfg["target"], "path": str(src)}}
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    for rule in (
        "target_model",
        "patch_sglang",
        "regenerate",
        "tokenize",
        "capture",
        "train",
        "bench",
    ):
        assert f"rule {rule}" in out, rule
    for stage in ("regenerate", "capture", "bench"):
        assert preset_cfg[stage]["backend"] == "sglang", stage
    assert resolve_setting("auto", json.loads((src / "config.json").read_text())) == [1, 2, 3]


def _leaves(d: dict, prefix: str = "") -> set[str]:
    out: set[str] = set()
    for k, v in d.items():
        key = f"{prefix}{k}"
        out |= _leaves(v, key + ".") if isinstance(v, dict) else {key}
    return out


def test_embedded_sglang_changes_only_the_engines():
    """config/embedded-sglang.yaml is the embedded default with SGLang engines: no data, draft,
    training or benchmark-size key may differ, or its figures stop comparing with the hf run's
    prompt for prompt (a full copy of the default once drifted to another data split)."""
    cfg = yaml.safe_load((ROOT / "config" / "embedded-sglang.yaml").read_text())
    engine_keys = {
        "envs.sglang-cpu.python",
        "envs.sglang-cpu.gpus",
        "regenerate.backend",
        "regenerate.role",
        "capture.backend",
        "capture.role",
        "bench.backend",
        "bench.role",
        "bench.topk",
    }
    leaves = _leaves(cfg)
    extra = {k for k in leaves - engine_keys if not k.startswith("sglang.")}
    assert not extra, f"config/embedded-sglang.yaml sets non-engine keys: {sorted(extra)}"
    assert {"regenerate.backend", "capture.backend", "bench.backend"} <= leaves
