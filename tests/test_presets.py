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
KIMI_TEMPLATE = (
    "{% for m in messages %}<|im_{{ m['role'] }}|>{{ m['role'] }}<|im_middle|>"
    "{{ m['content'] }}<|im_end|>{% endfor %}"
    "{% if add_generation_prompt %}<|im_assistant|>assistant<|im_middle|>{% endif %}"
)
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
    path.mkdir()
    (path / "config.json").write_text(json.dumps(KIMI_CONFIG))
    (path / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "auto_map": {"AutoTokenizer": ["tokenization_kimi.TikTokenTokenizer", None]},
                "tokenizer_class": "TikTokenTokenizer",
            }
        )
    )
    (path / "tiktoken.model").write_text("IQ== 0\nIg== 1\n")  # tiktoken's base64 rank format
    (path / "tokenization_kimi.py").write_text("# remote tokenizer code (not run by a dry run)\n")
    (path / "chat_template.jinja").write_text(KIMI_TEMPLATE)
    return path


def llama_dir(path: Path) -> Path:
    from draftsmith.tinymodel import make_tokenizer

    path.mkdir()
    (path / "config.json").write_text(json.dumps(LLAMA_CONFIG))
    make_tokenizer().save_pretrained(path)
    return path


@pytest.mark.slow
@pytest.mark.workflow
@pytest.mark.parametrize(
    "preset, make, bytes_per_token, ids",
    [
        ("kimi-k25-sglang.yaml", kimi_dir, 4 * 7168 * 2 + 9, [1, 29, 57]),
        ("llama31-8b-sglang.yaml", llama_dir, 4 * 4096 * 2 + 9, "auto"),
    ],
)
def test_preset_dry_run_prints_disk_estimate(tmp_path, preset, make, bytes_per_token, ids):
    target = make(tmp_path / "model")
    assert not list(target.glob("*.safetensors"))
    preset_cfg = yaml.safe_load((ROOT / "config" / preset).read_text())
    assert preset_cfg["capture"]["backend"] == "sglang"
    assert preset_cfg["capture"]["aux_layer_ids"] == ids
    assert preset_cfg["draft"]["vocab_size"] == 32000 and preset_cfg["data"]["max_length"] == 2048
    over = tmp_path / "target.yaml"
    over.write_text(yaml.safe_dump({"target": {**preset_cfg["target"], "path": str(target)}}))
    work = tmp_path / "work"
    work.mkdir()
    proc = subprocess.run(
        [sys.executable, "-m", "snakemake", "-n", "-s", str(ROOT / "Snakefile"),
         "--directory", str(work), "--configfile", str(ROOT / "config" / preset), str(over)],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    line = next(ln for ln in out.splitlines() if "hidden-state shards (upper bound" in ln)
    assert f"x {bytes_per_token} B/token" in line or f"x {bytes_per_token + 1} B/token" in line
    assert "rule patch_sglang" in out and "rule capture" in out


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
