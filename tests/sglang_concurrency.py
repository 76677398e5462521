"""Capture the same rows through one patched SGLang server at several concurrencies.

Used by tests/test_sglang_capture_exact.py with the sglang-cpu role's interpreter:

    sglang_concurrency.py CFG_JSON TARGET PATCHED TOKENS OUT_DIR CONC[,CONC...] [--batched]

One capture server (`capture_server_spec`, the capture job's launch) serves every pass; each
pass sends all rows through the capture client's own `RowCapture` and `run_rows` at its
concurrency, longest rows first as `capture_range` does, into OUT_DIR/c<N>/<tokens name>.
`--batched` drops `--prefill-max-requests 1` from the launch (SGLang may then pack concurrent
rows into one forward). Prints one JSON line: the shard paths and, from the server's log, how
many requests each prefill forward held and how many waited in its queue, and each pass's
wall time.
"""

from __future__ import annotations

import json
import re
import shutil
import sys
import tempfile
import time
from pathlib import Path

from safetensors.torch import load_file

from draftsmith.config import settings
from draftsmith.engines.server import Supervisor
from draftsmith.engines.sglang import capture as sc
from draftsmith.engines.sglang.patch import load_patched
from draftsmith.hidden.writer import ShardWriter

PREFILL = re.compile(r"Prefill batch.*#new-seq: (\d+),.*#queue-req: (\d+)")


class LogTee:
    """The server's log: to stderr, and the prefill forwards' counts kept."""

    def __init__(self):
        self.prefills: list[tuple[int, int]] = []

    def write(self, text: str) -> None:
        sys.stderr.write(text)
        for m in PREFILL.finditer(text):
            self.prefills.append((int(m.group(1)), int(m.group(2))))

    def flush(self) -> None:
        sys.stderr.flush()


class NoBar:
    def update(self, _n: int) -> None:
        pass


def one_pass(sup, tokens, job, expect, hidden, dump_dir, out: Path, concurrency: int) -> None:
    n_rows = tokens["row_offsets"].numel() - 1
    with ShardWriter(
        out,
        input_ids=tokens["input_ids"],
        loss_mask=tokens["loss_mask"],
        row_offsets=tokens["row_offsets"],
        hidden_size=hidden,
        dtype=job.capture.dtype,
        manifest={"row_range": [0, n_rows], "target_fingerprint": "test"},
    ) as writer:
        rc = sc.RowCapture(tokens, writer, dump_dir, expect, job)
        lengths = [rc.row_ids(r).numel() for r in range(n_rows)]
        rows = sorted(range(n_rows), key=lambda r: (-lengths[r], r))
        sc.run_rows(sup, rc, rows, concurrency=concurrency, retries=0, bar=NoBar())


def main(argv: list[str]) -> None:
    cfg_json, target, patched, tokens_path, out_dir, concs, *flags = argv
    cfg, target = json.loads(cfg_json), Path(target)
    job = settings.stage_job(cfg, "capture")  # what the capture job hands its engine
    ids = cfg["capture"]["aux_layer_ids"]
    record = load_patched(Path(patched))
    hidden, expect = sc.check_ids(target, ids, record)
    tokens = load_file(tokens_path)
    dump_dir = Path(tempfile.mkdtemp(prefix="draftsmith-dump-", dir=sc.dump_root()))
    spec = sc.capture_server_spec(job, target, 1, ids, dump_dir, record["overlay_path"])
    if "--batched" in flags:
        spec.command = drop_flag(spec.command, "--prefill-max-requests")
    tee, shards = LogTee(), {}
    try:
        with Supervisor(spec, retries=0, log_stream=tee) as sup:
            for c in map(int, concs.split(",")):
                seen, t0 = len(tee.prefills), time.perf_counter()
                out = Path(out_dir) / f"c{c}" / Path(tokens_path).name
                one_pass(sup, tokens, job, expect, hidden, dump_dir, out, c)
                seconds = round(time.perf_counter() - t0, 3)
                time.sleep(1.0)  # the log pump's last lines of this pass
                shards[c] = {"path": str(out), "prefills": tee.prefills[seen:], "seconds": seconds}
    finally:
        shutil.rmtree(dump_dir, ignore_errors=True)
    print(json.dumps(shards))


def drop_flag(command, flag: str):
    """`command` without `flag` and the value after it."""

    def without(port: int) -> list[str]:
        args = command(port)
        i = args.index(flag)
        return args[:i] + args[i + 2 :]

    return without


if __name__ == "__main__":
    main(sys.argv[1:])
