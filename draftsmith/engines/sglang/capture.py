"""Capture backend `sglang`: a patched SGLang server prefills every row and dumps its states.

The server is the pinned SGLang with the capture patch (`rule patch_sglang`, overlay first on
its PYTHONPATH), started once per job (segment mode with `sglang.capture_server: run`: once per
run, draftsmith.engines.sharedserver, `capture_server`) in SGLang's capture-only mode: aux capture at the
configured ids without a draft (`--enable-return-aux-hidden-states --speculative-algorithm
EAGLE3 --return-aux-hidden-state-layer-ids ...`, which calls each model's
`set_eagle3_layers_to_capture`), radix cache, chunked prefill and the overlap scheduler off
(a prompt is always prefilled whole, in one forward; the patch refuses anything else), and at
most one request per prefill forward (`--prefill-max-requests 1`): a row's states are then the
same bits at any `capture.concurrency` as alone. Without that limit SGLang packs concurrent
rows into one forward, and a float32 GEMM over a few rows rounds differently from the same rows
inside a larger one (measured: docs/sglang.md, "Exact at any concurrency").

Each row is sent as `input_ids` to `/generate` with `max_new_tokens=1` and a unique
`draftsmith_dump_key`, at most `capture.concurrency` at a time. The server writes
`<dump dir>/<key>.dump` (format: `sglang/srt/draftsmith_dump.py` in the patch, docs/sglang.md);
this client waits for it, checks magic, format, patch id, token count, hidden size, the layers
actually captured (SGLang id i must capture the input of layer i + 1), the crc32 of the token
ids and the file size, casts to `capture.dtype`, writes the rows into the shard through the same
streaming `ShardWriter` as `hf`, and deletes the dump. A wrong or missing dump or an aborted
request is retried up to `capture.retries` times, then the job fails naming the row; a server
that dies is relaunched (bounded, `draftsmith.engines.server.Supervisor`) and every row not yet written
is sent again. The shard is only renamed into place once every token is written.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import struct
import tempfile
import threading
import time
import uuid
import zlib
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from draftsmith.engines.sglang.server import job_server, server_spec, shared_server
from draftsmith.hidden.capture_base import CaptureError
from draftsmith.hidden.writer import ShardWriter
from draftsmith.runtime.progress import LoggedBar, ProgressLog

log = logging.getLogger("draftsmith.engines.sglang.capture")

DUMP_MAGIC = b"DSDUMP01"
DUMP_FORMAT = "draftsmith-dump-1"
DUMP_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
DUMP_ROOT_ENV = "DRAFTSMITH_DUMP_ROOT"  # where dump dirs go (default /dev/shm)
# each prefill forward holds one row, so a row's states do not depend on which rows are in
# flight with it (capture.concurrency only overlaps requests, dumps and shard writes)
ONE_ROW_PER_FORWARD = ("--prefill-max-requests", "1")


class DumpError(ValueError):
    """A dump that is missing, malformed or does not belong to the row it was asked for."""


class LayerMismatch(DumpError):
    """The server captured other layers than the ids ask for: never retried (deterministic)."""


def ids_crc32(input_ids: torch.Tensor) -> int:
    """crc32 of the token ids as int64 little endian (what the patched server computes)."""
    return zlib.crc32(np.ascontiguousarray(input_ids.numpy(), dtype="<i8").tobytes())


def dump_root() -> Path:
    root = Path(os.environ.get(DUMP_ROOT_ENV, "/dev/shm"))
    return root if root.is_dir() else Path(tempfile.gettempdir())


def read_dump(path: Path, *, expect: dict) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """(aux [S, K*H], last [S, H], header) of one dump, after checking it against `expect`.

    `expect` holds key, tokens, hidden_size, layer_inputs, ids_crc32 and patch.
    """
    data = path.read_bytes()
    if len(data) < 16 or data[:8] != DUMP_MAGIC:
        raise DumpError(f"{path.name}: not a draftsmith dump (magic {data[:8]!r})")
    (n,) = struct.unpack("<Q", data[8:16])
    if 16 + n > len(data):
        raise DumpError(f"{path.name}: truncated header ({len(data)} bytes, header {n})")
    try:
        header = json.loads(data[16 : 16 + n])
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise DumpError(f"{path.name}: corrupt header ({e})") from None
    if header.get("format") != DUMP_FORMAT:
        raise DumpError(f"{path.name}: format {header.get('format')!r}, expected {DUMP_FORMAT!r}")
    for key, want in expect.items():
        if key == "layer_inputs" and header.get(key) != want:
            raise LayerMismatch(
                f"{path.name}: the server captured the inputs of layers {header.get(key)}, but "
                f"ids {[i - 1 for i in want]} mean the outputs of those layers, i.e. the inputs "
                f"of {want}. This SGLang model class reads the ids differently (SGLang 0.5.23's "
                "deepseek_v2.py, used by DeepSeek-V3 and Kimi-K2.5, adds 1 only when the first "
                "id is 1); a stock server would feed a draft the same shifted layers, so pick "
                "ids that start with 1"
            )
        if header.get(key) != want:
            raise DumpError(f"{path.name}: header {key} is {header.get(key)!r}, expected {want!r}")
    dtype = DUMP_DTYPES.get(header.get("dtype"))
    if dtype is None:
        raise DumpError(f"{path.name}: unsupported dtype {header.get('dtype')!r}")
    s, h, k = header["tokens"], header["hidden_size"], len(header["layer_inputs"])
    item = torch.empty((), dtype=dtype).element_size()
    want_size = 16 + n + s * (k + 1) * h * item
    if len(data) != want_size:
        raise DumpError(
            f"{path.name}: {len(data)} bytes, expected {want_size} for {s} tokens x "
            f"({k} + 1) x {h} x {header['dtype']}"
        )
    flat = torch.frombuffer(bytearray(data[16 + n :]), dtype=dtype)
    aux = flat[: s * k * h].view(s, k * h)
    last = flat[s * k * h :].view(s, h)
    return aux, last, header


def capture_server_spec(job, target, threads: int, ids, dump_dir: Path, overlay: str):
    """The patched SGLang server of one capture job (`job`: its JobSettings): the sglang
    engine's launch (role, tp, CPU layer, `sglang.extra_args`) in capture-only mode, the overlay
    first on its PYTHONPATH."""
    spec = server_spec(
        job,
        "capture",
        target=target,
        threads=threads,
        extra_args=capture_args(ids),
        env={"DRAFTSMITH_DUMP_DIR": str(dump_dir)},
        pythonpath=[overlay] if overlay else [],
    )
    spec.name = "sglang-capture"
    return spec


def capture_server(job, target, threads: int, ids, overlay: str, stack: contextlib.ExitStack):
    """(server, dump dir) of one capture job, entered on `stack`: a lease on the stage's shared
    server (draftsmith.engines.sglang.server.shared_server) with the dump dir of its host, else a
    server of the job's own with a dump dir of its own."""
    from draftsmith.engines.sharedserver import SCRATCH

    if shared_server(job) is None:
        dump_dir = Path(tempfile.mkdtemp(prefix="draftsmith-dump-", dir=dump_root()))
        stack.callback(shutil.rmtree, dump_dir, ignore_errors=True)
        spec = capture_server_spec(job, target, threads, ids, dump_dir, overlay)
        return job_server(job, "capture", spec, stack, share=False), dump_dir
    spec = capture_server_spec(job, target, threads, ids, SCRATCH, overlay)
    sup = job_server(job, "capture", spec, stack, scratch=str(dump_root()))
    return sup, sup.scratch


