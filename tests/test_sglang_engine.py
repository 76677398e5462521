"""The sglang engine's pure parts (no server): launch commands per role, EAGLE-3 flags, the
figures computed from SGLang's counters, and run settings kept out of the rules' params.

The engine against the real SGLang server: tests/test_sglang.py (marked slow + sglang)."""

from __future__ import annotations

import dataclasses
import json
import sys

import pytest

from draftsmith import algorithms
from draftsmith.bench.figures import set_figures
from draftsmith.config import settings
from draftsmith.engines import implements
from draftsmith.engines.sglang import engine as eng
from draftsmith.engines.sglang.server import server_spec
from draftsmith.runtime.files import merge_run

SGLANG = {"tp_size": 2, "extra_args": ["--max-total-tokens", "4096"], "port": 0}
RUN = {"startup_timeout": 60, "request_timeout": 60, "retries": 1}


def cfg(role: str) -> settings.JobSettings:
    """A regenerate job's typed settings (the engine seam's), with the sglang engine's section."""
    given = {
        "regenerate": {"role": role, "backend": "sglang"},
        "sglang": {**SGLANG, **RUN},
        "target": {"dtype": "float32"},
    }
    return settings.stage_job(given, "regenerate")


def test_the_engine_gets_its_section_typed_with_the_run_settings():
    s = cfg("sglang").engine
    assert isinstance(s, settings.SGLangSettings)
    assert {k: settings.plain(getattr(s, k)) for k in {**SGLANG, **RUN}} == {**SGLANG, **RUN}
    assert s.idle_timeout == 3600 and s.shared_server == "auto"  # not given: the schema's
    with pytest.raises(SystemExit, match="--cfg has no 'sglang' section"):
        settings.stage_job({"regenerate": {"backend": "sglang"}}, "regenerate", absent=("target",))


def test_sglang_implements_regenerate_and_bench():
    assert set(implements("sglang")) >= {"regenerate", "bench"}


def test_gpu_role_launches_stock_sglang(tmp_path, monkeypatch):
    monkeypatch.delitem(sys.modules, "draftsmith.engines.sglang.cpu", raising=False)
    spec = server_spec(cfg("sglang"), "regenerate", target=tmp_path, threads=4)
    argv = spec.command(12345)
    assert argv[:3] == [sys.executable, "-m", "sglang.launch_server"]
    assert argv[argv.index("--port") + 1] == "12345" and "127.0.0.1" in argv
    assert argv[argv.index("--tp-size") + 1] == "2"
    assert argv[-2:] == ["--max-total-tokens", "4096"]
    assert "--device" not in argv and "--dtype" not in argv  # the checkpoint's dtype on GPUs
    assert "SGLANG_USE_CPU_ENGINE" not in spec.env and "PYTHONPATH" not in spec.env
    assert "draftsmith.engines.sglang.cpu" not in sys.modules  # never imported for a GPU role


