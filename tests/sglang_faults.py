"""Run `python -m draftsmith capture` with faults injected between the real server and the client.

Used by tests/test_sglang_capture.py with the sglang-cpu role's interpreter. DRAFTSMITH_FAULTS
is a JSON object:
    {"bad_dump": {"row": r, "times": n}}   truncate row r's dump the first n times it is read
    {"kill": {"row": r, "attempt": a}}     SIGKILL the server's process group just before row r
                                           is sent for attempt a (once)
Everything else (server, patch, dumps, shard writer) is the real code path.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading

from draftsmith.engines.sglang import capture as sc
from draftsmith.stages import capture

FAULTS = json.loads(os.environ.get("DRAFTSMITH_FAULTS", "{}"))
lock = threading.Lock()
state = {"bad": 0, "killed": False}

real_read_dump = sc.read_dump
real_send = sc.RowCapture.send
real_run_rows = sc.run_rows


def read_dump(path, *, expect):
    bad = FAULTS.get("bad_dump")
    if bad and f".r{bad['row']}." in path.name:
        with lock:
            hit = state["bad"] < bad["times"]
            state["bad"] += hit
        if hit:
            path.write_bytes(path.read_bytes()[:-7])  # a torn / wrong-size dump
            print(f"[faults] truncated {path.name}", file=sys.stderr, flush=True)
    return real_read_dump(path, expect=expect)


def run_rows(sup, rc, rows, **kw):
    kill = FAULTS.get("kill")
    if kill:

        def send(self, url, r, attempt):
            with lock:
                fire = not state["killed"] and (r, attempt) == (kill["row"], kill["attempt"])
                state["killed"] |= fire
            if fire:
                print(f"[faults] killing server pid {sup.server.proc.pid}", file=sys.stderr)
                os.killpg(sup.server.proc.pid, signal.SIGKILL)
            return real_send(self, url, r, attempt)

        sc.RowCapture.send = send
    return real_run_rows(sup, rc, rows, **kw)


sc.read_dump = read_dump
sc.run_rows = run_rows

if __name__ == "__main__":
    capture.main(sys.argv[1:])
