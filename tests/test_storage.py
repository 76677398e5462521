"""Storage modes: round trip and reader for every mode, corruption, teacher equivalence, capture,
converters and the disk estimate of compact shards."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from wf import with_defaults

from draftsmith.algorithms.batches import pack_batch, teacher_argmax_in_vocab, teacher_ok
from draftsmith.algorithms.eagle3.ttt import batch_teacher, teacher_logprobs
from draftsmith.hidden.shards import ShardError, manifest_path, open_shard
from draftsmith.hidden.storage import (
    Storage,
    StorageError,
    check_layout,
    decode_fp8,
    draft_vocab_fingerprint,
    encode_fp8,
    topk_teacher,
)
from draftsmith.hidden.writer import ShardWriter, estimate_bytes

H, V = 16, 300
MODES = {
    "reference": Storage(),
    "fp8": Storage(aux="float8_e4m3"),
    "fp8-block": Storage(aux="float8_e4m3", scale_block=4),
    "fp8-trained": Storage(aux="float8_e4m3", final="trained"),
    "trained": Storage(final="trained"),
    "topk": Storage(final="topk", topk=8),
    "fp8-topk": Storage(aux="float8_e4m3", final="topk", topk=8),
    "draft-topk": Storage(final="topk", topk=8, topk_vocab="draft"),
    "fp8-draft-topk": Storage(aux="float8_e4m3", final="topk", topk=8, topk_vocab="draft"),
}
DRAFT_IDS = torch.arange(0, V, 3)  # the draft vocabulary: every third target id (100 tokens)


def data(lengths=(5, 9, 3, 12), seed=0) -> dict:
    g = torch.Generator().manual_seed(seed)
    t = sum(lengths)
    aux = torch.randn(t, 3 * H, generator=g)
    aux[:, 3] *= 300.0  # an outlier channel, as real residual streams have
    return {
        "input_ids": torch.randint(0, V, (t,), generator=g),
        "loss_mask": (torch.rand(t, generator=g) > 0.4).to(torch.uint8),
        "row_offsets": torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()]),
        "aux": aux,
        "last": torch.randn(t, H, generator=g),
        "lm_head": torch.randn(V, H, generator=g),
    }


def writer_args(d: dict, storage: Storage, dtype="bfloat16", manifest=None, **extra) -> dict:
    """ShardWriter's keyword arguments for the rows of `d` in `storage`."""
    return dict(
        input_ids=d["input_ids"],
        loss_mask=d["loss_mask"],
        row_offsets=d["row_offsets"],
        hidden_size=H,
        dtype=dtype,
        manifest={} if manifest is None else manifest,
        storage=storage,
        **extra,
    )


def write(path, d: dict, storage: Storage, dtype="bfloat16"):
    manifest = {"row_range": [0, 4], "aux_layer_ids": [1, 2, 3], "target_fingerprint": "f"}
    with ShardWriter(
        path,
        **writer_args(
            d,
            storage,
            dtype,
            manifest,
            lm_head=d["lm_head"] if storage.final == "topk" else None,
            draft_ids=DRAFT_IDS if storage.draft_topk else None,
        ),
    ) as w:
        offs = d["row_offsets"].tolist()
        for r in reversed(range(len(offs) - 1)):  # out of order on purpose
            a, b = offs[r], offs[r + 1]
            w.write(a, d["aux"][a:b], d["last"][a:b])
    return w.manifest


def expected_trained(d: dict) -> torch.Tensor:
    """Positions q whose next token is in the same row and trained, by brute force."""
    offs = d["row_offsets"].tolist()
    out = torch.zeros(d["input_ids"].numel(), dtype=torch.bool)
    for a, b in zip(offs, offs[1:], strict=False):
        for q in range(a, b - 1):
            out[q] = bool(d["loss_mask"][q + 1])
    return out


