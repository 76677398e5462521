"""Role interpreters for real-engine tests: DRAFTSMITH_PYTHON_<ROLE> (role upper-cased, '-' ->
'_'). Missing: the test skips, or fails when DRAFTSMITH_REQUIRE_ENGINES=1 (.ci/run sets it)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest


def role_python(role: str) -> str:
    var = "DRAFTSMITH_PYTHON_" + role.upper().replace("-", "_")
    python = os.environ.get(var, "")
    if python and Path(python).is_file():
        return python
    why = (
        f"role {role!r}: set {var} to its interpreter (build it with `python3 -m "
        f"draftsmith env venv --pins envs/{role}.txt --out .venvs/{role}`)"
    )
    if os.environ.get("DRAFTSMITH_REQUIRE_ENGINES") == "1":
        pytest.fail(why)
    pytest.skip(why)
