"""The offline acceptance estimate (draftsmith.algorithms.eagle3.offline): the chains are the engine's, the counts
are conditional and censored as documented, tau_est is exact on constructed cases, and the
trainer writes it from rows it did not train on."""

from __future__ import annotations

import json
import math

import pytest
import torch
from test_model import tiny_draft
from test_train import cfg_json, make_inputs, read_metrics, run_train, train_args

from draftsmith.algorithms.eagle3.decode import DraftRunner
from draftsmith.algorithms.eagle3.offline import chain_counts, chain_proposals, judge, target_top1
from draftsmith.algorithms.offline import compare, rates_of, split_rows, tau_estimate, text
from draftsmith.hidden.storage import Storage


def test_tau_estimate_is_one_plus_the_sum_of_reach_products():
    assert tau_estimate([]) == 1.0
    assert tau_estimate([1.0, 1.0, 1.0]) == 4.0
    assert tau_estimate([0.5, 0.5]) == pytest.approx(1 + 0.5 + 0.25)
    assert tau_estimate([0.8, 0.5, 0.25]) == pytest.approx(1 + 0.8 + 0.4 + 0.1)
    assert tau_estimate([0.0, None]) == 1.0  # nothing reaches step 2: its rate cannot matter
    assert tau_estimate([0.5, None]) is None  # unmeasured is not zero


def test_chain_counts_are_conditional_on_every_earlier_acceptance():
    # [K, N]: rows are steps, columns chains; chain 2 is censored at step 2 (not judged):
    # it leaves steps 2 and 3; chain 3 is rejected at step 1: accepted later does not count
    accepted = torch.tensor([[1, 1, 1, 0], [1, 0, 1, 1], [1, 1, 1, 1]], dtype=torch.bool)
    judged = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 1], [1, 1, 1, 1]], dtype=torch.bool)
    judged_n, accepted_n = chain_counts(accepted, judged)
    # step 1: 4 judged, 3 accepted; step 2: chains 0, 1 alive and judged (2 censored, 3 dead):
    # 2 judged, 1 accepted (chain 0); step 3: chain 0 alone, accepted
    assert judged_n == [4, 2, 1]
    assert accepted_n == [3, 1, 1]
    rates = rates_of(judged_n, accepted_n)
    assert rates == [0.75, 0.5, 1.0]
    assert tau_estimate(rates) == pytest.approx(1 + 0.75 + 0.375 + 0.375)
    assert rates_of([0], [0]) == [None]


def reference_judge(props, ids, top, known):
    """The definition, one chain at a time in plain Python."""
    steps, n = props.shape
    acc = [[False] * n for _ in range(steps)]
    jud = [[False] * n for _ in range(steps)]
    for p in range(n):
        for k in range(steps):
            q = p + k + 1
            earlier_on_path = all(
                p + i + 2 < n and int(ids[p + i + 2]) == int(top[p + i + 1]) for i in range(k)
            )
            if q >= n or not bool(known[q]) or not earlier_on_path:
                continue
            jud[k][p] = True
            acc[k][p] = int(top[q]) >= 0 and int(props[k, p]) == int(top[q])
    return torch.tensor(acc), torch.tensor(jud)


def test_judge_matches_its_definition_on_random_rows():
    g = torch.Generator().manual_seed(3)
    for _ in range(20):
        n, steps = int(torch.randint(2, 30, (1,), generator=g)), 4
        ids = torch.randint(0, 5, (n,), generator=g)
        top = torch.randint(-1, 5, (n,), generator=g)
        top[:-1] = torch.where(torch.rand(n - 1, generator=g) < 0.6, ids[1:], top[:-1])
        known = torch.rand(n, generator=g) < 0.8
        props = torch.randint(0, 5, (steps, n), generator=g)
        props = torch.where(torch.rand(steps, n, generator=g) < 0.5, top.clamp(min=0), props)
        got, want = judge(props, ids, top, known), reference_judge(props, ids, top, known)
        for a, b in zip(got, want, strict=True):
            assert torch.equal(a, b)


def greedy_row(n: int, prompt: int, seed: int = 0):
    """ids whose assistant part is the target's greedy path: top[q] = ids[q+1] where known."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 50, (n,), generator=g)
    known = torch.zeros(n, dtype=torch.bool)
    known[prompt - 1 : n - 1] = True  # the target's state at the last prompt token onwards
    top = torch.full((n,), -1, dtype=torch.long)
    top[:-1] = ids[1:]
    return ids, torch.where(known, top, -1), known


def copying_proposals(ids, top, steps):
    """A draft that proposes the target's argmax: proposal k of chain p is top[p+k]."""
    n = ids.numel()
    q = (torch.arange(n)[None] + torch.arange(1, steps + 1)[:, None]).clamp(max=n - 1)
    return top[q].clamp(min=0)


