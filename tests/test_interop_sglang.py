"""SGLang (role sglang-cpu: the real sglang 0.5.23 server on CPU) reads the layers it should from
`results/draft`, the same directory vLLM serves.

The export carries two numberings of the same aux layers: `eagle_config` (SGLang's, it adds 1)
and a top-level key (vLLM's = SGLang + 1, which SGLang must ignore). A draft trained by our
own pipeline gives SGLang exactly our engine's acceptance (same passes, histogram, tau,
outputs): had SGLang taken the top-level ids, its states would be one layer late.
"""

from __future__ import annotations

import json

import pytest
from roles import role_python
from trained import IDS, PROMPTS, assert_same_acceptance, run_bench, train_tiny_project

pytestmark = [pytest.mark.slow, pytest.mark.sglang]

BENCH = {
    "role": "sglang-cpu",
    "num_steps": 3,
    "topk": 1,
    "num_draft_tokens": 0,
    "concurrency": 1,
    "max_new_tokens": 32,
    "tau_floor": 1.0,
}
SGLANG = {
    "tp_size": 1,
    "extra_args": [],
    "port": 0,
    "startup_timeout": 900,
    "request_timeout": 1800,
    "retries": 2,
}


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    return train_tiny_project(tmp_path_factory.mktemp("sglang_proj"))


def test_sglang_acceptance_equals_ours_from_results_draft(trained):
    python = role_python("sglang-cpu")
    cfg = json.loads((trained / "results" / "draft" / "config.json").read_text())
    assert cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == IDS
    assert cfg["eagle_aux_hidden_state_layer_ids"] == [i + 1 for i in IDS]
    ours = run_bench(trained, "hf", "results/draft", {"bench": BENCH, "target": {}})["res"]["s"]
    assert ours["tau"] > 1.05 and sum(ours["accept_len_hist"][1:]) >= 10, ours
    full = {"bench": BENCH, "sglang": SGLANG, "target": {"dtype": "float32"}}
    theirs = run_bench(trained, "sglang", "results/draft", full, python)["res"]["s"]
    assert_same_acceptance(theirs, ours, "sglang")
    assert theirs["identical_outputs"] == len(PROMPTS)
    print(f"tau: ours {ours['tau']:.4f}, SGLang {theirs['tau']:.4f}")
