"""The real SGLang 0.5.23 server on CPU (role sglang-cpu, compatibility layer on).

Needs DRAFTSMITH_PYTHON_SGLANG_CPU (the role's venv); skips without it unless
DRAFTSMITH_REQUIRE_ENGINES=1. Every server runs under draftsmith.engines.server.Supervisor, which stops
its whole process group; each test checks that no process of it is left.

The speculative checks compare float32 EAGLE3 output with plain greedy output of the same
server build on the same prompts (6 at once, so verification runs batched). Drafts are exported
by draftsmith.algorithms.export: a "constant" draft (final norm zeroed, so every position's draft logits
tie and the draft proposes its first vocabulary entries, mapped through d2t onto the two tokens
the target emits most) gets many drafts accepted, which drives the accept paths (bonus tokens,
accepted cache slots, KV moves); a random draft with topk 4 drives wide trees that are rejected.
"""

from __future__ import annotations

import json
import os
import subprocess
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from roles import role_python
from wf import ROOT

from draftsmith.algorithms.eagle3.model import DraftConfig, Eagle3Draft
from draftsmith.algorithms.export import export_draft, target_embedding, verifier_ref
from draftsmith.engines.server import ServerSpec, Supervisor, http_json, server_processes
from draftsmith.engines.sglang.cpu import LAUNCH_ARGS, OVERLAY, server_env
from draftsmith.stages.env import check
from draftsmith.targets.tinymodel import make_tiny_target

pytestmark = [pytest.mark.slow, pytest.mark.sglang]

ROLE = "sglang-cpu"
PROMPTS = [
    "The quick brown fox",
    "def add(a, b):",
    "What is the capital of France?",
    "1 + 1 = 2, 2 * 3 =",
    "Sure! Here is",
    "Translate 'good morning'",
]
NEW_TOKENS = 32
AUX_IDS = [1, 3, 4]  # auto for 8 layers; SGLang captures each layer id once, so ids must differ


@pytest.fixture(scope="module")
def python() -> str:
    return role_python(ROLE)


@pytest.fixture(scope="module")
def target(tmp_path_factory) -> Path:
    return make_tiny_target(tmp_path_factory.mktemp("sgl_target") / "model", num_layers=8)


def spec(python: str, model: Path, *extra: str) -> ServerSpec:
    def command(port: int) -> list[str]:
        return [
            python,
            "-m",
            "sglang.launch_server",
            *LAUNCH_ARGS,
            "--model-path",
            str(model),
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--dtype",
            "float32",
            "--max-total-tokens",
            "4096",
            "--mem-fraction-static",
            "0.1",
            *extra,
        ]

    return ServerSpec(name="sglang-cpu", command=command, env=server_env({}), startup_timeout=900)


def generate(url: str) -> list[dict]:
    def one(prompt: str) -> dict:
        sampling = {"max_new_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True}
        return http_json(url + "/generate", {"text": prompt, "sampling_params": sampling}, 600)

    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        return list(pool.map(one, PROMPTS))


def serve(python: str, model: Path, *extra: str) -> list[dict]:
    """Launch, answer every prompt, stop; asserts nothing of the server survives."""
    with Supervisor(spec(python, model, *extra), retries=0) as sup:
        out = generate(sup.url)
    assert server_processes(sup.tag) == []
    return out


def export(target: Path, out: Path, hot: list[int], constant: bool) -> Path:
    cfg = json.loads((target / "config.json").read_text())
    vocab = cfg["vocab_size"]
    draft = Eagle3Draft(DraftConfig.from_target_config(cfg, len(hot), AUX_IDS))
    torch.manual_seed(1)
    with torch.no_grad():
        for p in draft.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.08)
        if constant:
            draft.norm.weight.zero_()
    ids = torch.tensor(sorted(hot))
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[ids] = True
    draft.set_vocab(ids - torch.arange(len(hot)), t2d)
    export_draft(
        draft,
        out,
        {"test": ROLE},
        embed=target_embedding(target),
        verifier=verifier_ref(target),
    )
    return out


def eagle(draft: Path, steps: int, topk: int, tokens: int) -> list[str]:
    return [
        "--speculative-algorithm",
        "EAGLE3",
        "--speculative-draft-model-path",
        str(draft),
        "--speculative-num-steps",
        str(steps),
        "--speculative-eagle-topk",
        str(topk),
        "--speculative-num-draft-tokens",
        str(tokens),
    ]


def test_validate_env_proves_the_compatibility_layer_is_active(python):
    stamp = check(ROLE, ROOT / "envs" / f"{ROLE}.txt", python, gpus=0)
    info = stamp["sglang_cpu"]
    assert info["problems"] == [] and info["sglang"] == "0.5.23"
    assert Path(info["sgl_kernel"]).parent.parent == OVERLAY
    assert info["is_cpu"] and not info["amx"] and all(info["patched"].values())
    # the same check without the overlay names what is missing
    env = {**os.environ, "SGLANG_USE_CPU_ENGINE": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [python, "-m", "draftsmith", "sglang-selfcheck"], env=env, capture_output=True, text=True
    )
    assert proc.returncode == 1
    problems = json.loads(proc.stdout.strip().splitlines()[-1])["problems"]
    assert any("import failed" in p for p in problems), problems


@pytest.mark.extended(
    reason="proves: SGLang's CPU trees stay lossless at top-k 4 with wide rejected trees of a "
    "random draft and through the accept paths of a constant draft, 6 prompts at once; "
    "no CI-sized version: four server starts, about 6 minutes on 2 cores, each draft's "
    "case needing its own; CI covers the rest: "
    "test_sglang_engine.py::test_speculative_args (the tree flags from bench.topk), "
    "test_served_matrix.py (chains)"
)
def test_eagle3_output_equals_plain_greedy_topk_1_2_4(python, target, tmp_path):
    plain = serve(python, target)
    assert all(len(r["output_ids"]) == NEW_TOKENS for r in plain)
    common = [t for t, _ in Counter(t for r in plain for t in r["output_ids"]).most_common(2)]
    vocab = json.loads((target / "config.json").read_text())["vocab_size"]
    constant = export(target, tmp_path / "constant", common, constant=True)
    random_hot = torch.randperm(vocab, generator=torch.Generator().manual_seed(2))[: vocab // 2]
    random = export(target, tmp_path / "random", random_hot.tolist(), constant=False)
    cases = [
        ("chain topk 1, constant draft", constant, eagle(constant, 3, 1, 4)),
        ("tree topk 2, constant draft", constant, eagle(constant, 3, 2, 6)),
        ("tree topk 4, random draft", random, eagle(random, 2, 4, 8)),
    ]
    for name, draft, args in cases:
        spec_out = serve(python, target, *args)
        for p, a, b in zip(PROMPTS, plain, spec_out, strict=True):
            assert b["output_ids"] == a["output_ids"], (name, p)
        meta = [r["meta_info"] for r in spec_out]
        verify = sum(m["spec_verify_ct"] for m in meta)
        accepted = sum(m["spec_num_correct_drafts"] for m in meta)
        tokens = sum(m["completion_tokens"] for m in meta)
        # a verify pass commits its accepted drafts and one target token (the last pass may be
        # cut by max_new_tokens); the first token of a request comes from prefill
        assert verify + len(PROMPTS) <= tokens <= verify + accepted + len(PROMPTS), name
        if draft == constant:  # the accept paths ran (20 drafts accepted on this target)
            assert accepted >= 10, (name, tokens, verify, accepted)