def test_fp8_error_bound_per_block():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(64, 96, generator=g) * torch.logspace(-3, 3, 96)  # 6 decades across channels
    for block in (96, 8):
        q, scale = encode_fp8(x, block)
        assert q.dtype == torch.float8_e4m3fn and scale.shape == (64, 96 // block)
        y = decode_fp8(q, scale)
        s = scale.repeat_interleave(block, dim=1)
        # e4m3: 3 mantissa bits (relative error <= 2^-4) above 2^-6 * scale, then subnormal steps
        assert bool(((y - x).abs() <= x.abs() / 16 + s * 2**-10).all())
    assert torch.equal(decode_fp8(*encode_fp8(torch.zeros(2, 8), 8)), torch.zeros(2, 8))


@pytest.mark.parametrize("mode", list(MODES))
def test_round_trip_and_reader(tmp_path, mode):
    storage, d = MODES[mode], data()
    path = tmp_path / "rows_000000-000004.safetensors"
    manifest = write(path, d, storage)
    assert manifest["storage"]["mode"] == storage.name("bfloat16")
    assert json.loads(manifest_path(path).read_text())["storage"] == manifest["storage"]
    shard = open_shard(path, verify_sha=True)
    t = shard.n_tokens
    trained = expected_trained(d)
    assert torch.equal(shard.trained, trained)
    # aux: exact cast in the reference dtype, float8 within its bound
    aux = shard.aux(0, t)
    assert aux.dtype == torch.float32 and aux.shape == (t, 3 * H)
    if storage.aux == "dtype":
        assert torch.equal(aux, d["aux"].bfloat16().float())
    else:
        s = shard.aux_scales.repeat_interleave(storage.block(H), dim=1)
        assert bool(((aux - d["aux"]).abs() <= d["aux"].abs() / 16 + s * 2**-10).all())
        assert shard.aux_hidden_states.dtype == torch.float8_e4m3fn
    # teacher inputs: exact states where stored, the top-k of the full-vocabulary softmax
    teacher = shard.teacher(0, t)
    ref_last = d["last"].bfloat16()
    if storage.final == "states":
        assert torch.equal(teacher["last"], ref_last)
    elif storage.final == "trained":
        assert shard.last_hidden_states.shape == (int(trained.sum()), H)
        assert torch.equal(teacher["last"][trained], ref_last[trained])
        assert not teacher["last"][~trained].any()
    else:
        if storage.draft_topk:  # the teacher's own top-k over the draft vocabulary, draft ids
            logp = torch.log_softmax(d["last"] @ d["lm_head"][DRAFT_IDS].T, -1)
            teacher = {**teacher, "topk_ids": teacher.pop("draft_topk_ids")}
            full = (d["last"] @ d["lm_head"].T).argmax(-1)
            in_vocab = torch.isin(full, DRAFT_IDS)[trained]
            assert torch.equal(shard.teacher_in_vocab.bool(), in_vocab)
        else:
            logp = torch.log_softmax(d["last"] @ d["lm_head"].T, -1)
            assert "draft_topk_ids" not in teacher
        vals, ids = logp.topk(storage.topk, dim=-1)
        assert torch.equal(teacher["topk_ids"][trained], ids[trained])
        torch.testing.assert_close(
            teacher["topk_logprobs"][trained], vals[trained], rtol=1e-3, atol=1e-2
        )
        assert bool((teacher["topk_ids"][~trained] == -1).all())
        assert bool(torch.isinf(teacher["topk_logprobs"][~trained]).all())
    # row(i) and teacher(a, b) on a sub-range agree with the whole-shard view
    a, b = d["row_offsets"][1].item(), d["row_offsets"][2].item()
    row = shard.row(1)
    assert torch.equal(row["input_ids"], d["input_ids"][a:b])
    assert torch.equal(row["aux_hidden_states"].float(), aux[a:b])
    for key, value in shard.teacher(a, b).items():
        assert torch.equal(value, teacher["topk_ids" if key == "draft_topk_ids" else key][a:b])
    # size: what the disk estimate says, within its 4 KiB header allowance
    est = estimate_bytes(t, 4, H, "bfloat16", storage, int(trained.sum()), V)
    assert est - 4096 < path.stat().st_size <= est


def test_compact_modes_are_smaller(tmp_path):
    d = data(lengths=(40, 50, 30, 60))
    sizes = {}
    for mode, storage in MODES.items():
        path = tmp_path / mode / "rows_000000-000004.safetensors"
        write(path, d, storage)
        sizes[mode] = path.stat().st_size
    assert sizes["fp8-trained"] < sizes["fp8"] < sizes["reference"]
    assert sizes["fp8-topk"] < sizes["fp8"] and sizes["topk"] < sizes["reference"]
    assert sizes["trained"] < sizes["reference"]
    assert sizes["fp8-topk"] < sizes["fp8-draft-topk"] < sizes["fp8"]  # + one flag byte


def test_corrupt_compact_shard_caught_like_reference(tmp_path):
    from draftsmith.hidden.shards import verify_dir

    d = data()
    paths = {}
    for mode in ("reference", "fp8-topk"):
        paths[mode] = tmp_path / f"rows_00000{len(paths)}-00000{len(paths) + 1}.safetensors"
        write(paths[mode], d, MODES[mode])
    bad = paths["fp8-topk"]
    raw = bytearray(bad.read_bytes())
    raw[-40] ^= 0x01  # inside the top-k log-probs / loss mask region
    bad.write_bytes(bytes(raw))
    open_shard(bad)  # structure intact: only the checksum can tell
    with pytest.raises(ShardError, match="checksum mismatch"):
        open_shard(bad, verify_sha=True)
    problems = verify_dir(tmp_path, delete=True)
    assert len(problems) == 1 and str(bad) in problems[0]
    assert not bad.exists() and paths["reference"].exists()


def test_manifest_mode_must_match_tensors(tmp_path):
    d = data()
    path = tmp_path / "rows_000000-000004.safetensors"
    write(path, d, MODES["fp8-topk"])
    mpath = manifest_path(path)
    good = json.loads(mpath.read_text())
    edits = {
        "claims the reference layout": lambda m: m.pop("storage"),
        "wrong trained count": lambda m: m["storage"].update(trained_positions=3),
        "wrong scale block": lambda m: m["storage"].update(scale_block=8),
        "unknown mode": lambda m: m["storage"].update(final="zstd"),
        "wrong k": lambda m: m["storage"].update(topk=4),
    }
    shard = open_shard(path)
    tensors = {
        "loss_mask": shard.loss_mask,
        "row_offsets": shard.row_offsets,
    }
    for what, edit in edits.items():
        m = json.loads(json.dumps(good))
        edit(m)
        with pytest.raises(StorageError):  # the layout check alone
            check_layout(m, tensors)
        mpath.write_text(json.dumps(m))
        with pytest.raises(ShardError, match="rows_000000-000004"):  # and through open_shard
            open_shard(path)
        print(what, "refused")
    mpath.write_text(json.dumps(good))
    open_shard(path, verify_sha=True)


def test_writer_refusals(tmp_path):
    d = data()
    with pytest.raises(ShardError, match="lm_head"):
        ShardWriter(
            tmp_path / "rows_000000-000004.safetensors", **writer_args(d, Storage(final="topk"))
        )
    with pytest.raises(ShardError, match="does not divide"):
        write(
            tmp_path / "rows_000000-000004.safetensors",
            d,
            Storage(aux="float8_e4m3", scale_block=5),
        )
    with pytest.raises(StorageError, match="unknown keys"):
        Storage.from_config({"aux": "float8_e4m3", "bits": 4})
    with pytest.raises(StorageError, match="capture.storage.final"):
        Storage.from_config({"final": "logits"})
    inf = data()
    inf["aux"][2, 0] = float("inf")
    with pytest.raises(ShardError, match=r"row 0 \(token 2\): 1 non-finite values .* aux layer"):
        write(tmp_path / "rows_000000-000004.safetensors", inf, MODES["fp8"])
    assert not list(tmp_path.iterdir())  # nothing left behind


def test_training_teacher_same_in_every_mode(tmp_path):
    """Training's teacher (log-probs over the draft vocabulary, argmax flags) from each mode:
    identical at trained positions for reference/trained, and equal to it for top-k with k = V."""
    d = data()
    hot = torch.arange(0, V, 3)  # draft vocabulary: every third target id
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[hot] = True
    index = torch.full((V,), -1, dtype=torch.long)
    index[hot] = torch.arange(hot.numel())
    rows = d["lm_head"][hot]
    got = {}
    extra = {
        "topk-all": Storage(final="topk", topk=V),
        "draft-topk-all": Storage(final="topk", topk=hot.numel(), topk_vocab="draft"),
    }
    for mode, storage in {**MODES, **extra}.items():
        path = tmp_path / mode / "rows_000000-000004.safetensors"
        write(path, d, storage, dtype="float32")
        shard = open_shard(path)
        t = shard.n_tokens
        row = {"input_ids": shard.input_ids, "loss_mask": shard.loss_mask}
        row.update(ok=torch.zeros(t, dtype=torch.bool), aux=shard.aux(0, t), **shard.teacher(0, t))
        batch = pack_batch([[row]], 2, 3 * H, H)
        got[mode] = (batch_teacher(batch, rows, index)[0], teacher_ok(shard, d["lm_head"], t2d))
    trained = expected_trained(d)
    exact = teacher_logprobs(d["last"], rows)
    ok = teacher_argmax_in_vocab(d["last"], d["lm_head"], t2d, trained)
    for mode, (logp, flags) in got.items():
        assert torch.equal(flags, ok), mode
        assert not flags[~trained].any()
        if MODES.get(mode, Storage(final="topk")).final != "topk":
            assert torch.equal(logp[trained], exact[trained]), mode
        elif mode in ("topk-all", "draft-topk-all"):  # every entry kept: the exact teacher
            torch.testing.assert_close(logp[trained], exact[trained], rtol=0, atol=2e-2)
        elif "draft" in mode:  # the teacher's 8 largest, exact; the rest of its mass unlisted
            p = logp[trained].exp()
            top, at = exact[trained].topk(8, dim=-1)
            assert torch.equal(logp[trained].topk(8, dim=-1).indices, at)
            torch.testing.assert_close(logp[trained].gather(-1, at), top, rtol=0, atol=1e-2)
            assert int((p > 0).sum(-1).max()) == 8 and bool((p.sum(-1) < 1).all())
        else:  # k = 8 of 300: the draft-vocabulary entries among them, renormalized
            p = logp[trained].exp()
            assert torch.allclose(p.sum(-1), torch.ones(int(trained.sum())), atol=1e-5)
            assert torch.equal(
                logp[trained].argmax(-1)[ok[trained]], exact[trained].argmax(-1)[ok[trained]]
            )
            assert int((p > 0).sum(-1).max()) <= 8


def test_topk_ids_outside_the_vocabulary_refused(tmp_path):
    d = data()
    path = tmp_path / "rows_000000-000004.safetensors"
    write(path, d, MODES["topk"])
    shard = open_shard(path)
    with pytest.raises(ValueError, match="top-k ids outside"):
        teacher_ok(shard, d["lm_head"][:100], torch.ones(100, dtype=torch.bool))


def test_topk_teacher_padding_is_uniform():
    ids = torch.tensor([[[5, -1], [-1, -1]]])
    logp = torch.tensor([[[-0.1, float("-inf")], [float("-inf"), float("-inf")]]])
    index = torch.full((10,), -1, dtype=torch.long)
    index[5] = 2
    out = topk_teacher(ids, logp, index, 4)
    assert out.shape == (1, 2, 4)
    assert out[0, 0, 2] == 0 and torch.isinf(out[0, 0, [0, 1, 3]]).all()
    torch.testing.assert_close(out[0, 1].exp(), torch.full((4,), 0.25))


def test_tail_bucket_loss():
    """A teacher that lists k tokens and leaves mass r: the loss is the cross-entropy of both
    distributions coarsened to (each listed token, the rest as one outcome), so the draft that
    minimizes it puts exactly p on each listed token and r on the rest together; an exact teacher
    (every token listed) or a renormalized top-k gets no tail term."""
    from draftsmith.algorithms.eagle3.ttt import soft_cross_entropy, tail_mass

    g = torch.Generator().manual_seed(0)
    exact = torch.log_softmax(torch.randn(5, 12, generator=g) * 2, -1)
    logq = torch.log_softmax(torch.randn(5, 12, generator=g), -1)

    def ce(teacher, lq):
        p = teacher.exp()
        return soft_cross_entropy(teacher, p, tail_mass(teacher, p), lq)

    assert tail_mass(exact, exact.exp()).eq(0).all()
    torch.testing.assert_close(ce(exact, logq), -(exact.exp() * logq).sum())
    top, at = exact.topk(3, dim=-1)
    listed = torch.full_like(exact, float("-inf")).scatter(-1, at, top)
    p = listed.exp()
    r = 1 - p.sum(-1)
    assert bool((tail_mass(listed, p) - r).abs().max() < 1e-6) and bool((r > 0.01).all())
    unlisted = logq.masked_fill(torch.isfinite(listed), float("-inf")).logsumexp(-1)
    torch.testing.assert_close(ce(listed, logq), -(p * logq).sum() - (r * unlisted).sum())
    renorm = listed - listed.logsumexp(-1, keepdim=True)  # sums to 1: no tail term
    assert tail_mass(renorm, renorm.exp()).eq(0).all()
    torch.testing.assert_close(ce(renorm, logq), -(renorm.exp() * logq).sum())
    # the minimizer: listed tokens get their p, the unlisted ones r in total
    z = torch.zeros(5, 12, requires_grad=True)
    opt = torch.optim.Adam([z], lr=0.1)
    for _ in range(1500):
        opt.zero_grad()
        ce(listed, torch.log_softmax(z, -1)).backward()
        opt.step()
    q = torch.softmax(z.detach(), -1)
    torch.testing.assert_close(q.gather(-1, at), p.gather(-1, at), rtol=0, atol=2e-3)
    torch.testing.assert_close(q.sum(-1) - q.gather(-1, at).sum(-1), r, rtol=0, atol=2e-3)


def test_draft_topk_needs_its_vocabulary(tmp_path):
    d = data()
    storage = MODES["fp8-draft-topk"]
    kwargs = writer_args(d, storage, lm_head=d["lm_head"])
    with pytest.raises(ShardError, match="draft vocabulary"):
        ShardWriter(tmp_path / "rows_000000-000004.safetensors", **kwargs)
    with pytest.raises(ShardError, match="outside the target vocabulary"):
        ShardWriter(tmp_path / "a.safetensors", draft_ids=torch.tensor([0, V]), **kwargs)
    with pytest.raises(StorageError, match="exceeds the draft vocabulary"):
        Storage(final="topk", topk=8, topk_vocab="draft").record(
            "bfloat16", H, V, 3, torch.arange(4)
        )
    with pytest.raises(StorageError, match="topk_vocab"):
        Storage.from_config({"final": "topk", "topk_vocab": "full"})
    path = tmp_path / "rows_000000-000004.safetensors"
    write(path, d, storage)
    m = json.loads(manifest_path(path).read_text())
    assert m["storage"]["draft_vocab_size"] == DRAFT_IDS.numel()
    assert m["storage"]["draft_vocab_fingerprint"] == draft_vocab_fingerprint(DRAFT_IDS)
    assert draft_vocab_fingerprint(DRAFT_IDS) != draft_vocab_fingerprint(DRAFT_IDS.flip(0))
    shard = open_shard(path)
    tensors = {"loss_mask": shard.loss_mask, "row_offsets": shard.row_offsets}
    for key in ("draft_vocab_size", "draft_vocab_fingerprint"):
        bad = json.loads(json.dumps(m))
        bad["storage"].pop(key)
        with pytest.raises(StorageError, match="draft_vocab"):
            check_layout(bad, tensors)


def test_capture_fp8_topk_matches_model(tiny_target, tmp_path):
    """capture_shard in the compact mode: top-k of the model's own logits, float8 aux states."""
    from transformers import AutoModelForCausalLM

    from draftsmith.engines.hf.engine import capture_shard, forward_states

    model = AutoModelForCausalLM.from_pretrained(tiny_target, dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(3)
    lengths = [7, 11, 5]
    t = sum(lengths)
    tokens = {
        "input_ids": torch.randint(0, model.config.vocab_size, (t,), generator=g),
        "loss_mask": (torch.rand(t, generator=g) > 0.3).to(torch.uint8),
        "row_offsets": torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()]),
    }
    storage = Storage(aux="float8_e4m3", final="topk", topk=5)
    out = tmp_path / "rows_000000-000003.safetensors"
    capture_shard(model, tokens, out, [1, 2, 4], "bfloat16", 64, {}, False, storage)
    shard = open_shard(out, verify_sha=True)
    offs = tokens["row_offsets"].tolist()
    for r in range(3):
        a, b = offs[r], offs[r + 1]
        aux, _ = forward_states(model, tokens["input_ids"][a:b][None], [1, 2, 4])
        with torch.no_grad():
            logits = model(input_ids=tokens["input_ids"][a:b][None]).logits[0]
        trained = shard.trained[a:b]
        teacher = shard.teacher(a, b)
        assert torch.equal(teacher["topk_ids"][trained], logits.topk(5, -1).indices[trained])
        torch.testing.assert_close(shard.aux(a, b), aux[0], rtol=1 / 16, atol=1e-3)


