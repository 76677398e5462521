"""Segment mode's capture: one range's shard as draftsmith.stages.capture writes it, plus what outlives it.

    python -m draftsmith segment-capture [--reference-dir state/segments] [--server-dir state/servers]
        [--last-capture] <draftsmith.stages.capture args>

The shard itself is a temporary (rules/segments.smk deletes it once its segment is trained);
its manifest stays, with the sha256 and summary statistics of every tensor (`tensor_sha256`,
`tensor_stats`: float64 sum, sum of absolute values, largest absolute value) beside what
draftsmith.stages.capture records (token count, layer ids and convention, `backend` and versions).

The first capture of a range (for this capture config, token file and target) is kept as the
reference, `<reference-dir>/<key>/<range>.json`, written once, atomically. Every later capture
of the range (the next epochs, or a capture rerun after a kill or a lost shard) is compared with
it, tensor by tensor, and its manifest's `recapture` says either bit_identical true, or which
tensors differ and by how much their statistics differ (`max_stat_diff`; the elementwise
difference would need the first capture's tensors, which this mode deleted). A difference is
reported, not an error: a capture engine that is not deterministic (a GPU's kernels, batching)
gives other low bits; training then reads the new states.

A server engine (capture.backend sglang) with `sglang.capture_server: run` serves every capture
of the run from one server (draftsmith.engines.sharedserver, its state under `--server-dir`) instead of
one per job; `--last-capture` (a capture of the run's last segment index) lets it stop as soon as
no capture uses it.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import struct
import sys
from pathlib import Path

from draftsmith.hidden.shards import manifest_path
from draftsmith.runtime.files import atomic_write_json, command_parser, init_logging, sha256_file

log = logging.getLogger("draftsmith.stages.capture")
HEADER_KEY = "__metadata__"


def tensor_digests(path: Path) -> tuple[dict[str, str], dict[str, list[float]]]:
    """({tensor: sha256 of its bytes}, {tensor: [sum, sum |x|, max |x|]}) of a safetensors file."""
    import torch
    from safetensors import safe_open

    digests, stats = {}, {}
    with open(path, "rb") as f, safe_open(str(path), "pt") as st:
        (n,) = struct.unpack("<Q", f.read(8))
        header, base = json.loads(f.read(n)), 8 + n  # tensor data starts after the header
        for name, info in sorted(header.items()):
            if name == HEADER_KEY:
                continue
            a, b = info["data_offsets"]
            f.seek(base + a)
            h, left = hashlib.sha256(), b - a
            while left:
                chunk = f.read(min(left, 1 << 22))
                if not chunk:
                    raise ValueError(f"{path}: tensor {name} runs past the end of the file")
                h.update(chunk)
                left -= len(chunk)
            digests[name] = h.hexdigest()
            x = st.get_tensor(name).to(torch.float64)
            big = float(x.abs().max()) if x.numel() else 0.0
            stats[name] = [float(x.sum()), float(x.abs().sum()), big]
    return digests, stats


def reference_key(cfg_text: str, tokens: Path, target: Path) -> str:
    """What makes a capture of a range comparable: the capture config, tokens and target."""
    meta = target / "draftsmith_target.json"
    ident = meta.read_bytes() if meta.exists() else (target / "config.json").read_bytes()
    h = hashlib.sha256(cfg_text.encode())
    h.update(sha256_file(tokens).encode())
    h.update(ident)
    return h.hexdigest()[:16]


def compare(manifest: dict, reference: dict) -> dict:
    """The `recapture` record of a capture against the first one of its range."""
    mine, first = manifest["tensor_sha256"], reference["tensor_sha256"]
    differs = sorted(k for k in set(mine) | set(first) if mine.get(k) != first.get(k))
    if not differs:
        return {"bit_identical": True}
    diff = 0.0
    for k in differs:
        a, b = manifest["tensor_stats"].get(k), reference["tensor_stats"].get(k)
        if a is None or b is None:
            diff = math.inf
            continue
        diff = max(diff, *(abs(x - y) for x, y in zip(a, b, strict=True)))
    return {"bit_identical": False, "differs": differs, "max_stat_diff": diff}


def record(out: Path, cfg_text: str, tokens: Path, target: Path, ref_dir: Path) -> dict:
    """Add the per-tensor record to the shard's manifest and compare it with the reference."""
    mpath = manifest_path(out)
    manifest = json.loads(mpath.read_text())
    manifest["tensor_sha256"], manifest["tensor_stats"] = tensor_digests(out)
    ref = ref_dir / reference_key(cfg_text, tokens, target) / f"{out.stem}.json"
    if ref.is_file():
        manifest["recapture"] = {
            "reference": str(ref),
            **compare(manifest, json.loads(ref.read_text())),
        }
        if manifest["recapture"]["bit_identical"]:
            log.info("%s: re-captured, bit-identical to the first capture (%s)", out.stem, ref)
        else:
            log.warning(
                "%s: re-captured, not bit-identical: %s differ, max statistic difference %g",
                out.stem,
                manifest["recapture"]["differs"],
                manifest["recapture"]["max_stat_diff"],
            )
    else:
        manifest["recapture"] = None  # the first capture of the range: the reference
        atomic_write_json(ref, manifest)
    atomic_write_json(mpath, manifest)
    return manifest


def capture_argv(argv: list[str] | None, args) -> list[str]:
    """draftsmith.stages.capture's arguments: this module's own options left out, and `--cfg` with
    `capture_server` added (where the run's shared server lives, if its engine uses one)."""
    passed = list(argv) if argv is not None else sys.argv[1:]
    for name, n in (("--reference-dir", 2), ("--server-dir", 2), ("--last-capture", 1)):
        if name in passed:
            i = passed.index(name)
            del passed[i : i + n]
    cfg = json.loads(args.cfg)
    cfg["capture_server"] = {"dir": str(args.server_dir), "last": args.last_capture}
    passed[passed.index("--cfg") + 1] = json.dumps(cfg)
    return passed


def main(argv: list[str] | None = None) -> None:
    ap = command_parser("segment-capture", __doc__, add_help=False)
    ap.add_argument("--reference-dir", type=Path, default=Path("state/segments"))
    ap.add_argument("--server-dir", type=Path, default=Path("state/servers"))
    ap.add_argument("--last-capture", action="store_true")
    ap.add_argument("--cfg", required=True)
    ap.add_argument("--tokens", type=Path, required=True)
    ap.add_argument("--target", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("-h", "--help", action="help", help="this help")
    args, _ = ap.parse_known_args(argv)
    from draftsmith.stages import capture

    capture.main(capture_argv(argv, args))
    init_logging("draftsmith.stages.capture")
    record(args.out, args.cfg, args.tokens, args.target, args.reference_dir)
