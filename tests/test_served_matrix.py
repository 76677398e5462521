"""The served-equality matrix: every algorithm x draft kind x engine cell, served or refused.

The cells come from the algorithm specs (draftsmith.algorithms: each spec's `serving` per engine
and its refused settings) through the same parse-time check the workflow runs
(`algorithms.refusals`), so a cell the table calls served is served here and a cell it refuses
is refused here; nothing is listed by hand.

A served cell: the draft of that algorithm and kind, trained once per test run by our own
pipeline on a tiny target (tests/trained.py; a Llama target for the Llama-style draft, a
DeepSeek-V3 one, MLA and MoE, for the MLA draft), is benchmarked by the engine's bench stage
(the real SGLang CPU server, role sglang-cpu; vLLM's CPU build, role vllm-cpu) and by our
in-process engine on the same prompts: every speculative output equals plain greedy, and the
engine's verification passes, accepted-length histogram and tau equal ours (up to a float32
near-tie: trained.assert_same_acceptance). The control: the same comparison against our engine
with one EAGLE-3.1 switch dropped fails, so equal figures mean the engine applied it.

A refused cell: the workflow refuses the pair at parse time with a message naming the keys,
and where the refusal is the engine's (SGLang 0.5.23 has no DFlash path on CPU), the engine
itself is started and refuses with its own message.

SGLang's tree drafting and sampling, on the Llama-style EAGLE-3 cell's draft (trained here
anyway): one bench stage run, a tree at temperature 0.2, its greedy references our engine's
figures for that draft (test_sglang_sampled_tree_is_sound_and_greedy_past_the_prefill).

Each cell prints one verdict line (`CELL <id>: ...`). .ci/run runs this file on two
pytest-xdist workers, a class per target kind on each (`-n 2 --dist loadscope`:
TestLlamaTarget, TestMlaTarget): each draft is trained once, by the worker that serves it
through both engines, and `-raP` prints the verdict lines of the passed tests.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from roles import role_python
from test_interop_sglang import SGLANG as INTEROP_SGLANG
from test_interop_sglang import server_args
from test_sglang_capture import CPU_SERVER_ARGS
from trained import (
    IDS,
    PROMPTS,
    ROOT,
    assert_same_acceptance,
    assert_sound_counters,
    chain_acceptance,
    run_bench,
    train_tiny_project,
)
from wf import with_defaults

from draftsmith import algorithms

pytestmark = [pytest.mark.slow, pytest.mark.served]

ENGINES = ("sglang", "vllm")
ATTENTIONS = ("llama", "mla")
BENCH = {"num_steps": 3, "max_new_tokens": 32, "tau_floor": 1.0, "topk": 1, "concurrency": 1}
# the bench settings the SGLang cells add: a chain of BENCH's draft tokens, one request at a time
SGLANG_BENCH = {"role": "sglang-cpu", "num_draft_tokens": 0}
# the sglang section: the SGLang tests' server settings, with a KV pool for these prompts, not
# most of the machine's memory (SGLang on CPU sizes it from free memory): CI runs the embedded
# default beside this step
SGLANG = {**INTEROP_SGLANG, "extra_args": CPU_SERVER_ARGS}
# the tiny target each draft kind is trained for (trained.train_tiny_project's target arguments)
TARGETS = {"llama": {}, "mla": {"arch": "deepseek_v3", "engine_shapes": True}}
# draft keys beyond the algorithm's defaults: a one-layer DFlash draft (vLLM's CPU path serves
# one layer exactly as trained) with enough anchors per step to learn the tiny target
DRAFT_KEYS = {"dflash": {"dflash": {"layers": 1, "anchors": 64, "mask_token_id": -1, "decay": 7.0}}}
# the engine's words in its log that it built the draft of this algorithm
ENGINE_SAYS = {
    ("vllm", "dflash", "llama"): "Resolved architecture: DFlashDraftModel",
    ("vllm", "eagle3", "mla"): "Resolved architecture: Eagle3DeepseekV2ForCausalLM",
    ("vllm", "eagle3.1", "mla"): "Resolved architecture: Eagle3DeepseekV2ForCausalLM",
}
# SGLang 0.5.23's platform gate, what it answers `--speculative-algorithm DFLASH` on CPU
SGLANG_DFLASH_REFUSAL = "DFLASH speculative decoding is not supported by CpuSRTPlatform"


def cell_config(algorithm: str, attention: str, engine: str) -> dict:
    """The workflow config of a cell, every other key at the schema's default."""
    return with_defaults(
        {
            "draft": {"algorithm": algorithm, "attention": attention},
            "bench": {"backend": engine},
        }
    )


def cells():
    for algorithm in algorithms.names():
        for attention in ATTENTIONS:
            for engine in ENGINES:
                why = algorithms.refusals(cell_config(algorithm, attention, engine))
                yield pytest.param(
                    algorithm, attention, engine, why, id=f"{algorithm}-{attention}-{engine}"
                )


