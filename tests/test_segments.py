"""Segments (draftsmith.hidden.segments, segcapture): the order by segment, the steps of each segment,
the disk bound, the config checks and the per-tensor record of a capture. Fast: no workflow."""

from __future__ import annotations

import copy

import pytest
import torch
from safetensors.torch import save_file

from draftsmith.config.checks import ConfigError, check_segments, range_name
from draftsmith.config.settings import section
from draftsmith.hidden.segments import (
    global_order,
    peak_bytes,
    plan_segmented,
    segment_ranges,
    step_span,
)
from draftsmith.stages.segcapture import compare, tensor_digests
from draftsmith.train.data import plan_epochs, plan_rows

TRAIN = {"epochs": 3, "seed": 5, "batch_tokens": 64, "max_steps": 0}
TCFG = section("train", TRAIN)


def rows_of(n_ranges: int, per_range: int, gen_seed: int = 0):
    """(names, rows, lengths): n_ranges ranges of per_range rows of random lengths 3..20."""
    gen = torch.Generator().manual_seed(gen_seed)
    names = [range_name(i * per_range, (i + 1) * per_range) for i in range(n_ranges)]
    rows, lengths = [], []
    for s in range(n_ranges):
        start = 0
        for _ in range(per_range):
            n = int(torch.randint(3, 21, (1,), generator=gen))
            rows.append((s, start, start + n))
            lengths.append(n)
            start += n
    return names, rows, lengths


def test_batches_stay_within_a_segment_and_cover_every_row_each_epoch():
    names, rows, lengths = rows_of(6, 8)
    segs = [s // 2 for s, _, _ in rows]  # segment_rows = 2 ranges
    plans, pack_len, bounds = plan_segmented(lengths, segs, TCFG)
    assert pack_len == max(lengths)
    for epoch, batches in enumerate(plans):
        seen = sorted(r for batch in batches for pack in batch for r in pack)
        assert seen == list(range(len(rows)))
        assert [b for b, _ in bounds[epoch]] == [0, *[e for _, e in bounds[epoch][:-1]]]
        for k, (b0, b1) in enumerate(bounds[epoch]):
            for batch in batches[b0:b1]:
                assert {segs[r] for pack in batch for r in pack} == {k}
                assert all(sum(lengths[r] for r in pack) <= pack_len for pack in batch)
    assert plans[0] != plans[1], "every epoch shuffles again"
    again, _, _ = plan_segmented(lengths, segs, TCFG)
    assert again == plans, "seeded: the same plan every time"


def test_offline_order_is_the_old_one_without_segment_rows_and_by_segment_with_it():
    names, rows, lengths = rows_of(4, 8)
    assert plan_rows(rows, names, TCFG) == plan_epochs(lengths, TCFG)
    cfg = section("train", {**TRAIN, "segment_rows": 16})
    plans, pack_len = plan_rows(rows, names, cfg)
    want, _, _ = plan_segmented(lengths, [s // 2 for s, _, _ in rows], cfg)
    assert (plans, pack_len) == (want, max(lengths))


def test_segment_spans_tile_the_run_in_order():
    _, rows, lengths = rows_of(4, 8)
    segs = [s for s, _, _ in rows]
    plans, _, bounds = plan_segmented(lengths, segs, TCFG)
    total = sum(len(p) for p in plans)
    spans = [step_span(plans, bounds, e, k, total) for e, k in global_order(3, 4)]
    assert spans[0][0] == 0 and spans[-1][1] == total
    assert all(a[1] == b[0] for a, b in zip(spans, spans[1:], strict=False))
    capped = [step_span(plans, bounds, e, k, 5) for e, k in global_order(3, 4)]
    assert capped[-1] == (5, 5) and max(b for _, b in capped) == 5  # train.max_steps


def test_disk_bound_is_two_consecutive_segments():
    sizes = {range_name(16 * i, 16 * (i + 1)): 100 + i for i in range(8)}
    peak = peak_bytes(sizes, 32, 2)  # 4 segments of 2 ranges
    assert peak["segment_bytes"] == [201, 205, 209, 213]
    assert peak["peak_bytes"] == 209 + 213 and peak["offline_bytes"] == sum(sizes.values())
    assert peak_bytes(sizes, 128, 1)["peak_bytes"] == sum(sizes.values())  # one capture
    assert peak_bytes(sizes, 128, 2)["peak_bytes"] == 2 * sum(sizes.values())  # its next epoch
    with pytest.raises(ValueError, match="without ranges"):
        segment_ranges([range_name(0, 16), range_name(32, 48)], 16)


def config(**train) -> dict:
    base = {
        "data": {"rows_per_shard": 16},
        "capture": {"keep": False},
        "train": {"segment_rows": 32, "nproc": 1, "eval_rows": 0},
    }
    out = copy.deepcopy(base)
    out["train"].update(train)
    return out


@pytest.mark.parametrize(
    ("train", "message"),
    [
        ({"segment_rows": 24}, "not a multiple of data.rows_per_shard"),
        ({"segment_rows": 0}, "needs train.segment_rows"),
        ({"nproc": 2}, "train.nproc = 2"),
        ({"eval_rows": 4}, "train.eval_rows = 4"),
    ],
)
def test_segment_config_errors_name_the_key(train, message):
    check_segments(config())
    with pytest.raises(ConfigError, match=message):
        check_segments(config(**train))


def test_tensor_record_tells_identical_from_different_captures(tmp_path):
    a = {"aux": torch.arange(12, dtype=torch.float32).reshape(3, 4), "ids": torch.arange(3)}
    save_file(a, str(tmp_path / "a.safetensors"))
    b = {**a, "aux": a["aux"].clone()}
    b["aux"][1, 2] += 0.5
    save_file(b, str(tmp_path / "b.safetensors"))
    sha_a, stats_a = tensor_digests(tmp_path / "a.safetensors")
    sha_b, stats_b = tensor_digests(tmp_path / "b.safetensors")
    assert sha_a["ids"] == sha_b["ids"] and sha_a["aux"] != sha_b["aux"]
    first = {"tensor_sha256": sha_a, "tensor_stats": stats_a}
    assert compare(first, first) == {"bit_identical": True}
    got = compare({"tensor_sha256": sha_b, "tensor_stats": stats_b}, first)
    assert got == {"bit_identical": False, "differs": ["aux"], "max_stat_diff": 0.5}