def test_convert_compact_modes(tmp_path, tiny_target):
    """to-specforge dequantizes float8 shards and refuses top-k ones; from-specforge writes any
    mode (top-k through the target's lm_head)."""
    from draftsmith.interop.common import ConvertError, lm_head_weight
    from draftsmith.interop.convert import main, to_specforge
    from draftsmith.targets.model import write_meta

    target = shutil.copytree(tiny_target, tmp_path / "target")
    write_meta(target, source="path", origin=str(tiny_target))
    head = lm_head_weight(target)
    h = head.shape[1]
    g = torch.Generator().manual_seed(5)
    lengths = [6, 9, 4]
    t = sum(lengths)
    d = {
        "input_ids": torch.randint(0, head.shape[0], (t,), generator=g),
        "loss_mask": (torch.rand(t, generator=g) > 0.3).to(torch.uint8),
        "row_offsets": torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()]),
        "aux": torch.randn(t, 3 * h, generator=g),
        "last": torch.randn(t, h, generator=g),
    }

    def make(name, storage):
        path = tmp_path / name / "rows_000000-000003.safetensors"
        with ShardWriter(
            path,
            input_ids=d["input_ids"],
            loss_mask=d["loss_mask"],
            row_offsets=d["row_offsets"],
            hidden_size=h,
            dtype="bfloat16",
            manifest={"row_range": [0, 3], "aux_layer_ids": [1, 2, 4]},
            storage=storage,
            lm_head=head,
        ) as w:
            w.write(0, d["aux"], d["last"])
        return path

    fp8 = make("fp8", Storage(aux="float8_e4m3"))
    to_specforge(fp8, tmp_path / "sf", 2000)
    sample = torch.load(tmp_path / "sf" / "rows_0-2000" / "data_1.ckpt", weights_only=True)
    assert sample["aux_hidden_state"].dtype == torch.bfloat16
    assert torch.equal(
        sample["aux_hidden_state"][0].float(), open_shard(fp8).aux(6, 15).bfloat16().float()
    )
    with pytest.raises(ConvertError, match="needs it at every token"):
        to_specforge(make("topk", Storage(final="topk", topk=4)), tmp_path / "sf2", 2000)

    # SpecForge samples of the reference shard -> a float8 + top-k shard
    to_specforge(make("ref", Storage()), tmp_path / "sf3", 2000)
    out = tmp_path / "back" / "rows_000000-000003.safetensors"
    main(
        [
            "from-specforge",
            "--src",
            str(tmp_path / "sf3"),
            "--target",
            str(target),
            "--out",
            str(out),
            "--storage",
            '{"aux": "float8_e4m3", "final": "topk", "topk": 4}',
        ]
    )
    back, direct = (
        open_shard(out, verify_sha=True),
        open_shard(make("direct", Storage(aux="float8_e4m3", final="topk", topk=4))),
    )
    assert back.manifest["storage"] == direct.manifest["storage"]
    for key in ("aux_hidden_states", "aux_scales", "teacher_topk_ids"):
        # from bf16 states (the SpecForge copy) vs from float32 ones: equal up to rounding
        assert getattr(back, key).shape == getattr(direct, key).shape
    assert (back.teacher_topk_ids[:, 0] == direct.teacher_topk_ids[:, 0]).float().mean() > 0.9
    with pytest.raises(SystemExit, match="storage"):
        main(
            [
                "from-specforge",
                "--src",
                str(tmp_path / "sf3"),
                "--target",
                str(target),
                "--out",
                str(out),
                "--storage",
                '{"aux": "int4"}',
            ]
        )