CELLS = list(cells())
SERVED = [c for c in CELLS if not c.values[3]]
REFUSED = [c for c in CELLS if c.values[3]]
CELL_ARGS = ("algorithm", "attention", "engine", "why")


def served(attention: str) -> list:
    """The served cells of the drafts for one target kind."""
    return [c for c in SERVED if c.values[1] == attention]


class Drafts:
    """Each (algorithm, attention) draft trained at most once per test run, and our engine's
    figures on PROMPTS for it; projects under one session directory."""

    def __init__(self, base: Path):
        self.base = base
        self.projects: dict[tuple[str, str], Path] = {}
        self.ours: dict[tuple[str, str], dict] = {}

    def project(self, algorithm: str, attention: str) -> Path:
        key = (algorithm, attention)
        if key not in self.projects:
            root = self.base / f"{algorithm}-{attention}"
            draft = {
                "algorithm": algorithm,
                "attention": attention,
                **DRAFT_KEYS.get(algorithm, {}),
            }
            # the drafts of one kind share a target and its captured data: made once
            made = [r for (_, a), r in self.projects.items() if a == attention]
            data_from = made[0] if made else None
            self.projects[key] = train_tiny_project(root, draft, data_from, **TARGETS[attention])
        return self.projects[key]

    def figures(self, algorithm: str, attention: str) -> dict:
        """Our engine's figures (the hf bench stage); the draft must really draft, so that
        equal counts tell right aux layers and switches from wrong ones."""
        key = (algorithm, attention)
        if key not in self.ours:
            root = self.project(algorithm, attention)
            cfg = {"bench": BENCH, "target": {"dtype": "float32"}}
            res = run_bench(root, "hf", "results/draft", cfg)["res"]["s"]
            assert res["identical_outputs"] == len(PROMPTS), res
            # tau above 1.05 and at least 10 accepted tokens: equal counts then tell right layers
            # and switches from wrong ones
            accepted = sum(n * count for n, count in enumerate(res["accept_len_hist"]))
            assert res["tau"] > 1.05 and accepted >= 10, res
            self.ours[key] = res
        return self.ours[key]


@pytest.fixture(scope="session")
def drafts(tmp_path_factory):
    return Drafts(tmp_path_factory.mktemp("served"))


# the cells also benchmarked at a second concurrency level (both engines run the levels on one
# server): acceptance must not depend on batching
CONCURRENT = {("eagle3", "llama"): [1, 4]}


def engine_figures(root: Path, engine: str, concurrency=1) -> dict:
    """The engine's bench stage on PROMPTS from `root`'s results/draft: its figures and log."""
    cfg = {"bench": {**BENCH, "concurrency": concurrency}, "target": {"dtype": "float32"}}
    if engine == "sglang":
        cfg = {**cfg, "bench": {**cfg["bench"], **SGLANG_BENCH}, "sglang": SGLANG}
    return run_bench(root, engine, "results/draft", cfg, role_python(f"{engine}-cpu"))


def verdict(cell: str, theirs: dict, ours: dict) -> str:
    return (
        f"CELL {cell}: served, outputs equal greedy {theirs['identical_outputs']}/{len(PROMPTS)}, "
        f"passes {theirs['verify_passes']} (ours {ours['verify_passes']}), histogram "
        f"{theirs['accept_len_hist']} (ours {ours['accept_len_hist']}), tau {theirs['tau']:.4f} "
        f"(ours {ours['tau']:.4f})"
    )


