"""Converters: ours -> speculators -> ours and ours -> SpecForge -> ours round trips, refusals."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from draftsmith.engines.hf.engine import capture_shard
from draftsmith.hidden.shards import manifest_path, open_shard
from draftsmith.interop.common import ConvertError, apply_norm, final_norm, load_legacy, remove_norm
from draftsmith.interop.convert import main, specforge_path

IDS = [1, 2, 4]


@pytest.fixture(scope="module")
def captured(tiny_target, tmp_path_factory):
    """(target dir with metadata, a captured bf16 shard for rows 2000..2004)."""
    from transformers import AutoModelForCausalLM

    from draftsmith.targets.model import fingerprint, write_meta

    root = tmp_path_factory.mktemp("convert")
    target = shutil.copytree(tiny_target, root / "target")
    write_meta(target, source="path", origin=str(tiny_target))
    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(7)
    lengths = [6, 13, 9, 4]
    t = sum(lengths)
    tokens = {
        "input_ids": torch.randint(0, model.config.vocab_size, (t,), generator=g),
        "loss_mask": (torch.rand(t, generator=g) > 0.5).to(torch.uint8),
        "row_offsets": torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()]),
    }
    shard = root / "hidden" / "rows_001998-002002.safetensors"  # crosses a SpecForge group
    capture_shard(
        model,
        tokens,
        shard,
        IDS,
        "bfloat16",
        64,
        {"row_range": [1998, 2002], "target_fingerprint": fingerprint(target), "target_layers": 6},
        progress=False,
    )
    return target, shard


def assert_same(a, b, exact_states: bool):
    assert torch.equal(a.input_ids, b.input_ids)
    assert torch.equal(a.loss_mask, b.loss_mask)
    assert torch.equal(a.row_offsets, b.row_offsets)
    assert a.aux_hidden_states.dtype == b.aux_hidden_states.dtype
    assert torch.equal(a.aux_hidden_states, b.aux_hidden_states)  # aux is never transformed
    if exact_states:
        assert torch.equal(a.last_hidden_states, b.last_hidden_states)
    else:  # norm removed and re-applied: equal within bf16 rounding
        torch.testing.assert_close(
            a.last_hidden_states.float(), b.last_hidden_states.float(), rtol=1.6e-2, atol=1e-2
        )
    ma, mb = a.manifest, b.manifest
    for key in ("row_range", "aux_layer_ids", "convention", "norm", "dtype", "target_fingerprint"):
        assert ma[key] == mb[key], key


def test_round_trip_speculators(captured, tmp_path):
    target, shard = captured
    main(
        [
            "to-speculators",
            "--shard",
            str(shard),
            "--target",
            str(target),
            "--out",
            str(tmp_path / "sp"),
            "--layout",
            "pt",
        ]
    )
    sample = load_legacy(tmp_path / "sp" / "data_1999.pt")
    assert set(sample) == {"input_ids", "hidden_states", "loss_mask"}
    assert len(sample["hidden_states"]) == 4 and sample["loss_mask"].dtype == torch.long
    # the stored final state is pre-norm: the target's norm maps it back to ours
    w, eps = final_norm(target)
    ours = open_shard(shard).row(1)["last_hidden_states"]
    torch.testing.assert_close(
        apply_norm(sample["hidden_states"][3], w, eps), ours.float(), rtol=1.6e-2, atol=1e-2
    )
    cfg = json.loads((tmp_path / "sp" / "data_config.json").read_text())
    assert cfg["hidden_states"]["layer_ids"] == [2, 3, 5, 6]
    back = tmp_path / "back" / "rows_001998-002002.safetensors"
    main(
        [
            "from-speculators",
            "--src",
            str(tmp_path / "sp"),
            "--target",
            str(target),
            "--out",
            str(back),
        ]
    )
    assert_same(open_shard(shard), open_shard(back, verify_sha=True), exact_states=False)
    conv = json.loads(manifest_path(back).read_text())["converted_from"]
    assert conv["format"] == "speculators-v1" and "applied" in conv["final_norm"]
    assert "input-of-layer" in conv["layer_numbering"] and "global row" in conv["sample_index"]


def test_round_trip_specforge(captured, tmp_path):
    target, shard = captured
    src = tmp_path / "sf"
    main(["to-specforge", "--shard", str(shard), "--out", str(src)])
    assert specforge_path(src, 1999, 2000) == src / "rows_0-2000" / "data_1999.ckpt"
    assert (src / "rows_2000-4000" / "data_2001.ckpt").is_file()
    d = load_legacy(src / "rows_0-2000" / "data_1999.ckpt")
    assert d["hidden_state"].shape == (1, 13, 64) and d["aux_hidden_state"].shape == (1, 13, 192)
    assert d["loss_mask"].dtype == torch.int64
    back = tmp_path / "back" / "rows_001998-002002.safetensors"
    main(["from-specforge", "--src", str(src), "--target", str(target), "--out", str(back)])
    assert_same(open_shard(shard), open_shard(back, verify_sha=True), exact_states=True)
    conv = json.loads(manifest_path(back).read_text())["converted_from"]
    assert conv["final_norm"].startswith("none") and "SGLang" in conv["layer_numbering"]


def test_specforge_any_names_and_gzip(captured, tmp_path):
    """SpecForge's readers take every *.ckpt / *.ckpt.gz below the directory, sorted by path
    (its own dumps are named by sample id); gzipped files are read too."""
    import gzip
    import io

    target, shard = captured
    plain = tmp_path / "plain"
    main(["to-specforge", "--shard", str(shard), "--out", str(plain)])
    src = tmp_path / "named"
    files = sorted(plain.rglob("*.ckpt"), key=lambda f: int(f.stem.split("_")[1]))
    for r, f in enumerate(files):  # sample ids that sort in row order; half of them gzipped
        dst = src / ("a" if r < 2 else "b") / f"run:{r:08d}.ckpt"
        dst.parent.mkdir(parents=True, exist_ok=True)
        if r % 2:
            buf = io.BytesIO(f.read_bytes())
            dst = dst.with_name(dst.name + ".gz")
            with gzip.open(dst, "wb") as g:
                g.write(buf.getvalue())
        else:
            shutil.copyfile(f, dst)
    shutil.copyfile(plain / "draftsmith.json", src / "draftsmith.json")
    back = tmp_path / "back" / "rows_000000-000004.safetensors"
    main(["from-specforge", "--src", str(src), "--target", str(target), "--out", str(back)])
    a, b = open_shard(shard), open_shard(back)
    assert torch.equal(a.input_ids, b.input_ids) and torch.equal(a.row_offsets, b.row_offsets)
    assert torch.equal(a.aux_hidden_states, b.aux_hidden_states)
    assert torch.equal(a.last_hidden_states, b.last_hidden_states)
    conv = json.loads(manifest_path(back).read_text())["converted_from"]
    assert "sorted path order" in conv["sample_index"]
    with pytest.raises(SystemExit, match="need 5 sample files"):
        out = tmp_path / "rows_000000-000005.safetensors"
        main(["from-specforge", "--src", str(src), "--target", str(target), "--out", str(out)])


def test_longer_loss_mask_truncated_and_ids_required(captured, tmp_path):
    target, shard = captured
    src = tmp_path / "sp"
    src.mkdir()
    s = open_shard(shard)
    h = 64
    for r in range(len(s)):
        row = s.row(r)
        aux = row["aux_hidden_states"]
        w, _ = final_norm(target)
        hs = [aux[:, k * h : (k + 1) * h].clone() for k in range(3)]
        hs.append(remove_norm(row["last_hidden_states"], w).bfloat16())
        mask = torch.cat([row["loss_mask"].long(), torch.ones(1, dtype=torch.long)])  # one longer
        torch.save(
            {"input_ids": row["input_ids"].clone(), "hidden_states": hs, "loss_mask": mask},
            src / f"data_{1998 + r}.pt",
        )
    out = tmp_path / "rows_001998-002002.safetensors"
    with pytest.raises(SystemExit, match="no draftsmith.json records the layer ids"):
        main(["from-speculators", "--src", str(src), "--target", str(target), "--out", str(out)])
    main(
        [
            "from-speculators",
            "--src",
            str(src),
            "--target",
            str(target),
            "--out",
            str(out),
            "--aux-layer-ids",
            "1,2,4",
        ]
    )
    assert torch.equal(open_shard(out).loss_mask, s.loss_mask)
    with pytest.raises(SystemExit, match=r"data_2002.pt: missing sample file"):
        main(
            [
                "from-speculators",
                "--src",
                str(src),
                "--target",
                str(target),
                "--aux-layer-ids",
                "1,2,4",
                "--out",
                str(tmp_path / "rows_001998-002003.safetensors"),
            ]
        )


class Foreign:
    """Stands for any class a hostile or version-skewed pickle could name."""

    def __init__(self):
        self.x = 1


def test_foreign_pickle_refused(tmp_path):
    path = tmp_path / "data_0.pt"
    torch.save({"input_ids": torch.arange(3), "extra": Foreign()}, path)
    with pytest.raises(ConvertError, match=r"data_0.pt: refused: it references .*Foreign"):
        load_legacy(path)
    path.write_bytes(b"not a torch file")
    with pytest.raises(ConvertError, match="data_0.pt: unreadable legacy file"):
        load_legacy(path)