def test_plan_uses_storage_mode(tiny_target, tmp_path):
    from safetensors.torch import save_file

    from draftsmith.hidden.plan import make_plan

    d = data(lengths=(20, 30))
    tok = tmp_path / "tokens" / "rows_000000-000002.safetensors"
    tok.parent.mkdir()
    save_file({k: d[k] for k in ("input_ids", "loss_mask", "row_offsets")}, str(tok))
    ref = make_plan(with_defaults({}), [tok], tiny_target, tmp_path / "hidden")
    cfg = with_defaults(
        {"capture": {"storage": {"aux": "float8_e4m3", "final": "topk", "topk": 8}}}
    )
    small = make_plan(cfg, [tok], tiny_target, tmp_path / "hidden")
    assert small["storage"] == "float8_e4m3+topk8" and ref["storage"] == "bfloat16"
    hidden = json.loads((tiny_target / "config.json").read_text())["hidden_size"]
    p = small["shards"][0]["trained_positions"]
    assert p == int(expected_trained(d).sum())
    assert ref["bytes_per_token"] == 4 * hidden * 2 + 9
    vocab = json.loads((tiny_target / "config.json").read_text())["vocab_size"]
    per_token = 3 * hidden + 4 * 3 + 9 + p * 8 * 4 / 50  # fp8 aux, scales, ids+mask, top-k
    assert abs(small["bytes_per_token"] - per_token) < 1.0
    assert small["total_bytes"] == estimate_bytes(
        50, 2, hidden, "bfloat16", Storage.from_config(cfg["capture"]["storage"]), p, vocab
    )


