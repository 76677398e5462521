"""Speculative sampling (bench.temperature > 0, draftsmith.algorithms.sampling): the emitted tokens are
distributed as the target's own sampling, checked with chi-square tests.

Significance: every goodness-of-fit test passes when its p-value is above ALPHA = 1e-3 (a correct
rule fails one test with probability 1e-3, and the seeds are fixed, so a pass is reproducible).
Power: with N samples and the p/q vectors below, a wrong rule's statistic is far past the
threshold (the last tests apply the same check to two wrong rules and require p < 1e-12).
"""

from __future__ import annotations

import pytest
import torch
from test_specdec import AUX_IDS, PROMPTS, _ids, random_draft

from draftsmith.algorithms import sampling
from draftsmith.algorithms.sampling import Sampler, residual, verify, warp
from draftsmith.bench.specdec import greedy_generate, prompt_ids, speculative_generate, stop_ids

ALPHA = 1e-3
N = 200_000


def chi_square_p(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """p-value of Pearson's goodness-of-fit test of `counts` against `probs`.

    Bins with zero probability must hold no count (else p = 0); the others are pooled into bins
    with an expected count of at least 5 (the test's usual validity condition)."""
    counts, probs = counts.double(), probs.double()
    if counts[probs == 0].sum() > 0:
        return 0.0
    n = counts.sum()
    exp, obs = probs[probs > 0] * n, counts[probs > 0]
    order = exp.argsort(descending=True)
    exp, obs = exp[order], obs[order]
    big = exp >= 5
    e = torch.cat([exp[big], exp[~big].sum().view(1)]) if (~big).any() else exp[big]
    o = torch.cat([obs[big], obs[~big].sum().view(1)]) if (~big).any() else obs[big]
    if len(e) > 1 and e[-1] < 5:  # the pooled tail still small: fold it into the last bin
        e, o = torch.cat([e[:-2], e[-2:].sum().view(1)]), torch.cat([o[:-2], o[-2:].sum().view(1)])
    stat = ((o - e) ** 2 / e).sum()
    df = len(e) - 1
    if df < 1:
        return 1.0
    return float(torch.special.gammaincc(torch.tensor(df / 2.0, dtype=torch.float64), stat / 2))


def test_chi_square_helper_on_known_cases():
    g = torch.Generator().manual_seed(0)
    p = torch.tensor([0.5, 0.3, 0.2, 0.0])
    draws = torch.multinomial(p, 20_000, replacement=True, generator=g)
    assert chi_square_p(torch.bincount(draws, minlength=4), p) > ALPHA
    assert (
        chi_square_p(torch.bincount(draws, minlength=4), torch.tensor([0.45, 0.35, 0.2, 0])) < 1e-6
    )
    assert chi_square_p(torch.tensor([10, 10, 0, 1]), p) == 0.0  # a count where p is zero


def vectors(v: int = 10, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """A target distribution p over v tokens and a draft distribution q that differs from it,
    zero outside its 'draft vocabulary' (the first 6 tokens) while p has mass there too."""
    g = torch.Generator().manual_seed(seed)
    p = torch.softmax(torch.randn(v, generator=g, dtype=torch.float64) * 1.5, dim=0)
    q = 0.5 * p + 0.5 * torch.softmax(torch.randn(v, generator=g, dtype=torch.float64) * 1.5, 0)
    q[6:] = 0
    return p, q / q.sum()


def run_chain(k: int, n: int = N, seed: int = 1):
    """n independent chains of k proposals against fixed per-position p and q (a 'draft' whose
    distribution does not depend on its prefix): (accepted [n], tokens [n, k+1], p rows)."""
    ps, qs = zip(*(vectors(seed=10 * j + seed) for j in range(k + 1)), strict=True)
    p = torch.stack(ps).expand(n, k + 1, -1)
    q = torch.stack(qs[:k]).expand(n, k, -1)
    g = torch.Generator().manual_seed(seed)
    props = torch.stack([torch.multinomial(qs[j], n, True, generator=g) for j in range(k)], 1)
    accepted, tokens = verify(p, q, props, g)
    return accepted, tokens, ps


def first_tokens_p(k: int, seed: int = 1) -> float:
    _, tokens, ps = run_chain(k, seed=seed)
    return chi_square_p(torch.bincount(tokens[:, 0], minlength=len(ps[0])), ps[0])


@pytest.mark.parametrize("k", [1, 3])
def test_each_emitted_token_is_distributed_as_the_target(k):
    """Token j of a pass (when the pass emits it) ~ p_j: the first from acceptance or the
    residual, later ones after accepted proposals, the last possibly the bonus (j = k)."""
    accepted, tokens, ps = run_chain(k)
    assert set(accepted.unique().tolist()) == set(range(k + 1))  # every length happened
    for j in range(k + 1):
        emitted = tokens[accepted >= j, j]  # position j is emitted when j proposals passed
        assert len(emitted) > 5000
        counts = torch.bincount(emitted, minlength=len(ps[j]))
        assert chi_square_p(counts, ps[j]) > ALPHA, f"token {j} of {k}"
    # the residual's tokens include those outside the draft vocabulary, which q never proposes
    assert (tokens[:, 0] >= 6).any()
    # the acceptance rate is sum(min(p, q)) (the standard figure)
    p0, q0 = vectors(seed=1)
    rate = (accepted >= 1).double().mean()
    assert abs(rate - torch.minimum(p0, q0).sum()) < 0.01


def test_wrong_rule_always_accept_is_detected(monkeypatch):
    monkeypatch.setattr(sampling, "accept_mask", lambda px, qx, u: torch.ones_like(u, dtype=bool))
    assert first_tokens_p(1) < 1e-12


def test_wrong_rule_resample_from_p_is_detected(monkeypatch):
    monkeypatch.setattr(sampling, "residual", lambda p, q: p)
    assert first_tokens_p(1) < 1e-12


def test_wrong_rule_greedy_acceptance_is_detected(monkeypatch):
    """Accept whenever p(x) >= q(x) and never otherwise: also not the target's distribution."""
    monkeypatch.setattr(sampling, "accept_mask", lambda px, qx, u: px >= qx)
    assert first_tokens_p(1) < 1e-12


def test_residual_and_warp():
    p = torch.tensor([0.5, 0.3, 0.2])
    q = torch.tensor([0.2, 0.6, 0.2])
    torch.testing.assert_close(residual(p, q), torch.tensor([1.0, 0.0, 0.0]))
    torch.testing.assert_close(residual(p, p), p)  # no mass left: a distribution anyway
    logits = torch.tensor([2.0, 1.0, 0.0, -1.0])
    torch.testing.assert_close(warp(logits, 1.0), torch.softmax(logits, 0))
    torch.testing.assert_close(warp(logits, 0.5), torch.softmax(logits * 2, 0))
    full = torch.softmax(logits, 0)  # 0.644, 0.237, 0.087, 0.032
    top = warp(logits, 1.0, 0.8)  # the two most probable reach 0.88 >= 0.8
    torch.testing.assert_close(top, torch.cat([full[:2] / full[:2].sum(), torch.zeros(2)]))
    assert warp(logits, 1.0, 0.1).tolist() == [1.0, 0.0, 0.0, 0.0]  # the top token always
    with pytest.raises(ValueError, match="temperature"):
        warp(logits, 0.0)
    with pytest.raises(ValueError, match="top_p"):
        warp(logits, 1.0, 0.0)


# --------------------------------------------------------------------------- end to end


@pytest.fixture(scope="module")
def target(tiny_target):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    model = AutoModelForCausalLM.from_pretrained(tiny_target, dtype=torch.float32).eval()
    yield model, AutoTokenizer.from_pretrained(tiny_target)
    torch.set_num_threads(threads)


def test_greedy_path_is_unchanged_without_a_sampler(target):
    """No sampler: the argmax path; with one, proposals and verification sample (and the
    same seed reproduces the same output)."""
    model, tokenizer = target
    draft = random_draft(model)
    stops, ids = stop_ids(model, tokenizer), _ids(tokenizer, "def add(a, b):")
    base = greedy_generate(model, ids, 12, stops)
    assert speculative_generate(model, draft, ids, 12, stops, 2, AUX_IDS).tokens == base
    runs = [
        speculative_generate(
            model, draft, ids, 12, stops, 2, AUX_IDS, Sampler.make(1.0, 1, s, "cpu")
        )
        for s in (3, 3, 4)
    ]
    assert runs[0].tokens == runs[1].tokens != runs[2].tokens
    assert sum(runs[0].emitted) == len(runs[0].tokens) - 1


def first_two(model, draft, tokenizer, ids, temperature, top_p, n):
    """Over n seeds: the prefill's token and the first verification pass's first token, and the
    accepted lengths of those passes."""
    stops = stop_ids(model, tokenizer)
    pairs, accepted = [], []
    for s in range(n):
        sampler = Sampler.make(temperature, top_p, s, "cpu")
        trace = speculative_generate(model, draft, ids, 2, stops, 1, AUX_IDS, sampler)
        pairs.append(trace.tokens[:2])
        accepted.append(trace.accepted[0])
    return torch.tensor(pairs), accepted


def test_end_to_end_first_tokens_match_the_target(target, monkeypatch):
    """Through the engine on the tiny target and a random draft: the prefill's token t0 and the
    first verification pass's first token t1 are jointly distributed as the target's sampling,
    p(t0) p(t1 | t0) (each from an uncached forward of the prompt, and of the prompt and t0).

    The draft's logits are pulled toward the target's (its own plus the target's after the
    likeliest t0, over its vocabulary), so proposals are often accepted and both the acceptance
    and the residual paths are taken; an always-accepting rule then fails the same test."""
    model, tokenizer = target
    draft = random_draft(model, draft_vocab=128)
    ids = _ids(tokenizer, "What is the capital of France?")
    temperature, top_p = 0.1, 0.95  # a peaked p: a few tokens, a few hundred samples
    vocab = model.config.vocab_size
    with torch.inference_mode():
        p0 = warp(model(torch.tensor([ids])).logits[0, -1], temperature, top_p)
        firsts = p0.nonzero().flatten().tolist()
        after = model(torch.tensor([[*ids, t] for t in firsts])).logits[:, -1]
    joint = torch.zeros(vocab, vocab, dtype=torch.float64)
    for t, logits in zip(firsts, after, strict=True):
        joint[t] = p0[t].double() * warp(logits, temperature, top_p).double()
    assert 3 <= len(firsts) <= 20 and 5 <= int((joint > 0).sum()) <= 200
    target_ids = draft.draft_to_target(torch.arange(128))
    hint = after[int(p0[firsts].argmax())]
    own = draft.logits
    monkeypatch.setattr(draft, "logits", lambda h: own(h) * 0.2 + hint[target_ids] * 0.7)

    def p_value(pairs) -> float:
        counts = torch.bincount(pairs[:, 0] * vocab + pairs[:, 1], minlength=vocab * vocab)
        return chi_square_p(counts, joint.flatten())

    pairs, accepted = first_two(model, draft, tokenizer, ids, temperature, top_p, 150)
    assert 0 < sum(accepted) < len(accepted)  # both paths taken
    assert p_value(pairs) > ALPHA
    monkeypatch.setattr(sampling, "accept_mask", lambda px, qx, u: torch.ones_like(u, dtype=bool))
    pairs, _ = first_two(model, draft, tokenizer, ids, temperature, top_p, 60)
    assert p_value(pairs) < ALPHA


def test_bench_cli_samples(target, tiny_target, tmp_path):
    """bench.temperature > 0 through the bench CLI: speculative sampling against plain sampling,
    tau counted as at 0, no token-for-token comparison, the report and captions say so; and the
    first prompt's output is the engine's with seed bench.seed + 0 (reproducible)."""
    import json

    from test_specdec import _bench_inputs

    from draftsmith.data.prompts import prompt_turns
    from draftsmith.stages import bench as bench

    model, tokenizer = target
    argv, out = _bench_inputs(tmp_path, tiny_target, model, num_heldout=2)
    i = argv.index("--cfg") + 1
    cfg = json.loads(argv[i])
    cfg["bench"].update(smoke=True, humaneval_size=0, temperature=0.8, top_p=0.9, seed=5)
    argv[i] = json.dumps(cfg)
    bench.main([*argv, "--captions", str(out / "captions")])
    report = json.loads((out / "report.json").read_text())
    held = report["sets"]["heldout"]
    assert report["sampling"] == {"temperature": 0.8, "top_p": 0.9, "seed": 5}
    assert held["identical_outputs"] is None and held["differing_outputs"] == []
    assert sum(held["accept_len_hist"]) == held["verify_passes"] > 0
    assert held["tau"] == pytest.approx(
        (held["generated_tokens"] - held["prompts"]) / held["verify_passes"]
    )
    assert "speculative sampling at temperature 0.8, top-p 0.9" in report["method"]
    md = (out / "report.md").read_text()
    assert "| tok/s sampling |" in md and "n/a (sampled)" in md
    caption = (out / "captions" / "acceptance.rst").read_text()
    assert "speculative sampling at temperature 0.8, top-p 0.9" in caption
    # reproducible: the first prompt again, in this process, with the seed the CLI gave it
    from draftsmith.algorithms.export import load_export

    first = int(report["set_ids"]["heldout"][0].removeprefix("r"))  # row r<i> asks PROMPTS[i % 4]
    row = {"conversations": [{"role": "user", "content": PROMPTS[first % len(PROMPTS)]}]}
    draft = load_export(tmp_path / "draft").to(dtype=torch.float32)
    again = speculative_generate(
        model,
        draft,
        prompt_ids(tokenizer, prompt_turns(row)),
        cfg["bench"]["max_new_tokens"],
        stop_ids(model, tokenizer),
        cfg["bench"]["num_steps"],
        list(draft.config.aux_layer_ids),
        Sampler.make(0.8, 0.9, 5, "cpu"),
    )
    assert again.tokens == held["per_prompt"][0]["output_ids"]