def capture_args(ids: list[int]) -> list[str]:
    """The capture-only SGLang arguments (after the engine's own launch arguments)."""
    return [
        "--enable-return-aux-hidden-states",
        "--speculative-algorithm",
        "EAGLE3",
        "--return-aux-hidden-state-layer-ids",
        *[str(i) for i in ids],
        "--disable-radix-cache",
        "--chunked-prefill-size",
        "-1",
        "--disable-overlap-schedule",
        *ONE_ROW_PER_FORWARD,
        "--skip-tokenizer-init",
    ]


class RowCapture:
    """Sends rows, validates their dumps and writes them into the shard (thread-safe)."""

    def __init__(self, tokens: dict, writer: ShardWriter, dump_dir: Path, expect: dict, job):
        self.ids = tokens["input_ids"]
        self.offsets = tokens["row_offsets"].tolist()
        self.writer = writer
        self.dump_dir = dump_dir
        self.expect = expect
        self.timeout = float(job.engine.request_timeout)
        self.dump_wait = 120.0  # seconds from the answer to the dump (written by a server thread)
        self.lock = threading.Lock()
        self.stem = writer.path.stem

    def row_ids(self, r: int) -> torch.Tensor:
        return self.ids[self.offsets[r] : self.offsets[r + 1]]

    def wait_dump(self, key: str) -> Path:
        path, err = self.dump_dir / f"{key}.dump", self.dump_dir / f"{key}.err"
        deadline = time.monotonic() + self.dump_wait
        while not path.exists():
            if err.exists():
                raise DumpError(f"{key}: the server failed to write it: {err.read_text().strip()}")
            if time.monotonic() > deadline:
                raise DumpError(
                    f"{key}: no dump in {self.dump_dir} {self.dump_wait:.0f} s after the answer "
                    "(is the server the patched SGLang, with DRAFTSMITH_DUMP_DIR set?)"
                )
            time.sleep(0.01)
        return path

    def send(self, url: str, r: int, attempt: int) -> int:
        """Capture row r: request, dump, checks, shard write. Returns the row's token count."""
        from draftsmith.engines.server import http_json

        ids = self.row_ids(r)
        key = f"{self.stem}.r{r}.a{attempt}.{uuid.uuid4().hex[:8]}"
        body = {
            "input_ids": ids.tolist(),
            "sampling_params": {"max_new_tokens": 1, "temperature": 0.0},
            "draftsmith_dump_key": key,
        }
        try:
            answer = http_json(f"{url}/generate", body, timeout=self.timeout)
            finish = (answer or {}).get("meta_info", {}).get("finish_reason") or {}
            if finish.get("type") == "abort":
                raise DumpError(f"{key}: the server aborted the request: {finish.get('message')}")
            path = self.wait_dump(key)
            aux, last, _ = read_dump(
                path,
                expect={
                    **self.expect,
                    "key": key,
                    "tokens": ids.numel(),
                    "ids_crc32": ids_crc32(ids),
                },
            )
            with self.lock:
                self.writer.write(self.offsets[r], aux, last)
        finally:
            for suffix in (".dump", ".err"):
                (self.dump_dir / f"{key}{suffix}").unlink(missing_ok=True)
        return ids.numel()