def test_capture_cli_compact_mode(tiny_target, tmp_path):
    """`python -m draftsmith capture` with capture.storage: the manifest records the mode."""
    from safetensors.torch import save_file

    from draftsmith.stages.capture import main
    from draftsmith.targets.model import write_meta

    target = shutil.copytree(tiny_target, tmp_path / "target")
    write_meta(target, source="path", origin=str(tiny_target))
    d = data(lengths=(6, 9, 5))
    tokens = tmp_path / "rows_000000-000003.safetensors"
    save_file({k: d[k] for k in ("input_ids", "loss_mask", "row_offsets")}, str(tokens))
    out = tmp_path / "hidden" / "rows_000000-000003.safetensors"
    storage = {"aux": "float8_e4m3", "final": "topk", "topk": 6, "scale_block": 0}
    cfg = with_defaults(
        {"capture": {"aux_layer_ids": "auto", "batch_tokens": 64, "storage": storage}}
    )
    args = ["--tokens", str(tokens), "--target", str(target), "--out", str(out)]
    main(["--cfg", json.dumps(cfg), *args, "--threads", "1"])
    shard = open_shard(out, verify_sha=True)
    assert shard.manifest["storage"]["mode"] == "float8_e4m3+topk6"
    assert shard.teacher_topk_ids.shape == (int(expected_trained(d).sum()), 6)
    bad = {**cfg, "capture": {**cfg["capture"], "storage": {"final": "logits"}}}
    with pytest.raises(SystemExit, match="capture.storage.final"):
        main(["--cfg", json.dumps(bad), *args])