def test_a_draft_that_copies_the_targets_argmax_is_always_accepted():
    steps = 3
    ids, top, known = greedy_row(40, prompt=10)
    acc, jud = judge(copying_proposals(ids, top, steps), ids, top, known)
    judged_n, accepted_n = chain_counts(acc, jud)
    assert accepted_n == judged_n and judged_n[0] == 30
    rates = rates_of(judged_n, accepted_n)
    assert rates == [1.0, 1.0, 1.0]
    assert tau_estimate(rates) == 1 + steps


def test_a_constructed_agreement_gives_the_exact_tau():
    """The draft is right except at every 4th target position: chains from p accept proposal k
    iff no wrong position lies in p+1..p+k. With 4 | period, of the chains fully judged, 3/4
    accept proposal 1, 2/3 of those proposal 2, 1/2 of those proposal 3."""
    steps, n, prompt = 3, 46, 4
    ids, top, known = greedy_row(n, prompt)
    props = copying_proposals(ids, top, steps)
    wrong = torch.zeros(n, dtype=torch.bool)
    wrong[prompt::4] = True  # target positions where the draft's proposal is off by one
    q = (torch.arange(n)[None] + torch.arange(1, steps + 1)[:, None]).clamp(max=n - 1)
    props = torch.where(wrong[q], props + 1, props)
    # count only chains whose 3 proposals all lie inside the row's known part (40 of them):
    # the tail's censored chains would break the exact fractions
    acc, jud = judge(props, ids, top, known)
    full = jud.all(0)  # chains judged at every step (ignoring acceptance)
    judged_n, accepted_n = chain_counts(acc[:, full], torch.ones_like(acc[:, full]))
    rates = rates_of(judged_n, accepted_n)
    assert judged_n == [40, 30, 20]
    assert rates == pytest.approx([3 / 4, 2 / 3, 1 / 2])
    assert tau_estimate(rates) == pytest.approx(1 + 3 / 4 + 1 / 2 + 1 / 4)


def test_a_step_off_the_datas_path_is_censored_not_rejected():
    ids = torch.tensor([0, 1, 2, 3, 4, 5])
    known = torch.tensor([0, 1, 1, 1, 1, 0], dtype=torch.bool)
    top = torch.tensor([-1, 2, 9, 4, 5, -1])  # at 2 the data's 3 is not the argmax 9
    props = torch.tensor([[2, 9, 4, 5, 0, 0], [9, 4, 5, 0, 0, 0]])  # everything right
    acc, jud = judge(props, ids, top, known)
    # chain from 0: proposal 1 (checked at 1) right; proposal 2 at 2 in context ids[:3]: judged
    assert jud[:, 0].tolist() == [True, True] and acc[:, 0].tolist() == [True, True]
    # chain from 1: proposal 1 at 2 accepted (9); proposal 2 at 3 would need the data token 9
    # at 3, the data has 3: censored
    assert jud[:, 1].tolist() == [True, False] and acc[0, 1]
    # step 2: chains 0 and 2 (1 censored, 3 past the known part)
    assert chain_counts(acc, jud) == ([4, 2], [4, 2])


@pytest.mark.parametrize("algorithm", ["eagle3", "eagle3.1"])
def test_chain_proposals_equal_the_hf_engines_draft_runner(algorithm):
    """Every chain of the batched evaluation proposes what the hf engine's DraftRunner (KV
    cache, one start position at a time) proposes from the same verified prefix."""
    draft = tiny_draft(seed=1, algorithm=algorithm)
    cfg = draft.config
    g = torch.Generator().manual_seed(2)
    n, steps = 14, 3
    embed = torch.nn.Embedding(cfg.vocab_size, cfg.hidden_size)
    with torch.no_grad():
        embed.weight.copy_(torch.randn(cfg.vocab_size, cfg.hidden_size, generator=g))
    ids = torch.randint(0, cfg.vocab_size, (n,), generator=g)
    aux = torch.randn(n, 3 * cfg.target_hidden_size, generator=g)
    with torch.no_grad():
        got = chain_proposals(draft, embed.weight, aux, ids, steps)
        for p in range(n - 1):
            runner = DraftRunner(draft, embed, cfg.aux_layer_ids)
            runner.extend(ids[1 : p + 2].tolist(), aux[: p + 1])
            assert got[:, p].tolist() == runner.propose(steps), p


