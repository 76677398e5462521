"""Loaded at start-up by every Python process that has this folder on PYTHONPATH.

The sglang-cpu role's server launcher puts it there (draftsmith.engines.sglang.cpu.server_env), so the
SGLang server and each worker process it spawns activate the CPU compatibility layer before any
SGLang module is imported. Does nothing unless SGLANG_USE_CPU_ENGINE is on: this folder must never
be on a GPU server's path, and the guard keeps a stray PYTHONPATH harmless.
"""

import os
import sys
from pathlib import Path

if os.environ.get("SGLANG_USE_CPU_ENGINE", "").lower() in ("1", "true"):
    _root = str(Path(__file__).resolve().parents[5])  # the repository root
    if _root not in sys.path:
        sys.path.append(_root)
    from draftsmith.engines.sglang.cpu.hook import activate

    activate()
