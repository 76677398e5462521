"""Capture through the patched SGLang CPU server at `sglang.tp_size` 2: two ranks, one dump writer.

The fast tests check how a CPU server of several ranks shares its job's threads and cores
(`draftsmith.engines.sglang.cpu.rank_threads`, which `server_spec` applies) and what it refuses.
The slow test (`slow` + `sglang`) captures the same tiny target's rows with `tp_size` 1 and 2
and compares both shards with the hf shard within the capture tests' tolerance; a hook in every
server process records each dump written, with its process and TP rank, so the test sees that
every row was written exactly once, by rank 0, although both ranks compute the full states.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

import pytest
import roles
import torch
from test_sglang_capture import AUX_IDS, CPU_SERVER_ARGS, assert_same_shard, prepare
from wf import with_defaults

from draftsmith.engines.sglang import cpu as sglang_cpu

ROOT = Path(__file__).resolve().parents[1]
ROWS = 6  # rows_000010-000016

# Loaded first in every server process (before the CPU layer's own sitecustomize, which it
# runs): wraps the patch's write_dump once sglang.srt.draftsmith_dump is imported, and appends
# one JSON line per dump written to $DRAFTSMITH_TP_WRITES.
HOOK = """
import importlib.abc, importlib.machinery, json, os, runpy, sys
runpy.run_path(os.environ["DRAFTSMITH_TP_CPU_SITE"], run_name="sitecustomize")
NAME = "sglang.srt.draftsmith_dump"

def wrap(mod):
    real = mod.write_dump
    def write_dump(directory, key, meta, aux, last):
        real(directory, key, meta, aux, last)
        line = json.dumps({"pid": os.getpid(), "key": key, "tp_rank": meta["tp_rank"],
                           "tp_size": meta["tp_size"], "rows": aux.shape[0]})
        with open(os.environ["DRAFTSMITH_TP_WRITES"], "a") as f:
            f.write(line + "\\n")
    mod.write_dump = write_dump

class Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != NAME:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        real = spec.loader.exec_module
        def exec_module(module):
            real(module)
            wrap(module)
        spec.loader.exec_module = exec_module
        return spec

sys.meta_path.insert(0, Finder())
"""

# The capture stage, with the hook's folder put first on the server's PYTHONPATH.
CLIENT = """
import os, sys
from draftsmith.engines.sglang import capture as sc
from draftsmith.stages import capture
real = sc.capture_server_spec
def capture_server_spec(*a, **kw):
    spec = real(*a, **kw)
    path = spec.env["PYTHONPATH"].split(os.pathsep)
    spec.env["PYTHONPATH"] = os.pathsep.join([os.environ["DRAFTSMITH_TP_HOOK"], *path])
    return spec
sc.capture_server_spec = capture_server_spec
capture.main(sys.argv[1:])
"""


def test_ranks_share_the_jobs_threads_and_cores():
    assert sglang_cpu.rank_threads(2, 2, cpus=[0, 1]) == (1, "0|1")
    assert sglang_cpu.rank_threads(8, 2, cpus=range(8)) == (4, "0-3|4-7")
    assert sglang_cpu.rank_threads(3, 2, cpus=[1, 3, 5, 7, 9]) == (1, "1,3|5,7")
    assert sglang_cpu.BIND_ENV not in sglang_cpu.server_env({}, threads=2)


def test_more_ranks_than_cores_or_threads_is_refused():
    with pytest.raises(
        ValueError, match="may run on 2 core\\(s\\) \\(0-1\\); lower sglang.tp_size"
    ):
        sglang_cpu.rank_threads(4, 3, cpus=[0, 1])
    with pytest.raises(ValueError, match="the job's 1 thread\\(s\\) are shared between the ranks"):
        sglang_cpu.rank_threads(1, 2, cpus=[0, 1])


def test_server_spec_binds_the_ranks_of_a_cpu_server(tmp_path):
    from draftsmith.config import settings

    cfg = with_defaults({
        "capture": {"backend": "sglang", "role": "sglang-cpu"},
        "sglang": {"tp_size": 2},
    })  # fmt: skip
    job = settings.stage_job(cfg, "capture")
    from draftsmith.engines.sglang.server import server_spec

    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        with pytest.raises(ValueError, match="every rank needs a core of its own"):
            server_spec(job, "capture", target=tmp_path, threads=2)
        return
    spec = server_spec(job, "capture", target=tmp_path, threads=2)
    assert spec.env["OMP_NUM_THREADS"] == "1"
    assert spec.env[sglang_cpu.BIND_ENV].count("|") == 1
    cmd = spec.command(1234)
    assert cmd[cmd.index("--tp-size") + 1] == "2"
    with pytest.raises(ValueError, match="give the job 2 threads"):
        server_spec(job, "capture", target=tmp_path, threads=1)
    mine = sglang_cpu.server_env({sglang_cpu.BIND_ENV: "0|0"}, threads=2, tp_size=2)
    assert mine[sglang_cpu.BIND_ENV] == "0|0"  # a binding of the user's own is kept


def tp_capture(setup: dict, tp_size: int, threads: int) -> tuple[Path, str, list[dict], float]:
    """Capture the setup's rows at `tp_size`: (shard, log, dumps written, seconds)."""
    work = setup["work"] / f"tp{tp_size}"
    work.mkdir()
    hook = work / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(HOOK)
    writes = work / "writes.jsonl"
    cfg = with_defaults({
        "capture": {"backend": "sglang", "role": "sglang-cpu", "dtype": "bfloat16",
                    "aux_layer_ids": setup["ids"], "concurrency": 3, "retries": 0},
        "target": {"dtype": "float32"},
        "sglang": {"tp_size": tp_size, "extra_args": CPU_SERVER_ARGS, "port": 0,
                   "startup_timeout": 900, "request_timeout": 600, "retries": 0},
    })  # fmt: skip
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "DRAFTSMITH_TP_HOOK": str(hook),
        "DRAFTSMITH_TP_CPU_SITE": str(sglang_cpu.OVERLAY / "sitecustomize.py"),
        "DRAFTSMITH_TP_WRITES": str(writes),
    }
    env.pop(sglang_cpu.BIND_ENV, None)  # the launcher's own binding is under test
    out = work / "rows_000010-000016.safetensors"
    t0 = time.monotonic()
    run = subprocess.run(
        [setup["python"], "-c", CLIENT, "--cfg", json.dumps(cfg), "--tokens",
         str(setup["tokens"]), "--target", str(setup["target"]), "--out", str(out),
         "--threads", str(threads), "--patched", str(setup["work"] / "patched.json")],
        cwd=work, env=env, capture_output=True, text=True, timeout=1200,
    )  # fmt: skip
    seconds = time.monotonic() - t0
    (work / "capture.log").write_text(run.stderr)  # the job's log, the server's lines in it
    assert run.returncode == 0, run.stderr[-6000:]
    lines = writes.read_text().splitlines() if writes.exists() else []
    return out, run.stderr, [json.loads(x) for x in lines], seconds