def run_rows(sup, rc: RowCapture, rows: list[int], *, concurrency: int, retries: int, bar) -> dict:
    """Capture `rows` with bounded concurrency; restart a dead server; bounded retries per row."""
    from draftsmith.engines.server import RequestRejected, server_down

    attempts = dict.fromkeys(rows, 0)
    pending = list(rows)
    stats = {"row_retries": 0}
    with ThreadPoolExecutor(max_workers=max(1, concurrency)) as pool:
        while pending:
            futures = {pool.submit(rc.send, sup.url, r, attempts[r]): r for r in pending}
            failed: dict[int, BaseException] = {}
            try:
                remaining = set(futures)
                while remaining:
                    done, remaining = wait(remaining, timeout=1.0, return_when=FIRST_COMPLETED)
                    for fut in done:
                        err = fut.exception()
                        if err is None:
                            bar.update(1)
                        else:
                            failed[futures[fut]] = err
            except BaseException:
                for fut in futures:
                    fut.cancel()
                sup.server.stop()
                raise
            pending = sorted(failed)
            if not pending:
                break
            if server_down(sup):  # a crash: not the rows' fault, send them all again
                sup.restart(f"{len(pending)} row(s) unanswered")
                continue
            for r, err in failed.items():
                attempts[r] += 1
                stats["row_retries"] += 1
                global_row = rc.writer.manifest["row_range"][0] + r
                if attempts[r] > retries or isinstance(err, (RequestRejected, LayerMismatch)):
                    raise CaptureError(
                        f"{rc.stem}: row {r} (global row {global_row}, {rc.row_ids(r).numel()} "
                        f"tokens) failed {attempts[r]} time(s): {type(err).__name__}: {err}"
                    ) from err
                log.warning("row %d (global %d): %s; retrying", r, global_row, err)
    return stats


