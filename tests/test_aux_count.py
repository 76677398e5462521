"""Any count of aux layers, not a literal three: capture.aux_layer_ids with K ids gives shards of
K aux states per token, a draft whose fc reads K x hidden, and an export both engines size from
its K ids (SGLang's and vLLM's EAGLE-3 classes and DFlash's read the count from the config). The
default (auto: EAGLE-3's three) is untouched: tests/test_workflow_staleness.py proves a built
default plans no job."""

from __future__ import annotations

import json

import pytest
import torch
from test_families import SMALL, train_on_tiny_target

from draftsmith.config.checks import aux_layer_count, aux_layer_ids
from draftsmith.hidden.shards import open_shard
from draftsmith.hidden.storage import Storage, layout
from draftsmith.hidden.writer import estimate_bytes

IDS5 = [0, 1, 2, 3, 4]  # SGLang numbering on an 8-layer target: the inputs of layers 1..5
DFLASH = {"layers": 1, "anchors": 16, "mask_token_id": -1, "decay": 7.0}


def test_any_count_of_distinct_ids_below_the_last_layer():
    assert aux_layer_ids(IDS5, 8) == IDS5
    assert aux_layer_ids([3], 8) == [3]
    assert aux_layer_ids("auto", 8) == [1, 3, 4]  # EAGLE-3's three, SGLang's default
    assert aux_layer_count("auto") == 3 and aux_layer_count(IDS5) == 5
    with pytest.raises(ValueError, match="empty"):
        aux_layer_ids([], 8)
    with pytest.raises(ValueError, match="distinct"):
        aux_layer_ids([0, 1, 1, 2], 8)
    with pytest.raises(ValueError, match="outside"):
        aux_layer_ids([0, 1, 2, 3, 7], 8)  # the last layer


def test_the_schema_takes_five_ids_and_refuses_none():
    from wf import with_defaults

    assert with_defaults({"capture": {"aux_layer_ids": IDS5}})["capture"]["aux_layer_ids"] == IDS5
    with pytest.raises(Exception, match="aux_layer_ids"):
        with_defaults({"capture": {"aux_layer_ids": []}})


@pytest.mark.parametrize("aux", ["dtype", "float8_e4m3"])
def test_layout_and_size_follow_the_count(aux):
    st = Storage(aux=aux)
    three = {n: s for n, _, s in layout(st, 10, 2, 64, "bfloat16", 10, None)}
    five = {n: s for n, _, s in layout(st, 10, 2, 64, "bfloat16", 10, None, None, 5)}
    assert three["aux_hidden_states"] == [10, 192] and five["aux_hidden_states"] == [10, 320]
    if aux == "float8_e4m3":
        assert five["aux_scales"][1] == 5 * three["aux_scales"][1] // 3
    grow = estimate_bytes(10, 2, 64, "bfloat16", st, None, None, None, 5) - estimate_bytes(
        10, 2, 64, "bfloat16", st
    )
    assert grow == 10 * 2 * 64 * (2 if aux == "dtype" else 1) + (
        10 * 2 * 4 if aux != "dtype" else 0
    )


@pytest.mark.parametrize("algorithm", ["eagle3", "dflash"])
def test_five_aux_layers_capture_train_export_and_decode(algorithm, tmp_path):
    """Capture at five ids (hf engine), train 40 steps, export: the shard holds 5H per token and
    verifies, the export names the five ids and its fc reads 5H, and decoding with it is
    lossless."""
    from transformers import AutoModelForCausalLM

    from draftsmith.algorithms.export import check_export, load_export
    from draftsmith.bench.specdec import greedy_generate, speculative_generate

    draft_keys = {} if algorithm == "eagle3" else {"algorithm": "dflash", "dflash": DFLASH}
    metrics = train_on_tiny_target("llama", tmp_path, ids=IDS5, layers=8, draft=draft_keys)
    assert metrics[-1]["loss"] < 0.9 * metrics[0]["loss"], (metrics[0], metrics[-1])

    shard = tmp_path / "hidden" / "rows_000000-000024.safetensors"
    opened = open_shard(shard, {"aux_layer_ids": IDS5}, verify_sha=True)  # layout checked too
    assert opened.manifest["aux_layer_ids"] == IDS5
    assert tuple(opened.aux_hidden_states.shape) == (24 * 32, 5 * SMALL["hidden_size"])

    out = tmp_path / "draft"
    check_export(out)
    c = json.loads((out / "config.json").read_text())
    if algorithm == "eagle3":
        assert c["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == IDS5
        assert c["eagle_aux_hidden_state_layer_ids"] == [i + 1 for i in IDS5]  # vLLM's reading
    else:
        assert c["dflash_config"]["target_layer_ids"] == IDS5
    draft = load_export(out)
    assert draft.config.num_aux == 5
    assert tuple(draft.fc.weight.shape) == (draft.config.hidden_size, 5 * SMALL["hidden_size"])

    model = AutoModelForCausalLM.from_pretrained(tmp_path / "target").float().eval()
    g = torch.Generator().manual_seed(5)
    prompt = torch.randint(1, SMALL["vocab_size"], (12,), generator=g).tolist()
    trace = speculative_generate(model, draft, prompt, 16, set(), 3, IDS5)
    assert trace.tokens == greedy_generate(model, prompt, 16, set())