def served_cell(drafts, algorithm: str, attention: str, engine: str) -> None:
    """A served cell: the engine's bench stage on the cell's draft, outputs equal to greedy,
    acceptance equal to our engine's (the module docstring)."""
    cell = f"{algorithm}-{attention}-{engine}"
    ours = drafts.figures(algorithm, attention)
    root = drafts.project(algorithm, attention)
    exported = json.loads((root / "results" / "draft" / "config.json").read_text())
    assert exported[algorithms.ALGORITHM_KEY] == algorithm, exported
    if "eagle_config" in exported:  # SGLang's numbering of the aux ids, and vLLM's (ours + 1)
        assert exported["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == IDS, exported
        assert exported["eagle_aux_hidden_state_layer_ids"] == [i + 1 for i in IDS], exported
    levels = CONCURRENT.get((algorithm, attention), 1)
    run = engine_figures(root, engine, levels)
    theirs = run["res"]["s"]
    if levels != 1:  # every level lossless, and the same outputs at every level
        assert [r["concurrency"] for r in theirs["by_concurrency"]] == levels, theirs
        for r in theirs["by_concurrency"]:
            assert r["identical_to_plain"] == len(PROMPTS), (cell, r)
            assert r["plain_identical_to_first"] == len(PROMPTS), (cell, r)
            assert r["batch_invariant"], (cell, r)
        print(f"CELL {cell}: concurrency {levels}: tau",
              [round(r["tau"], 4) for r in theirs["by_concurrency"]])  # fmt: skip
    if engine == "vllm":  # vLLM's numbering of the aux ids is ours + 1, for every algorithm
        assert run["info"]["vllm_aux_layer_ids"] == [i + 1 for i in IDS], run["info"]
    says = ENGINE_SAYS.get((engine, algorithm, attention))
    assert says is None or says in run["log"], (cell, run["log"][-3000:])
    assert theirs["identical_outputs"] == len(PROMPTS), (cell, theirs)
    assert_same_acceptance(theirs, ours, cell)
    print(verdict(cell, theirs, ours))


@pytest.mark.parametrize(("algorithm", "attention", "engine", "why"), REFUSED)
def test_refused_cell_is_refused_at_parse_naming_keys(algorithm, attention, engine, why):
    cell = f"{algorithm}-{attention}-{engine}"
    text = " ".join(why)
    assert f"draft.algorithm {algorithm}" in text, why
    assert f"bench.backend {engine}" in text or "draft.attention" in text, why
    print(f"CELL {cell}: refused at parse: {text}")


def sglang_dflash_launch(tmp_path: Path) -> tuple[int, str]:
    """SGLang's server started as the bench would start it for a DFlash draft (our CPU launch
    arguments, a tiny target, a DFlash export, `--speculative-algorithm DFLASH`): its exit
    code and output. It must stop by itself; its process group is killed if it does not."""
    import os
    import signal
    import subprocess

    import torch
    from test_algorithms_engines import free_port

    from draftsmith.algorithms.dflash.export import export_draft
    from draftsmith.algorithms.dflash.model import DFlashConfig, DFlashDraft
    from draftsmith.engines.sglang.cpu import LAUNCH_ARGS, server_env
    from draftsmith.targets.tinymodel import make_tiny_target

    target = make_tiny_target(tmp_path / "target", num_layers=4, hidden_size=128)
    tc = json.loads((target / "config.json").read_text())
    torch.manual_seed(0)
    export_draft(DFlashDraft(DFlashConfig.from_target_config(tc, [0, 1, 2], 1, 4, -1)),
                 tmp_path / "draft", {"config": {}})  # fmt: skip
    cmd = [
        role_python("sglang-cpu"), "-m", "sglang.launch_server", "--model-path", str(target),
        "--speculative-algorithm", "DFLASH", "--speculative-draft-model-path",
        str(tmp_path / "draft"), "--speculative-num-draft-tokens", "4",
        "--host", "127.0.0.1", "--port", str(free_port()), *LAUNCH_ARGS,
    ]  # fmt: skip
    proc = subprocess.Popen(
        cmd, env=server_env(threads=1), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True, start_new_session=True,
    )  # fmt: skip
    try:
        out, _ = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    return proc.returncode, out


def test_sglang_refuses_dflash_with_its_own_message(tmp_path):
    """The refused cell dflash-llama-sglang is also SGLang's own refusal: the server started
    with `--speculative-algorithm DFLASH` stops while resolving its arguments, with its
    platform gate's message (a SGLang that lifts the gate fails here: revisit the spec)."""
    assert "dflash-llama-sglang" in [c.id for c in REFUSED]
    code, out = sglang_dflash_launch(tmp_path)
    assert code != 0 and SGLANG_DFLASH_REFUSAL in out, out[-3000:]
    print(f"CELL dflash-llama-sglang: SGLang refuses: {SGLANG_DFLASH_REFUSAL}")


# SGLang's tree drafting and sampling, CI-sized: one bench stage run (SGLang's bench stage always
# starts two servers, a plain and a speculative one) of a tree at temperature 0.2

# bench.topk 2: a tree of 6 draft tokens over BENCH's 3 steps
TREE = {"topk": 2, "num_draft_tokens": 6}
SAMPLED = {"temperature": 0.2, "top_p": 1.0}


# One class per target kind. .ci/run runs this file with `-n 2 --dist loadscope`, which keeps a
# class on one pytest-xdist worker: the drafts of a kind share their target's captured data, and
# each draft is trained once, by the worker that serves it through both engines; the two kinds
# run side by side.


class TestLlamaTarget:
    """The Llama target's drafts: their served cells, the controls and SGLang's sampled tree."""

    @pytest.mark.parametrize(CELL_ARGS, served("llama"))
    def test_served_cell_accepts_as_ours(self, drafts, algorithm, attention, engine, why):
        served_cell(drafts, algorithm, attention, engine)

    @pytest.mark.parametrize("switch", ["fc_norm", "norm_output"])
    def test_control_a_dropped_switch_is_told_apart(self, drafts, switch):
        """The comparison the served cells make fails for a draft missing one EAGLE-3.1 switch:
        our engine decoding the same weights with `switch` dropped (what an engine that ignored
        the key would serve) does not pass assert_same_acceptance against the draft as exported."""
        ours = drafts.figures("eagle3.1", "llama")
        root = drafts.project("eagle3.1", "llama")

        def drop(_model, draft) -> None:
            if switch == "fc_norm":
                draft.project = lambda aux: draft.fc(aux)
            else:
                draft.feedback = lambda out: out

        broken = chain_acceptance(root, BENCH, drop)
        with pytest.raises(AssertionError):
            assert_same_acceptance(broken, ours, f"without {switch}")
        print(f"CELL control eagle3.1 without {switch}: told apart, tau {broken['tau']:.4f} "
              f"(ours {ours['tau']:.4f})")  # fmt: skip

    def test_sglang_sampled_tree_is_sound_and_greedy_past_the_prefill(self, drafts):
        """The eagle3-llama cell's draft through SGLang's bench stage with bench.topk 2 (6 draft
        tokens) at temperature 0.2, PROMPTS, 32 tokens, one request at a time.

        Tree: the speculative server ran a tree (its own resolved arguments as it logs them:
        speculative_eagle_topk 2, speculative_num_draft_tokens 6; SGLang resolves a topk-1 launch
        to a chain of num_steps + 1 tokens). Sampled: the run says it sampled and that SGLang
        0.5.23 verifies greedily on CPU (engines/sglang/engine.py's CPU_GREEDY_VERIFY), and its
        per-request counters are consistent (trained.assert_sound_counters) with a tau over 1.
        Lossless: with greedy verification only the prefill's token is sampled, so every output
        that starts with greedy's first token (our engine's outputs for this draft, which the
        eagle3-llama-sglang cell shows SGLang's plain greedy equal) is greedy's whole: the tree's
        verification committed the target's own tokens. Why 0.2: most outputs start on greedy's
        token, the path the draft was trained on (the same tiny target as
        test_interop_sglang.py::test_sglang_sampling_counters_consistent, whose docstring gives
        its first tokens' probabilities). The extended tests in test_interop_sglang.py run the
        tree at temperature 0 against the plain server's outputs and the sampled chain."""
        from draftsmith.engines.sglang.engine import CPU_GREEDY_VERIFY

        ours = drafts.figures("eagle3", "llama")
        root = drafts.project("eagle3", "llama")
        bench = {**BENCH, **SGLANG_BENCH, **TREE, **SAMPLED}
        cfg = {"bench": bench, "sglang": SGLANG, "target": {"dtype": "float32"}}
        run = run_bench(root, "sglang", "results/draft", cfg, role_python("sglang-cpu"))
        res, info = run["res"]["s"], run["info"]
        logged = server_args(run["log"], "sglang-eagle3")
        assert logged["speculative_eagle_topk"] == "2", logged
        assert logged["speculative_num_draft_tokens"] == "6", logged
        args = info["speculative_args"]
        assert args[args.index("--speculative-eagle-topk") + 1] == "2", args
        assert res["identical_outputs"] is None, res  # sampled: equal in distribution only
        assert info["sampling"]["temperature"] == 0.2, info
        assert info["engine_notes"] == [CPU_GREEDY_VERIFY], info
        assert "sglang==0.5.23\n" in (ROOT / "envs" / "sglang-cpu.txt").read_text(), (
            "another SGLang: check CPU_GREEDY_VERIFY again"
        )
        k = BENCH["num_steps"]
        assert_sound_counters(res, k, len(PROMPTS), BENCH["max_new_tokens"], "sglang sampled tree")
        assert res["tau"] > 1.0, res
        greedy = {p["id"]: p["output_ids"] for p in ours["per_prompt"]}
        on_path = [p for p in res["per_prompt"] if p["output_ids"][:1] == greedy[p["id"]][:1]]
        assert on_path, "no sampled prefill token equal to greedy's: nothing compared"
        for p in on_path:
            assert p["output_ids"] == greedy[p["id"]], (p["id"], p["output_ids"], greedy[p["id"]])
        print(f"CELL sglang tree topk 2 at temperature 0.2: {len(on_path)}/{len(PROMPTS)} outputs "
              f"start on greedy's token and equal greedy; tau {res['tau']:.4f}, passes "
              f"{res['verify_passes']}, histogram {res['accept_len_hist']}")  # fmt: skip


class TestMlaTarget:
    """The DeepSeek-V3 (MLA, MoE) target's drafts: their served cells."""

    @pytest.mark.parametrize(CELL_ARGS, served("mla"))
    def test_served_cell_accepts_as_ours(self, drafts, algorithm, attention, engine, why):
        served_cell(drafts, algorithm, attention, engine)