def check_ids(target, ids, record: dict) -> tuple[int, dict]:
    """The target's hidden size and what each dump must say (patch, width, layer inputs), after
    refusing aux ids SGLang cannot capture for this target."""
    from draftsmith.targets.model import target_config

    text_cfg = target_config(target)
    hidden, n_layers = int(text_cfg["hidden_size"]), int(text_cfg["num_hidden_layers"])
    if max(ids) >= n_layers - 1 or len(set(ids)) != len(ids):
        raise CaptureError(
            f"capture.aux_layer_ids {ids}: SGLang captures the output of layer i as the input "
            f"of layer i + 1, so ids must be distinct and below {n_layers - 1} for this "
            f"{n_layers}-layer target"
        )
    expect = {
        "patch": record["patch_id"],
        "hidden_size": hidden,
        "layer_inputs": [i + 1 for i in ids],
    }
    return hidden, expect


def capture_range(
    tokens, job, *, target, out, ids, manifest: dict, threads: int, draft_ids=None, patched=None
) -> dict:
    """The capture stage through the patched SGLang server (`job`: the JobSettings of the
    engine seam, draftsmith.engines); returns the shard's manifest (draft_ids: unused, this
    engine refuses top-k teachers)."""
    from draftsmith.engines.sglang.patch import load_patched
    from draftsmith.hidden.storage import Storage

    if patched is None:
        raise CaptureError("capture.backend sglang needs --patched results/sglang/patched.json")
    record = load_patched(patched)
    cap = job.capture
    storage = Storage.from_config(cap.storage.as_dict())
    if storage.final == "topk":
        raise CaptureError(
            "capture.storage.final topk needs the target's lm_head in the client: not supported "
            "with capture.backend sglang (use states or trained)"
        )
    hidden, expect = check_ids(target, ids, record)
    n_rows = tokens["row_offsets"].numel() - 1
    t0 = time.perf_counter()
    with contextlib.ExitStack() as stack:
        sup, dump_dir = capture_server(job, target, threads, ids, record["overlay_path"], stack)
        writer = stack.enter_context(
            ShardWriter(
                out,
                input_ids=tokens["input_ids"],
                loss_mask=tokens["loss_mask"],
                row_offsets=tokens["row_offsets"],
                hidden_size=hidden,
                dtype=cap.dtype,
                storage=storage,
                manifest={
                    **manifest,
                    "aux_layer_ids": list(ids),
                    "backend": "sglang",
                    "forward_dtype": job.target.dtype,
                    "sglang": {
                        "version": record["sglang_version"],
                        "patch_id": record["patch_id"],
                        "patch_hash": record["patch_hash"],
                    },
                },
            )
        )
        rc = RowCapture(tokens, writer, dump_dir, expect, job)
        # order: longest first, so the slowest rows do not come last
        lengths = [rc.row_ids(r).numel() for r in range(n_rows)]
        rows = sorted(range(n_rows), key=lambda r: (-lengths[r], r))
        progress = ProgressLog(log, f"capture {Path(out).stem}", n_rows, "rows")
        with tqdm(total=n_rows, desc=Path(out).stem, unit="row") as bar:
            stats = run_rows(
                sup,
                rc,
                rows,
                concurrency=int(cap.concurrency),
                retries=int(cap.retries),
                bar=LoggedBar(bar, progress),
            )
        writer.manifest["capture_seconds"] = round(time.perf_counter() - t0, 3)
        writer.manifest["server"] = {
            **sup.stats(),
            **stats,
            "tp_size": int(job.engine.tp_size),
            "rows_per_forward": 1,
        }
    return writer.manifest