def test_split_rows_holds_out_evenly_spaced_rows_and_refuses_all():
    rows = list(range(10))
    train, held = split_rows(rows, 3)
    assert held == [1, 5, 8] and sorted(train + held) == rows
    assert split_rows(rows, 0) == (rows, [])
    with pytest.raises(SystemExit, match="train.eval_rows = 10 leaves no training rows"):
        split_rows(rows, 10)


def test_compare_and_text_put_the_gap_next_to_the_measured_tau():
    offline = {"rows": 8, "tau_est_by_k": [1.5, 1.75], "accept_rate_by_step": [0.5, 0.5]}
    sets = {"heldout": {"tau": 1.9}, "humaneval": {"tau": float("nan")}}
    cmp = compare(offline, sets, 2, sampling=False)
    assert cmp["tau_est"] == 1.75
    assert cmp["gaps"]["heldout"]["gap"] == pytest.approx(0.15)
    assert cmp["gaps"]["humaneval"]["gap"] is None
    line = text(cmp)
    assert "tau_est 1.750" in line and "heldout 1.900 (gap +0.150)" in line
    far = compare(offline, sets, 3, sampling=True)
    assert far["tau_est"] is None and "K = 1..2 only" in text(far)
    assert "not computed (train.eval_rows is 0" in text(
        compare({"rows": 0, "tau_est_by_k": [], "why": "train.eval_rows is 0"}, sets, 2, False)
    )
    assert "none" in text(None)


def test_training_writes_the_estimate_from_rows_it_did_not_train_on(tmp_path):
    inputs = make_inputs(tmp_path / "in")
    out = tmp_path / "run"
    from draftsmith.stages.train import main

    torch.set_num_threads(1)
    offline = ["--offline", str(out / "offline.json")]
    main([*train_args(inputs, out, cfg_json(eval_rows=4, epochs=1)), *offline])
    est = json.loads((out / "offline.json").read_text())
    assert est["rows"] == 4 and est["steps"] == 3 and len(est["tau_est_by_k"]) == 3
    assert all(n > 0 for n in est["judged_by_step"][:1])
    assert est["judged_by_step"] == sorted(est["judged_by_step"], reverse=True)
    assert 1.0 <= est["tau_est_by_k"][0] <= est["tau_est_by_k"][-1] <= 4.0
    assert est["tau_est_by_k"] == [tau_estimate(est["accept_rate_by_step"][:k]) for k in (1, 2, 3)]
    assert 0 <= est["greedy_data_rate"] <= 1
    assert not list(out.glob(".tmp-*"))
    # the 4 held-out rows are not trained: one epoch reads 20 of the 24 rows' tokens
    shards = [r["tokens"] for r in read_metrics(out / "metrics.jsonl")]
    full = run_train(inputs, tmp_path / "all", cfg_json(epochs=1))
    assert sum(shards) < sum(r["tokens"] for r in full)
    assert not math.isnan(est["tau_est_by_k"][-1])


def test_the_targets_argmax_reads_the_same_from_every_storage_mode(tmp_path):
    """states, trained, top-k over the target and over the draft vocabulary: the same argmax
    ids (or -1 outside the draft vocabulary) and the same known positions, row by row."""
    from draftsmith.data.vocab import load_vocab
    from draftsmith.hidden.shards import open_shard
    from draftsmith.interop.convert import recode
    from draftsmith.train.data import target_tensors

    inputs = make_inputs(tmp_path / "in", n_shards=1)
    lm_head = target_tensors(inputs["target"])["lm_head"]
    d2t, t2d = load_vocab(inputs["vocab"])
    src = inputs["shards"][0]
    modes = {
        "trained": Storage(final="trained"),
        "topk": Storage(final="topk", topk=4),
        "topk_draft": Storage(final="topk", topk=4, topk_vocab="draft"),
    }
    shards = {"states": open_shard(src)}
    for name, st in modes.items():
        recode(src, tmp_path / name / src.name, st, inputs["target"], "cpu", inputs["vocab"])
        shards[name] = open_shard(tmp_path / name / src.name)
    offsets = shards["states"].row_offsets.tolist()
    outside = 0
    for a, b in zip(offsets[:-1], offsets[1:], strict=True):
        want_top, want_known = target_top1(shards["states"], a, b, lm_head, t2d, d2t)
        assert want_known.any()
        outside += int((want_known & (want_top < 0)).sum())
        for name in modes:
            top, known = target_top1(shards[name], a, b, lm_head, t2d, d2t)
            assert torch.equal(known, want_known), name
            assert torch.equal(top, want_top), name
    assert outside > 0  # the data has argmaxes outside the draft vocabulary: -1 is exercised
