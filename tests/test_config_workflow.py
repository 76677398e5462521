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


def test_run_settings_resolve_capture_server_without_changing_the_config():
    cfg = gpu_config()
    before = copy.deepcopy(cfg)
    assert cfg["sglang"]["capture_server"] == "auto"
    assert wf.run_settings(cfg, RUN_KEYS)["sglang"]["capture_server"] == "job"  # a GPU role
    cpu = with_defaults({"capture": {"backend": "sglang", "role": "sglang-cpu"}})
    assert wf.run_settings(cpu, RUN_KEYS)["sglang"]["capture_server"] == "run"
    assert cfg == before  # no mutation: the config stays as validated


def test_server_settings_that_are_params_leave_out_the_run_keys():
    cfg = gpu_config()
    got = wf.server_cfg(cfg, "bench", RUN_KEYS)
    assert got["sglang"]["tp_size"] == 2 and "port" not in got["sglang"]
    assert got["target"] == {"dtype": cfg["target"]["dtype"], "trust_remote_code": False}
    assert wf.server_cfg(with_defaults({}), "bench", RUN_KEYS) == {}
    assert wf.remote_code_cfg(cfg) == {}
