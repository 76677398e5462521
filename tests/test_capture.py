"""Capture backend hf: the layer-id convention on tiny Llama and DeepSeek-V3 models, batching,
and the CLI end to end."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import save_file
from wf import planned_jobs, snakemake, tiny_config, with_defaults, write_config

from draftsmith.config.checks import aux_layer_ids
from draftsmith.engines.hf.engine import capture_shard, forward_states, pad_rows
from draftsmith.hidden.capture_base import plan_batches
from draftsmith.hidden.shards import open_shard
from draftsmith.stages.capture import main


def load(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def random_tokens(vocab: int, lengths: list[int], seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    total = sum(lengths)
    offsets = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    return {
        "input_ids": torch.randint(0, vocab, (total,), generator=g),
        "loss_mask": (torch.rand(total, generator=g) > 0.4).to(torch.uint8),
        "row_offsets": offsets,
    }


def check_convention(model, ids):
    """id i == output_hidden_states[i+1]; last == the lm_head input (reproduces the logits)."""
    batch = torch.randint(
        0, model.config.vocab_size, (2, 11), generator=torch.Generator().manual_seed(1)
    )
    aux, last = forward_states(model, batch, ids)
    with torch.inference_mode():
        ref = model(batch, output_hidden_states=True)
    hs = ref.hidden_states
    n = model.config.num_hidden_layers
    assert len(hs) == n + 1
    h = model.config.hidden_size
    assert aux.shape == (2, 11, 3 * h) and last.shape == (2, 11, h)
    for k, i in enumerate(ids):
        assert torch.equal(aux[..., k * h : (k + 1) * h], hs[i + 1]), (
            f"id {i} != hidden_states[{i + 1}]"
        )
        # and not the neighbouring convention (vLLM's / HF index i)
        assert not torch.allclose(aux[..., k * h : (k + 1) * h], hs[i])
    assert torch.equal(last, hs[n])  # transformers' last entry is post-norm
    with torch.inference_mode():
        logits = model.lm_head(last)
    cap = getattr(model.config, "final_logit_softcapping", None)  # Gemma-2: cap * tanh(z / cap)
    if cap:
        logits = cap * torch.tanh(logits / cap)
    torch.testing.assert_close(logits, ref.logits, rtol=0, atol=1e-5)
    # the final state is post-norm: applying the norm to the last layer's raw output gives it
    raw = {}
    hook = model.model.layers[n - 1].register_forward_hook(lambda m, i, o: raw.update(x=o))
    with torch.inference_mode():
        model.model(batch)
        torch.testing.assert_close(model.model.norm(raw["x"]), last, rtol=0, atol=1e-6)
    hook.remove()
    assert not torch.allclose(raw["x"], last, atol=1e-3)


def test_convention_llama(tiny_target):
    model = load(tiny_target)
    n = model.config.num_hidden_layers
    check_convention(model, aux_layer_ids("auto", n))  # [0, 2, 4] for 6 layers
    check_convention(model, [0, 3, 4])


def test_convention_deepseek_v3(tmp_path):
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    config = DeepseekV3Config(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        moe_intermediate_size=32,
        num_hidden_layers=8,
        num_attention_heads=4,
        num_key_value_heads=4,
        n_shared_experts=1,
        n_routed_experts=4,
        num_experts_per_tok=2,
        n_group=1,
        topk_group=1,
        first_k_dense_replace=1,
        kv_lora_rank=16,
        q_lora_rank=16,
        qk_rope_head_dim=8,
        qk_nope_head_dim=8,
        v_head_dim=8,
        max_position_embeddings=256,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = DeepseekV3ForCausalLM(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.08)
    ids = aux_layer_ids("auto", 8)
    assert ids == [1, 3, 4]
    check_convention(model, ids)


def test_plan_batches_budget_and_cover():
    lengths = [5, 30, 7, 7, 100, 1, 12]
    batches = plan_batches(lengths, 32)
    assert sorted(r for b in batches for r in b) == list(range(len(lengths)))
    for b in batches:
        longest = max(lengths[r] for r in b)
        assert len(b) == 1 or len(b) * longest <= 32
    assert [4] in batches  # the overlong row alone


def test_padded_batch_equals_single_rows(tiny_target):
    model = load(tiny_target)
    tok = random_tokens(model.config.vocab_size, [9, 3, 14])
    offsets = tok["row_offsets"].tolist()
    aux, last = forward_states(model, pad_rows(tok["input_ids"], offsets, [0, 1, 2]), [1, 2, 4])
    for r in range(3):
        a, b = offsets[r], offsets[r + 1]
        aux1, last1 = forward_states(model, tok["input_ids"][a:b][None], [1, 2, 4])
        torch.testing.assert_close(aux[r, : b - a], aux1[0], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(last[r, : b - a], last1[0], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_capture_shard_matches_forward(tiny_target, tmp_path, dtype):
    model = load(tiny_target)
    tok = random_tokens(model.config.vocab_size, [7, 19, 4, 11, 16], seed=3)
    out = tmp_path / "rows_000010-000015.safetensors"
    ids = [1, 2, 4]
    manifest = capture_shard(
        model,
        tok,
        out,
        ids,
        dtype,
        batch_tokens=40,
        manifest={"row_range": [10, 15], "target_fingerprint": "fp"},
        progress=False,
    )
    assert manifest["batches"] > 1
    shard = open_shard(
        out,
        expect={"aux_layer_ids": ids, "dtype": dtype, "target_fingerprint": "fp"},
        verify_sha=True,
    )
    assert len(shard) == 5 and shard.n_tokens == 57
    assert torch.equal(shard.input_ids, tok["input_ids"])
    assert torch.equal(shard.loss_mask, tok["loss_mask"])
    store = getattr(torch, dtype)
    tol = {"rtol": 0, "atol": 0} if dtype == "float32" else {"rtol": 1e-2, "atol": 1e-2}
    for r in range(5):
        row = shard.row(r)
        aux, last = forward_states(model, row["input_ids"][None], ids)
        assert row["aux_hidden_states"].dtype == store
        torch.testing.assert_close(
            row["aux_hidden_states"].float(),
            aux[0].to(store).float(),
            **(tol if dtype != "float32" else {"rtol": 1e-5, "atol": 1e-5}),
        )
        torch.testing.assert_close(
            row["last_hidden_states"].float(),
            last[0].to(store).float(),
            **(tol if dtype != "float32" else {"rtol": 1e-5, "atol": 1e-5}),
        )


def test_cli_end_to_end(tiny_target, tmp_path):
    from draftsmith.targets.model import fingerprint, write_meta

    target = shutil.copytree(tiny_target, tmp_path / "target")
    write_meta(target, source="path", origin=str(tiny_target))
    tok = random_tokens(300, [6, 9, 5], seed=5)
    tokens = tmp_path / "rows_000000-000003.safetensors"
    save_file(tok, str(tokens))
    out = tmp_path / "hidden" / "rows_000000-000003.safetensors"
    cfg = {
        "capture": {
            "backend": "hf",
            "role": "cpu",
            "aux_layer_ids": "auto",
            "dtype": "float16",
            "batch_tokens": 64,
        },
        "target": {"dtype": "float32"},
    }
    main(
        [
            "--cfg",
            json.dumps(cfg),
            "--tokens",
            str(tokens),
            "--target",
            str(target),
            "--out",
            str(out),
            "--threads",
            "1",
        ]
    )
    m = json.loads(out.with_suffix(".json").read_text())
    assert m["aux_layer_ids"] == [0, 2, 4] and m["dtype"] == "float16"
    assert m["row_range"] == [0, 3] and m["rows"] == 3 and m["tokens"] == 20
    assert m["target_fingerprint"] == fingerprint(target) and m["backend"] == "hf"
    assert m["convention"] == "sglang:output_of_layer" and m["norm"] == "post"
    shard = open_shard(out, expect={"target_fingerprint": fingerprint(target)}, verify_sha=True)
    assert shard.aux_hidden_states.dtype == torch.float16
    # more rows than the range name allows is refused (fewer is fine: rows dropped upstream)
    with pytest.raises(SystemExit, match="3 rows, but range rows_000000-000002 has only 2"):
        main(
            [
                "--cfg",
                json.dumps(cfg),
                "--tokens",
                str(tokens),
                "--target",
                str(target),
                "--out",
                str(tmp_path / "rows_000000-000002.safetensors"),
            ]
        )


@pytest.mark.slow
@pytest.mark.workflow
def test_rules_targeted_rebuild_and_staleness(tiny_target, tmp_path):
    """rules/hidden.smk in the real Snakefile on the tiny config: one shard on request, a
    deleted/corrupt shard alone, params staleness."""
    from draftsmith.hidden.shards import main as shards_main

    ranges = ["rows_000000-000016", "rows_000016-000032"]  # tiny_config: 32 training rows
    capture = {"batch_tokens": 32}

    def configure(**sections) -> None:
        sections["capture"] = {**capture, **sections.get("capture", {})}
        write_config(tmp_path, tiny_config(tiny_target, **sections))

    names = [f"results/hidden/{r}.safetensors" for r in ranges]
    shard = [tmp_path / n for n in names]
    configure()
    # targeted: one shard alone
    snakemake(tmp_path, "--cores", "2", names[1])
    assert shard[1].exists() and not shard[0].exists()
    snakemake(tmp_path, "--cores", "2", *names, "results/hidden/plan.json")
    assert "bytes" in json.loads((tmp_path / "results/hidden/plan.json").read_text())["shards"][0]
    first = [s.stat().st_mtime_ns for s in shard]

    def pending(**sections) -> dict[str, int]:
        configure(**sections)
        return planned_jobs(tmp_path, *names)

    assert pending() == {}
    assert pending(train={"lr": 0.1}) == {}  # train.* never touches shards
    assert pending(capture={"dtype": "float16"}) == {"capture": 2}
    assert pending(capture={"aux_layer_ids": [0, 1, 2]}) == {"capture": 2}
    unused = {"topk": 64, "topk_vocab": "draft", "scale_block": 64}  # keys of other modes
    assert pending(capture={"storage": unused}) == {}
    compact = {"aux": "float8_e4m3", "final": "topk"}  # a new storage mode: every shard stale
    assert pending(capture={"storage": compact})["capture"] == 2
    configure()
    # a corrupt shard is found by verify, deleted, and rebuilt alone
    with open(shard[0], "r+b") as f:
        f.seek(-100, 2)
        f.write(b"\xff" * 4)
    with pytest.raises(SystemExit, match="1 bad shard"):  # nonzero: a shard was bad
        shards_main(["verify", str(tmp_path / "results" / "hidden"), "--delete"])
    assert pending() == {"capture": 1}
    out = snakemake(tmp_path, "--cores", "2", *names)
    assert f"wildcards: rows={ranges[0]}" in out.stdout + out.stderr
    assert shard[1].stat().st_mtime_ns == first[1]
    assert shard[0].stat().st_mtime_ns != first[0]


def _cli_inputs(tiny_target, tmp_path):
    from draftsmith.targets.model import write_meta

    target = shutil.copytree(tiny_target, tmp_path / "target")
    write_meta(target, source="path", origin=str(tiny_target))
    tokens = tmp_path / "rows_000000-000003.safetensors"
    save_file(random_tokens(300, [6, 9, 5], seed=5), str(tokens))
    out = tmp_path / "hidden" / "rows_000000-000003.safetensors"
    cfg = with_defaults(
        {"capture": {"aux_layer_ids": "auto", "dtype": "float32", "batch_tokens": 8}}
    )
    args = ["--cfg", json.dumps(cfg), "--tokens", str(tokens), "--target", str(target)]
    return [*args, "--out", str(out)], out


def test_a_shard_that_cannot_fit_stops_before_the_capture(tiny_target, tmp_path, monkeypatch):
    import draftsmith.stages.capture as capture

    args, out = _cli_inputs(tiny_target, tmp_path)
    usage = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(capture.shutil, "disk_usage", lambda p: usage._replace(free=1000))
    with pytest.raises(SystemExit, match=r"not enough disk space for .*rows_000000-000003") as e:
        main(args)
    assert "has 1000 B free" in str(e.value) and "results/hidden/plan.json" in str(e.value)
    assert not out.parent.exists() or not list(out.parent.iterdir())


def test_disk_full_during_capture_is_a_clear_error(tiny_target, tmp_path, monkeypatch):
    import errno
    import os

    import draftsmith.hidden.writer as shard_writer

    args, out = _cli_inputs(tiny_target, tmp_path)
    real, calls = os.pwrite, []

    def pwrite(fd, data, pos):  # the disk fills up after the token tensors are written
        calls.append(pos)
        if len(calls) > 4:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(fd, data, pos)

    monkeypatch.setattr(shard_writer.os, "pwrite", pwrite)
    with pytest.raises(SystemExit, match="disk full while writing: not enough disk space") as e:
        main(args)
    assert "the shard needs" in str(e.value)
    assert list(out.parent.iterdir()) == []  # no temp file left behind
