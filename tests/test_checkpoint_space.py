"""A full disk at a training checkpoint: refused before the first step when two checkpoints do
not fit, and a write that runs out of space ends with the path, the bytes needed and free, the
staging directory removed and the last checkpoint kept."""

from __future__ import annotations

import errno
import shutil
from collections import namedtuple

import pytest
import torch

from draftsmith.train import checkpoint as ck

Usage = namedtuple("Usage", "total used free")


def draft_and_opt():
    torch.manual_seed(0)
    draft = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 8))
    opt = torch.optim.AdamW(draft.parameters(), lr=1e-3)
    draft(torch.randn(2, 64)).sum().backward()
    opt.step()
    return draft, opt


def test_two_checkpoints_must_fit_before_the_first_step(tmp_path, monkeypatch):
    draft, _ = draft_and_opt()
    need = 2 * ck.checkpoint_bytes(draft)
    monkeypatch.setattr(shutil, "disk_usage", lambda p: Usage(10**9, 0, need - 1))
    with pytest.raises(ck.CheckpointSpaceError) as e:
        ck.check_space(tmp_path, draft)
    assert f"under {tmp_path}" in str(e.value) and "MiB free" in str(e.value)
    monkeypatch.setattr(shutil, "disk_usage", lambda p: Usage(10**9, 0, need))
    ck.check_space(tmp_path, draft)


def test_a_full_disk_mid_write_names_the_path_and_keeps_the_last_checkpoint(tmp_path, monkeypatch):
    draft, opt = draft_and_opt()
    ck.save_checkpoint(tmp_path, 1, draft, opt, {"key": "k"})
    real = ck.save_file

    def full(tensors, path, *a, **kw):
        if "optim" in str(path):
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(tensors, path, *a, **kw)

    monkeypatch.setattr(ck, "save_file", full)
    with pytest.raises(ck.CheckpointSpaceError, match=f"MiB under {tmp_path}"):
        ck.save_checkpoint(tmp_path, 2, draft, opt, {"key": "k"})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-000001"]  # no staging dir left
    assert ck.latest_checkpoint(tmp_path, "k").name == "step-000001"
