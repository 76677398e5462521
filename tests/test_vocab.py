"""Draft vocabulary: counts over masked tokens only, top-K sorted by id, d2t/t2d invariants."""

from __future__ import annotations

import pytest
import torch

from draftsmith.data.tokens import write_tokens
from draftsmith.data.vocab import (
    build_vocab,
    check_row_counts,
    check_vocab,
    count_tokens,
    load_vocab,
    main,
    save_vocab,
)


def _tokens_file(path, ids, mask):
    tensors = {
        "input_ids": torch.tensor(ids, dtype=torch.int64),
        "loss_mask": torch.tensor(mask, dtype=torch.uint8),
        "row_offsets": torch.tensor([0, len(ids)], dtype=torch.int64),
    }
    write_tokens(path, tensors, {"rows": 1})
    return path


def test_counts_only_masked_tokens(tmp_path):
    a = _tokens_file(tmp_path / "a.safetensors", [5, 5, 7, 9, 9, 9], [0, 1, 1, 1, 1, 0])
    b = _tokens_file(tmp_path / "b.safetensors", [7, 3, 3], [1, 1, 0])
    counts = count_tokens([a, b], vocab_size=12)
    assert counts.tolist() == [0, 0, 0, 1, 0, 1, 0, 2, 0, 2, 0, 0]


def test_top_k_sorted_by_id_and_invariants():
    counts = torch.tensor([0, 9, 0, 4, 4, 1, 7, 0, 3, 0], dtype=torch.int64)
    v = build_vocab(counts, 4)
    ids = v["d2t"] + torch.arange(4)
    # Top 4 by count are 1 (9), 6 (7), 3 and 4 (4 each, tie kept); 8 (3) is out.
    assert ids.tolist() == [1, 3, 4, 6]
    assert v["d2t"].dtype == torch.int64 and v["d2t"].tolist() == [1, 2, 2, 3]
    assert v["t2d"].dtype == torch.bool and v["t2d"].nonzero().flatten().tolist() == [1, 3, 4, 6]
    assert v["counts"].tolist() == [9, 4, 4, 7]
    check_vocab(v["d2t"], v["t2d"])


def test_ties_prefer_smaller_ids():
    counts = torch.tensor([2, 2, 2, 2, 5], dtype=torch.int64)
    ids = build_vocab(counts, 3)["d2t"] + torch.arange(3)
    assert ids.tolist() == [0, 1, 4]


def test_padding_with_unused_ids_when_data_is_small():
    counts = torch.zeros(20, dtype=torch.int64)
    counts[[4, 11, 17]] = torch.tensor([3, 2, 1])
    v = build_vocab(counts, 6)
    ids = (v["d2t"] + torch.arange(6)).tolist()
    assert ids == [0, 1, 2, 4, 11, 17]  # the 3 seen ids plus the 3 smallest unused ids
    assert int(v["t2d"].sum()) == 6
    assert v["counts"].tolist() == [0, 0, 0, 3, 2, 1]
    check_vocab(v["d2t"], v["t2d"])


def test_draft_vocab_larger_than_target_is_an_error():
    with pytest.raises(ValueError, match="exceeds the target vocabulary"):
        build_vocab(torch.ones(8, dtype=torch.int64), 9)


def test_check_vocab_rejects_broken_mappings():
    t2d = torch.zeros(10, dtype=torch.bool)
    t2d[[1, 2, 5]] = True
    check_vocab(torch.tensor([1, 1, 3]), t2d)
    with pytest.raises(ValueError, match="ascending"):
        check_vocab(torch.tensor([5, 1, -1]), t2d)  # ids 5, 2, 1
    with pytest.raises(ValueError, match="exactly"):
        t2d_extra = t2d.clone()
        t2d_extra[7] = True
        check_vocab(torch.tensor([1, 1, 3]), t2d_extra)
    with pytest.raises(ValueError, match="outside"):
        check_vocab(torch.tensor([1, 1, 20]), t2d)


def test_cli_end_to_end_and_load(tmp_path):
    (tmp_path / "target").mkdir()
    (tmp_path / "target" / "config.json").write_text('{"vocab_size": 50}')
    files = []
    gen = torch.Generator().manual_seed(0)
    for i in range(3):
        ids = torch.randint(0, 50, (200,), generator=gen).tolist()
        mask = (torch.rand(200, generator=gen) < 0.5).to(torch.uint8).tolist()
        files.append(str(_tokens_file(tmp_path / f"rows_{i}.safetensors", ids, mask)))
    out = tmp_path / "vocab" / "vocab.safetensors"
    main(
        [
            "--cfg",
            '{"draft": {"vocab_size": 16}}',
            "--target",
            str(tmp_path / "target"),
            "--out",
            str(out),
            "--tokens",
            *files,
        ]
    )
    d2t, t2d = load_vocab(out)
    assert d2t.shape == (16,) and t2d.shape == (50,)
    target_ids = d2t + torch.arange(16)
    assert t2d.nonzero().flatten().tolist() == target_ids.tolist()
    # the chosen ids are the 16 most frequent masked ids
    counts = count_tokens(files, 50)
    assert counts[target_ids].min() >= counts[~t2d].max()


def test_stale_tokens_file_is_refused(tmp_path):
    tok = _tokens_file(tmp_path / "rows_000000-000002.safetensors", [1, 2], [1, 1])
    write_tokens(
        tok,
        {
            "input_ids": torch.tensor([1, 2]),
            "loss_mask": torch.tensor([1, 1], dtype=torch.uint8),
            "row_offsets": torch.tensor([0, 1, 2]),
        },
        {"rows": 2},
    )
    rows = tmp_path / "rows_000000-000002.jsonl"
    rows.write_text("{}\n{}\n")
    check_row_counts([rows], [tok])
    rows.write_text("{}\n{}\n{}\n")
    with pytest.raises(ValueError, match="stale"):
        check_row_counts([rows], [tok])
    other = tmp_path / "rows_000002-000004.jsonl"
    other.write_text("{}\n{}\n")
    with pytest.raises(ValueError, match="not the same row range"):
        check_row_counts([other], [tok])


def test_load_vocab_refuses_inconsistent_file(tmp_path):
    path = tmp_path / "bad.safetensors"
    t2d = torch.zeros(10, dtype=torch.bool)
    t2d[[0, 3]] = True
    save_vocab(path, {"d2t": torch.tensor([0, 1]), "t2d": t2d}, {})  # d2t says ids 0, 2
    with pytest.raises(ValueError, match="bad.safetensors"):
        load_vocab(path)