@pytest.mark.slow
@pytest.mark.sglang
def test_tp2_capture_equals_tp1_and_hf_written_once_by_rank_0(tmp_path_factory, tiny_target):
    from draftsmith.hidden.shards import open_shard

    python = roles.role_python("sglang-cpu")
    setup = prepare(tiny_target, tmp_path_factory.mktemp("sgltp"), python, AUX_IDS)
    tp1, log1, writes1, s1 = tp_capture(setup, 1, threads=1)
    tp2, log2, writes2, s2 = tp_capture(setup, 2, threads=2)
    assert log2.count("writer on") == 1, log2[-4000:]
    assert log2.count("writer off (not TP rank 0)") == 1, log2[-4000:]
    assert_written_once(writes1, 1)
    assert_written_once(writes2, 2)
    figures = {"hf_vs_tp1": assert_same_shard(setup["hf"], tp1, AUX_IDS)}
    figures["hf_vs_tp2"] = assert_same_shard(setup["hf"], tp2, AUX_IDS)
    a, b = open_shard(tp1), open_shard(tp2, verify_sha=True)
    for name in ("input_ids", "loss_mask", "row_offsets"):
        assert torch.equal(getattr(a, name), getattr(b, name)), name
    figures["tp1_vs_tp2"] = {}
    for name in ("aux_hidden_states", "last_hidden_states"):
        x, y = getattr(a, name).float(), getattr(b, name).float()
        figures["tp1_vs_tp2"][name] = float((x - y).abs().max())
        assert torch.allclose(x, y, rtol=1e-2, atol=1e-2), (name, figures["tp1_vs_tp2"][name])
    assert b.manifest["server"]["tp_size"] == 2 and a.manifest["server"]["tp_size"] == 1
    startup = {
        n: m.manifest["server"]["server_startup_seconds"] for n, m in (("tp1", a), ("tp2", b))
    }
    print("TP_FIGURES", json.dumps({**figures, "startup": startup, "job_seconds": [s1, s2]}))


def assert_written_once(writes: list[dict], tp_size: int) -> None:
    """Every row's dump written exactly once, all by one process, the one of TP rank 0."""
    assert len(writes) == ROWS and len({w["key"] for w in writes}) == ROWS, writes
    assert {(w["tp_rank"], w["tp_size"]) for w in writes} == {(0, tp_size)}, writes
    assert len({w["pid"] for w in writes}) == 1, writes


@pytest.mark.slow
@pytest.mark.sglang
@pytest.mark.extended(
    reason="proves: tensor parallelism on sharded MLA and MoE layers (DeepSeek-V3's, "
    "Kimi-K2.5's) captures what hf does; no CI-sized version: one more hf capture and a "
    "two-rank server start-up of its own, about 5 minutes on 2 cores; CI covers the rest: "
    "test_sglang_tp.py::test_tp2_capture_equals_tp1_and_hf_written_once_by_rank_0"
)
def test_tiny_deepseek_v3_at_tp2_equals_hf(tmp_path_factory):
    """The 6-layer DeepSeek-V3-shaped model (MLA, MoE, YaRN) through a two-rank CPU server:
    heads and experts split between the ranks, the shard equals the hf capture's."""
    import sys

    python = roles.role_python("sglang-cpu")
    work = tmp_path_factory.mktemp("sgltp_dsv3")
    script = f"""
from draftsmith.targets.tinymodel import make_tiny_target
make_tiny_target({str(work / "model")!r}, "deepseek_v3", num_layers=6, engine_shapes=True)
"""
    run = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-2000:]
    setup = prepare(work / "model", work, python, [1, 2, 4])
    out, log, writes, seconds = tp_capture(setup, 2, threads=2)
    assert "capturing the inputs of layers [2, 3, 5], writer on" in log, log[-3000:]
    assert_written_once(writes, 2)
    diffs = assert_same_shard(setup["hf"], out, [1, 2, 4])
    print("TP_DSV3", json.dumps({"hf_vs_tp2": diffs, "job_seconds": seconds}))
