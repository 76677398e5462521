"""draftsmith.config.workflow: the rules' helpers as plain functions of a validated config,
which they never change."""

from __future__ import annotations

import copy
import sys

from wf import with_defaults

from draftsmith.config import workflow as wf
from draftsmith.config.checks import execution_keys, load_schema

RUN_KEYS = execution_keys(load_schema())


def gpu_config(**envs):
    cfg = with_defaults(
        {
            "capture": {"backend": "sglang", "role": "sglang"},
            "bench": {"backend": "sglang", "role": "sglang"},
            "train": {"role": "sglang", "nproc": 4},
            "sglang": {"tp_size": 2},
            "envs": {"sglang": {"python": "/opt/sg/bin/python", "gpus": 8}, **envs},
        }
    )
    return cfg


def test_roles_and_interpreters():
    cfg = gpu_config()
    assert wf.role_of(cfg, "data") == "cpu" and wf.role_of(cfg, "capture") == "sglang"
    assert wf.role_python(cfg, "cpu") == sys.executable
    assert wf.role_python(cfg, "sglang") == "/opt/sg/bin/python"
    assert wf.role_python(cfg, "sglang", conda=True) == "python"
    cfg["envs"]["cpu"] = {"python": "venv"}
    assert wf.role_python(cfg, "cpu") == "results/venv/cpu/bin/python"


def test_gpus_per_job_follow_the_engine_and_train_nproc():
    cfg = gpu_config()
    assert wf.stage_gpus(cfg, "capture") == 2  # the engine names sglang.tp_size
    assert wf.gpu_resources(cfg, "bench") == {"gpu": 2}
    assert wf.gpu_resources(cfg, "train") == {"gres": "gpu:4"}
    assert wf.gpu_resources(cfg, "regenerate") == {}  # a CPU role
    layout = wf.gpu_layout(cfg, ["cpu", "sglang"])
    assert "capture 2 (sglang:" in layout and "train 4 (sglang: 4 training processes" in layout
    assert wf.gpu_layout(with_defaults({}), ["cpu"]) is None


def test_run_settings_resolve_shared_server_without_changing_the_config():
    """`auto` is `run` on a GPU role too: the servers' GPUs are given back before other GPU
    work (draftsmith.runtime.serverhosts), so sharing never hides GPUs from Snakemake."""
    cfg = gpu_config()
    before = copy.deepcopy(cfg)
    assert cfg["sglang"]["shared_server"] == "auto"
    assert wf.run_settings(cfg, RUN_KEYS)["sglang"]["shared_server"] == "run"  # a GPU role
    cpu = with_defaults({"capture": {"backend": "sglang", "role": "sglang-cpu"}})
    assert wf.run_settings(cpu, RUN_KEYS)["sglang"]["shared_server"] == "run"
    job = with_defaults({"sglang": {"shared_server": "job"}})
    assert wf.run_settings(job, RUN_KEYS)["sglang"]["shared_server"] == "job"
    assert cfg == before  # no mutation: the config stays as validated


def test_server_settings_that_are_params_leave_out_the_run_keys():
    cfg = gpu_config()
    got = wf.server_cfg(cfg, "bench", RUN_KEYS)
    assert got["sglang"]["tp_size"] == 2 and "port" not in got["sglang"]
    assert got["target"] == {"dtype": cfg["target"]["dtype"], "trust_remote_code": False}
    assert wf.server_cfg(with_defaults({}), "bench", RUN_KEYS) == {}
    assert wf.remote_code_cfg(cfg) == {}


def test_a_setting_spelled_out_as_its_auto_value_is_auto_in_params():
    from draftsmith.config.checks import aux_layer_ids

    target = {"num_hidden_layers": 6}
    auto = aux_layer_ids("auto", 6)
    cfg = with_defaults({"capture": {"aux_layer_ids": auto}})
    before = copy.deepcopy(cfg)
    assert wf.params_config(cfg, target)["capture"]["aux_layer_ids"] == "auto"
    assert cfg == before  # a copy: the config itself is as given
    other = with_defaults({"capture": {"aux_layer_ids": [0, 1, 2]}})
    assert wf.params_config(other, target) is other
    assert wf.params_config(cfg, None) is cfg  # target not readable at parse time


def test_the_dry_run_plans_the_same_commands_for_auto_and_its_ids(tmp_path, tiny_target):
    """Written out as the ids auto resolves to, capture.aux_layer_ids gives the same params,
    so a built project would rerun nothing."""
    import json

    from wf import snakemake, tiny_config, write_config

    from draftsmith.config.checks import aux_layer_ids

    n = json.loads((tiny_target / "config.json").read_text())["num_hidden_layers"]
    plans = []
    for ids in ("auto", aux_layer_ids("auto", n)):
        work = tmp_path / str(len(plans))
        write_config(work, tiny_config(tiny_target, capture={"aux_layer_ids": ids}))
        out = snakemake(work, "-n", "-p").stdout
        plans.append(sorted(line.strip() for line in out.splitlines() if "--cfg" in line))
    assert plans[0] and plans[0] == plans[1]


def test_a_cpu_sglang_server_at_tensor_parallel_size_n_gets_n_threads_per_range_job():
    cpu = with_defaults(
        {
            "capture": {"backend": "sglang", "role": "sglang-cpu"},
            "sglang": {"tp_size": 2},
        }
    )
    assert wf.range_threads(cpu, "capture") == 2  # a core per rank (sglang_cpu.rank_threads)
    assert wf.range_threads(cpu, "regenerate") == 1  # hf: one thread per range job
    assert wf.range_threads(gpu_config(), "capture") == 1  # GPUs: the ranks are on the GPUs


def test_regeneration_goes_first_where_its_server_holds_gpus():
    """Its jobs run before captures that would stop its idle server (one load per stage)."""
    assert wf.range_priority(gpu_config(), "regenerate") == 0  # a CPU role
    cfg = gpu_config()
    cfg["regenerate"] = {**cfg["regenerate"], "backend": "sglang", "role": "sglang"}
    assert wf.range_priority(cfg, "regenerate") == 1
    assert wf.range_priority(cfg, "capture") == 0
