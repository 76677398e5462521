"""draftsmith.runtime.heap: glibc's thresholds fixed for a job, the user's tunables winning."""

from __future__ import annotations

import ctypes
import subprocess
import sys

import pytest

from draftsmith.runtime import heap


def glibc() -> bool:
    try:
        return hasattr(ctypes.CDLL(None), "mallopt")
    except OSError:
        return False


def test_user_tunables_win(monkeypatch):
    called = []
    monkeypatch.setattr(ctypes, "CDLL", lambda *_: called.append(1))
    env = {"GLIBC_TUNABLES": "glibc.malloc.mmap_threshold=1048576"}
    assert heap.settle(16 << 20, 64 << 20, environ=env) is False
    assert called == []  # libc was not even looked up


def test_not_glibc_changes_nothing(monkeypatch):
    def no_libc(*_):
        raise OSError("no libc")

    monkeypatch.setattr(ctypes, "CDLL", no_libc)
    assert heap.settle(16 << 20, environ={}) is False


@pytest.mark.skipif(not glibc(), reason="glibc only")
def test_settle_moves_large_blocks_onto_the_heap():
    """With the threshold fixed at 16 MiB, an 8 MiB block comes from the heap ([heap] in
    /proc/self/maps); with glibc's default threshold it is a mapping of its own."""
    code = """
import ctypes, sys
from draftsmith.runtime import heap
libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
if sys.argv[1] == "settle":
    assert heap.settle(16 << 20, 64 << 20, environ={})
block = libc.malloc(8 << 20)
for line in open("/proc/self/maps"):
    if line.rstrip().endswith("[heap]"):
        lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
        print(int(lo <= block < hi))
        break
else:
    print(0)
"""
    on_heap = {}
    for mode in ("settle", "default"):
        out = subprocess.run([sys.executable, "-c", code, mode], capture_output=True, text=True)
        assert out.returncode == 0, out.stderr
        on_heap[mode] = out.stdout.split()[-1] == "1"
    assert on_heap == {"settle": True, "default": False}