def test_pythonpath_entries_go_first(tmp_path, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", "/somewhere")
    spec = server_spec(
        cfg("sglang"), "regenerate", target=tmp_path, threads=1, pythonpath=["/overlay"]
    )
    assert spec.env["PYTHONPATH"] == "/overlay:/somewhere"


def test_cpu_role_gets_the_compatibility_layer(tmp_path):
    spec = server_spec(cfg("sglang-cpu"), "regenerate", target=tmp_path, threads=2)  # tp 2
    argv = spec.command(1)
    assert spec.env["SGLANG_USE_CPU_ENGINE"] == "1"
    assert spec.env["PYTHONPATH"].split(":")[0].endswith("draftsmith/engines/sglang/cpu/overlay")
    assert argv[argv.index("--device") + 1] == "cpu"
    assert argv[argv.index("--dtype") + 1] == "float32"


def test_speculative_args(tmp_path):
    """The flags from bench settings, the algorithm's from the draft's spec (the name its
    config.json records, opened once: algorithms.open_draft); a draft SGLang cannot serve is
    refused naming why."""
    bench = settings.section("bench", {"num_steps": 3, "topk": 1, "num_draft_tokens": 0})
    draft = tmp_path / "results" / "draft"
    draft.mkdir(parents=True)
    (draft / "config.json").write_text('{"architectures": ["LlamaForCausalLMEagle3"]}')
    spec = algorithms.open_draft(draft).spec
    args = eng.speculative_args(bench, draft, spec)
    flags = dict(zip(args[::2], args[1::2], strict=True))
    assert flags["--speculative-algorithm"] == "EAGLE3"
    assert flags["--speculative-draft-model-path"].endswith("results/draft")
    assert (flags["--speculative-num-steps"], flags["--speculative-eagle-topk"]) == ("3", "1")
    assert flags["--speculative-num-draft-tokens"] == "4"  # a chain: K + 1
    with pytest.raises(SystemExit, match="num_draft_tokens"):
        eng.speculative_args(dataclasses.replace(bench, topk=2), draft, spec)
    tree = eng.speculative_args(dataclasses.replace(bench, topk=2, num_draft_tokens=6), draft, spec)
    assert tree[tree.index("--speculative-num-draft-tokens") + 1] == "6"
    (draft / "config.json").write_text('{"draftsmith_algorithm": "dflash"}')
    with pytest.raises(SystemExit, match="refuses DFLASH on CPU"):
        eng.speculative_args(bench, draft, algorithms.open_draft(draft).spec)


def test_cut_at_stop():
    assert eng.cut_at_stop([5, 6, 2, 7], {2}) == ([5, 6, 2], True)
    assert eng.cut_at_stop([5, 6], {2}) == ([5, 6], False)


def answer(ids, verify=0, hist=None, latency=0.5):
    """An answer as the engine's `send` returns it: SGLang's JSON plus the request's seconds."""
    meta = {"completion_tokens": len(ids)}
    if verify:
        meta.update(spec_verify_ct=verify, spec_correct_drafts_histogram=hist)
    return {"output_ids": ids, "meta_info": meta, "latency": latency}


def test_set_figures_from_sglang_counters():
    """Two prompts, K = 3: the SGLang count, our tau (prefill token excluded), per position."""
    base = {"answers": [answer([1, 2, 3, 4, 5, 9]), answer([7, 8, 9])], "seconds": 3.0}
    spec = {
        "answers": [
            # prefill token 1; passes accepting 3 (4 tokens) and 0 (1 token)
            answer([1, 2, 3, 4, 5, 9], verify=2, hist=[1, 0, 0, 1]),
            # differs from the baseline at index 1; passes accepting 1, 0
            answer([7, 6, 9], verify=2, hist=[1, 1]),
        ],
        "seconds": 1.5,
        "server_accept_length": 2.0,
    }
    raw = eng.set_measurements([[0] * 10, [0] * 20], ["a", "b"], base, spec, {9}, 3)
    r = set_figures(raw)  # what the bench stage computes from the engine's measurements
    assert r["accept_len_hist"] == [2, 1, 0, 1] and r["verify_passes"] == 4
    assert r["tau_sglang"] == pytest.approx(9 / 4)  # sum(completion) / sum(spec_verify_ct)
    assert r["tau"] == pytest.approx(7 / 4)  # each prompt's first token is the prefill's
    assert r["accept_rate_by_pos"] == pytest.approx([2 / 4, 1 / 2, 1.0])
    assert r["accept_length"] == pytest.approx((2 * 1 + 1 * 2 + 1 * 4) / 4)
    assert r["identical_outputs"] == 1
    assert r["differing_outputs"] == [{"id": "b", "first_difference_at": 1}]
    assert r["speedup"] == pytest.approx((9 / 1.5) / (9 / 3.0))
    assert r["speedup"] == pytest.approx(r["tau_sglang"] / r["pass_cost"])
    assert r["mean_prompt_tokens"] == 15


def test_set_figures_refuse_inconsistent_counters():
    base = {"answers": [answer([1, 9])], "seconds": 1.0}
    spec = {"answers": [answer([1, 9], verify=2, hist=[1])], "seconds": 1.0}
    spec["server_accept_length"] = None
    raw = eng.set_measurements([[0]], ["a"], base, spec, {9}, 3)
    with pytest.raises(ValueError, match=r"histogram \[1, 0, 0, 0\] does not count its 2 verif"):
        set_figures(raw)


def test_run_settings_merge(monkeypatch):
    monkeypatch.setenv("DRAFTSMITH_RUN", json.dumps({"sglang": {"port": 8123}}))
    merged = merge_run({"sglang": {"tp_size": 1}})
    assert merged == {"sglang": {"tp_size": 1, "port": 8123}}
    assert merge_run({}, '{"sglang": {"retries": 0}}') == {"sglang": {"retries": 0}}


@pytest.mark.workflow
def test_rules_keep_run_settings_out_of_params(tmp_path, tiny_target):
    """tp_size and extra_args are params of the sglang jobs (a change reruns them); the port,
    timeouts and retries reach the jobs through DRAFTSMITH_RUN instead (a change reruns nothing)."""
    from wf import snakemake, tiny_config, write_config

    cfg = tiny_config(
        tiny_target,
        regenerate={"backend": "sglang", "role": "sglang"},
        bench={"backend": "sglang", "role": "sglang"},
        sglang={"port": 8123, "extra_args": ["--flag-x"], "retries": 5},
    )
    cfg["envs"] = {"cpu": {"python": ""}, "sglang": {"python": sys.executable}}
    write_config(tmp_path, cfg)
    out = snakemake(tmp_path, "-n", "-p").stdout
    commands = [line for line in out.splitlines() if "-m draftsmith " in line]
    for command in ("regenerate", "bench"):
        cmd = next(c for c in commands if f"-m draftsmith {command} " in c)
        assert '"extra_args": ["--flag-x"]' in cmd and '"tp_size": 1' in cmd, cmd
        assert "8123" not in cmd and "retries" not in cmd, cmd
