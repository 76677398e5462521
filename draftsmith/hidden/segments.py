"""Segments: the data order by segment, the steps each segment trains, the disk they need.

`train.segment_rows` cuts the training rows into segments of whole row ranges (segment k holds
the ranges whose first row is in [k * segment_rows, (k + 1) * segment_rows)). With it set, an
epoch reads segment 0, then 1, ...: the rows of one segment are shuffled with a generator
seeded by (train.seed, epoch, segment) and packed first-fit into batches that never cross a
segment, every pack `longest_row` tokens long, the longest row of all segments. Offline
training with the key set uses exactly this order (draftsmith.train.data), and so does segment
mode (`capture.keep` false, draftsmith.stages.segtrain), where one job trains one segment of one
epoch: the two modes run the same steps on the same rows in the same order, so they give the
same draft. Without the key the order is the one of every earlier run (traindata.plan_epochs).

The global segment order is epoch-major: index i = epoch * n_segments + segment. In segment
mode capture of index i waits for the training of index i - 2 (rules/segments.smk), so at most
the shards of two consecutive indices are on disk at once: `peak_bytes` is that bound.

Nothing here imports torch at module level (the Snakefile imports it when it parses).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from draftsmith.config.checks import parse_range

if TYPE_CHECKING:
    from draftsmith.config.settings import TrainSettings


def segment_of(range_name: str, segment_rows: int) -> int:
    """The segment of a row range (`rows_AAAAAA-BBBBBB`)."""
    return parse_range(range_name)[0] // segment_rows


def segment_ranges(ranges: list[str], segment_rows: int) -> list[list[str]]:
    """The ranges of each segment, in order (segment_rows a multiple of the range size)."""
    out: list[list[str]] = []
    for name in sorted(ranges):
        k = segment_of(name, segment_rows)
        while len(out) <= k:
            out.append([])
        out[k].append(name)
    if any(not seg for seg in out):
        raise ValueError(f"train.segment_rows {segment_rows}: a segment without ranges")
    return out


def segment_name(epoch: int, segment: int) -> str:
    """The directory name of one (epoch, segment) of segment mode."""
    return f"epoch{epoch:03d}-seg{segment:04d}"


def global_order(epochs: int, n_segments: int) -> list[tuple[int, int]]:
    """(epoch, segment) in the order segment mode trains them."""
    return [(e, k) for e in range(epochs) for k in range(n_segments)]


def pack_order(order: list[int], lengths: list[int], pack_len: int, per_batch: int) -> list:
    """Batches -> packs -> row indices: rows in `order`, packed first-fit into `per_batch`
    packs of `pack_len` tokens; a row that fits no pack closes the batch."""
    batches, packs, fill = [], [[] for _ in range(per_batch)], [0] * per_batch
    for r in order:
        i = next((i for i, f in enumerate(fill) if f + lengths[r] <= pack_len), None)
        if i is None:
            batches.append([p for p in packs if p])
            packs, fill, i = [[] for _ in range(per_batch)], [0] * per_batch, 0
        packs[i].append(r)
        fill[i] += lengths[r]
    if any(fill):
        batches.append([p for p in packs if p])
    return batches


def packs_per_batch(pack_len: int, tcfg: TrainSettings) -> int:
    per_batch = tcfg.batch_tokens // pack_len
    if per_batch < 1:
        raise SystemExit(
            f"train.batch_tokens {tcfg.batch_tokens} is smaller than the longest "
            f"row ({pack_len} tokens); raise it"
        )
    return per_batch


def plan_segmented(lengths: list[int], segs: list[int], tcfg: TrainSettings):
    """(plans, pack_len, bounds): plans[epoch] = batches -> packs -> row indices; bounds[epoch]
    [segment] = (first batch, end batch) of that segment in the epoch. `segs[r]` is row r's
    segment; a segment with no training row gets an empty slice."""
    import torch

    pack_len = max(lengths)
    per_batch = packs_per_batch(pack_len, tcfg)
    n_seg = max(segs) + 1
    members = [[r for r, s in enumerate(segs) if s == k] for k in range(n_seg)]
    plans, bounds = [], []
    for epoch in range(tcfg.epochs):
        batches, where = [], []
        for k, rows in enumerate(members):
            gen = torch.Generator().manual_seed((tcfg.seed * 1_000_003 + epoch) * 10_007 + k)
            order = [rows[i] for i in torch.randperm(len(rows), generator=gen).tolist()]
            start = len(batches)
            batches += pack_order(order, lengths, pack_len, per_batch)
            where.append((start, len(batches)))
        plans.append(batches)
        bounds.append(where)
    return plans, pack_len, bounds


def step_span(plans: list, bounds: list, epoch: int, segment: int, total: int) -> tuple[int, int]:
    """[first step, end step) of one (epoch, segment), the global step count capped at `total`
    (train.max_steps)."""
    before = sum(len(p) for p in plans[:epoch])
    b0, b1 = bounds[epoch][segment]
    return min(before + b0, total), min(before + b1, total)


def peak_bytes(sizes: dict[str, int], segment_rows: int, epochs: int) -> dict:
    """Disk the shards of segment mode take at most: two consecutive (epoch, segment) indices'
    shards (one segment when there is only one index), next to all shards at once (offline).
    `sizes`: bytes per range."""
    segs = segment_ranges(list(sizes), segment_rows)
    each = [sum(sizes[r] for r in seg) for seg in segs]
    order = [each[k] for _, k in global_order(epochs, len(segs))]
    pairs = [a + b for a, b in zip(order, order[1:], strict=False)] or order
    return {
        "segment_rows": segment_rows,
        "segments": len(segs),
        "epochs": epochs,
        "captures": len(order),
        "segment_bytes": each,
        "peak_bytes": max(pairs),
        "offline_bytes": sum(each),
    }


def bound_text(peak: dict, human) -> str:
    """One line for the dry run and the plan: the segment bound next to the offline size."""
    return (
        f"segment mode (capture.keep false, train.segment_rows {peak['segment_rows']}): "
        f"{peak['segments']} segments x {peak['epochs']} epochs = {peak['captures']} captures; "
        f"shards on disk at most {human(peak['peak_bytes'])} (two consecutive segments) "
        f"against {human(peak['offline_bytes'])} offline"
    )
