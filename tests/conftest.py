from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from draftsmith.targets.tinymodel import make_tiny_target  # noqa: E402


@pytest.fixture(scope="session")
def tiny_target(tmp_path_factory) -> Path:
    """A 6-layer random Llama HF dir with a ChatML tokenizer (read-only: copy before changing)."""
    return make_tiny_target(tmp_path_factory.mktemp("tiny_llama") / "model")


@pytest.fixture(scope="session")
def tiny_deepseek_target(tmp_path_factory) -> Path:
    """A 4-layer random DeepSeek-V3-architecture HF dir (the architecture of Kimi-K2.5)."""
    return make_tiny_target(
        tmp_path_factory.mktemp("tiny_dsv3") / "model", arch="deepseek_v3", num_layers=4
    )