def test_recode_trained_capture_to_fp8_topk(tmp_path, tiny_target):
    """`convert recode`: a `trained` shard rewritten as float8 + top-k equals writing that mode
    directly from the same states (the top-k recomputed from the stored bf16 states)."""
    from draftsmith.interop.common import ConvertError, lm_head_weight
    from draftsmith.interop.convert import main

    head = lm_head_weight(tiny_target)
    h = head.shape[1]
    g = torch.Generator().manual_seed(9)
    lengths = [7, 5, 8]
    t = sum(lengths)
    kw = {
        "input_ids": torch.randint(0, head.shape[0], (t,), generator=g),
        "loss_mask": (torch.rand(t, generator=g) > 0.3).to(torch.uint8),
        "row_offsets": torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()]),
        "hidden_size": h,
        "dtype": "bfloat16",
        "manifest": {"row_range": [0, 3], "aux_layer_ids": [1, 2, 4]},
    }
    aux, last = torch.randn(t, 3 * h, generator=g), torch.randn(t, h, generator=g).bfloat16()
    src = tmp_path / "src" / "rows_000000-000003.safetensors"
    with ShardWriter(src, **kw, storage=Storage(final="trained")) as w:
        w.write(0, aux, last)
    want = Storage(aux="float8_e4m3", final="topk", topk=5)
    direct = tmp_path / "direct" / "rows_000000-000003.safetensors"
    with ShardWriter(direct, **kw, storage=want, lm_head=head) as w:
        w.write(0, aux.bfloat16(), last)
    out = tmp_path / "out" / "rows_000000-000003.safetensors"
    spec = '{"aux": "float8_e4m3", "final": "topk", "topk": 5}'
    main(
        [
            "recode",
            "--shard",
            str(src),
            "--out",
            str(out),
            "--storage",
            spec,
            "--target",
            str(tiny_target),
        ]
    )
    a, b = open_shard(out, verify_sha=True), open_shard(direct)
    assert a.manifest["storage"] == b.manifest["storage"]
    assert a.manifest["recoded_from"]["storage"]["final"] == "trained"
    for key in ("aux_hidden_states", "aux_scales", "teacher_topk_ids", "teacher_topk_logprobs"):
        assert torch.equal(getattr(a, key).view(torch.uint8), getattr(b, key).view(torch.uint8)), (
            key
        )
    with pytest.raises(ConvertError, match="no final states"):
        from draftsmith.interop.convert import recode

        recode(out, tmp_path / "x" / "rows_000000-000003.safetensors", Storage(), None, "cpu")


