"""SGLang 0.5.23 (role sglang-cpu) refuses DFlash speculative decoding on CPU.

The server is started with our CPU launch arguments, a tiny target and a DFlash draft exported
here (draftsmith.algorithms.dflash.export), `--speculative-algorithm DFLASH`: SGLang stops while resolving
its arguments, before loading anything, with its platform gate's message. Pinned so that a
SGLang that lifts the gate fails here and the docs (docs/algorithms.md) get revisited. Nothing
listens: the process exits by itself (its process group is killed if it does not).
"""

from __future__ import annotations

import os
import signal
import subprocess

import pytest
import torch
from roles import role_python
from test_algorithms_engines import free_port

from draftsmith.algorithms.dflash.export import export_draft
from draftsmith.algorithms.dflash.model import DFlashConfig, DFlashDraft
from draftsmith.engines.sglang_cpu import LAUNCH_ARGS, server_env

pytestmark = [pytest.mark.slow, pytest.mark.sglang]

REFUSAL = "DFLASH speculative decoding is not supported by CpuSRTPlatform"


def test_sglang_cpu_refuses_dflash(tmp_path):
    import json

    from draftsmith.targets.tinymodel import make_tiny_target

    target = make_tiny_target(tmp_path / "target", num_layers=4, hidden_size=128)
    tc = json.loads((target / "config.json").read_text())
    torch.manual_seed(0)
    draft = DFlashDraft(DFlashConfig.from_target_config(tc, [0, 1, 2], 1, 4, -1))
    export_draft(draft, tmp_path / "draft", {"config": {}})
    cmd = [
        role_python("sglang-cpu"),
        "-m",
        "sglang.launch_server",
        "--model-path",
        str(target),
        "--speculative-algorithm",
        "DFLASH",
        "--speculative-draft-model-path",
        str(tmp_path / "draft"),
        "--speculative-num-draft-tokens",
        "4",
        "--host",
        "127.0.0.1",
        "--port",
        str(free_port()),
        *LAUNCH_ARGS,
    ]
    proc = subprocess.Popen(
        cmd,
        env=server_env(threads=1),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        out, _ = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode != 0, out[-3000:]
    assert REFUSAL in out, out[-3000:]