def _vocab_file(path, vocab_size: int, draft: torch.Tensor):
    from draftsmith.data.vocab import save_vocab

    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[draft] = True
    d2t = draft - torch.arange(draft.numel())
    save_vocab(path, {"d2t": d2t, "t2d": t2d}, {})
    return path


def test_capture_cli_and_recode_draft_topk(tiny_target, tmp_path):
    """capture with `topk_vocab: draft` and --vocab: the teacher's own top-k (the model's
    logits restricted to the draft vocabulary, log-softmaxed), draft ids, argmax flags; without
    --vocab refused; `recode --vocab` of a trained shard equals writing the mode directly;
    from-* refuse the mode (it needs the vocabulary: recode)."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    from draftsmith.interop.common import ConvertError, lm_head_weight
    from draftsmith.interop.convert import main as convert_main
    from draftsmith.stages.capture import main
    from draftsmith.targets.model import write_meta

    target = shutil.copytree(tiny_target, tmp_path / "target")
    write_meta(target, source="path", origin=str(tiny_target))
    head = lm_head_weight(target)
    n_vocab = head.shape[0]
    draft = torch.arange(1, n_vocab, 2)[:40]
    vocab = _vocab_file(tmp_path / "vocab.safetensors", n_vocab, draft)
    d = data(lengths=(6, 9, 5))
    d["input_ids"] = d["input_ids"] % n_vocab
    tokens = tmp_path / "rows_000000-000003.safetensors"
    save_file({k: d[k] for k in ("input_ids", "loss_mask", "row_offsets")}, str(tokens))
    out = tmp_path / "hidden" / "rows_000000-000003.safetensors"
    storage = {"aux": "float8_e4m3", "final": "topk", "topk": 6, "topk_vocab": "draft"}
    cfg = with_defaults(
        {"capture": {"aux_layer_ids": "auto", "batch_tokens": 64, "storage": storage}}
    )
    args = ["--cfg", json.dumps(cfg), "--tokens", str(tokens), "--target", str(target)]
    with pytest.raises(SystemExit, match="--vocab"):
        main([*args, "--out", str(out)])
    main([*args, "--out", str(out), "--vocab", str(vocab), "--threads", "1"])
    shard = open_shard(out, verify_sha=True)
    assert shard.manifest["storage"]["mode"] == "float8_e4m3+topk6-draft"
    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    offs = d["row_offsets"].tolist()
    for r in range(3):
        a, b = offs[r], offs[r + 1]
        with torch.no_grad():
            logits = model(input_ids=d["input_ids"][a:b][None]).logits[0]
        trained = shard.trained[a:b]
        teacher = shard.teacher(a, b)
        vals, ids = torch.log_softmax(logits[:, draft], -1).topk(6, -1)
        assert torch.equal(teacher["draft_topk_ids"][trained], ids[trained])
        torch.testing.assert_close(
            teacher["topk_logprobs"][trained], vals[trained], atol=2e-3, rtol=0
        )
    in_vocab = torch.isin(
        torch.cat(
            [
                model(input_ids=d["input_ids"][a:b][None]).logits[0].argmax(-1)
                for a, b in zip(offs, offs[1:], strict=False)
            ]
        ),
        draft,
    )
    assert torch.equal(shard.teacher_in_vocab.bool(), in_vocab[shard.trained])

    # recode: a trained shard -> this mode, the same bytes as writing it directly
    g = torch.Generator().manual_seed(2)
    t = d["input_ids"].numel()
    aux, last = (
        torch.randn(t, 3 * head.shape[1], generator=g),
        torch.randn(t, head.shape[1], generator=g),
    )
    kw = {k: d[k] for k in ("input_ids", "loss_mask", "row_offsets")}
    kw.update(hidden_size=head.shape[1], dtype="bfloat16", manifest={"row_range": [0, 3]})
    src = tmp_path / "src" / "rows_000000-000003.safetensors"
    with ShardWriter(src, **kw, storage=Storage(final="trained")) as w:
        w.write(0, aux, last.bfloat16())
    direct = tmp_path / "direct" / "rows_000000-000003.safetensors"
    st = Storage.from_config(storage)
    with ShardWriter(direct, **kw, storage=st, lm_head=head, draft_ids=draft) as w:
        w.write(0, aux.bfloat16(), last.bfloat16())
    rec = tmp_path / "rec" / "rows_000000-000003.safetensors"
    spec = ["--storage", json.dumps(storage), "--target", str(target)]
    with pytest.raises(SystemExit, match="--vocab"):
        convert_main(["recode", "--shard", str(src), "--out", str(rec), *spec])
    convert_main(["recode", "--shard", str(src), "--out", str(rec), *spec, "--vocab", str(vocab)])
    x, y = open_shard(rec, verify_sha=True), open_shard(direct)
    assert x.manifest["storage"] == y.manifest["storage"]
    for key in ("teacher_topk_ids", "teacher_topk_logprobs", "teacher_in_vocab"):
        assert torch.equal(getattr(x, key).view(torch.uint8), getattr(y, key).view(torch.uint8))
    from draftsmith.interop.common import write_shard

    with pytest.raises(ConvertError, match="recode"):
        write_shard(tmp_path / "z.safetensors", [], None, "bfloat16", {}, st, target)


def test_training_refuses_another_draft_vocabulary(tmp_path):
    from draftsmith.hidden.storage import check_draft_vocab

    d = data()
    path = tmp_path / "rows_000000-000004.safetensors"
    write(path, d, MODES["draft-topk"])
    m = open_shard(path).manifest
    check_draft_vocab(m, DRAFT_IDS)  # the vocabulary it was stored over
    check_draft_vocab(open_shard(path).manifest | {"storage": {}}, DRAFT_IDS[:5])  # no top-k
    with pytest.raises(StorageError, match="another draft vocabulary"):
        check_draft_vocab(m, torch.arange(0, V, 2)[: DRAFT_IDS.numel()])
