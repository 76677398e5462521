"""Regeneration: turn-by-turn driving of the seam, copying answers, batched left-padded generation."""

from __future__ import annotations

import json
import shutil

import pytest
from wf import with_defaults

from draftsmith.data.regenerate import MissingAnswerError, copy_answers, dropped_ids, regenerate
from draftsmith.engines.hf.engine import HFGenerator


def _conv(cid, *turns):
    roles = {"s": "system", "u": "user", "a": "assistant"}
    return {
        "id": cid,
        "source": "t",
        "conversations": [{"role": roles[t[0]], "content": t[2:]} for t in turns],
    }


def test_regenerate_turn_by_turn_with_fake_backend():
    calls = []

    def fake(prompts):
        calls.append(prompts)
        return [f"R{len(calls)}:{p[-1]['content']}" for p in prompts]

    convs = [
        _conv("one", "u:q1"),
        _conv("multi", "s:sys", "u:first", "a:source answer", "u:second"),
        _conv("full", "u:x", "a:y", "u:z", "a:w"),
    ]
    out = regenerate(convs, fake)
    assert len(calls) == 2  # two rounds: every first turn together, then every second turn
    assert [len(c) for c in calls] == [3, 2]
    # round 2 sees the regenerated round-1 answer, never the source answer
    multi_prompt = calls[1][0]
    assert [t["content"] for t in multi_prompt] == ["sys", "first", "R1:first", "second"]
    assert all("source answer" not in t["content"] for p in calls[1] for t in p)
    assert out[0]["conversations"] == [
        {"role": "user", "content": "q1"},
        {"role": "assistant", "content": "R1:q1"},
    ]
    assert [t["content"] for t in out[1]["conversations"]] == [
        "sys",
        "first",
        "R1:first",
        "second",
        "R2:second",
    ]
    assert [t["role"] for t in out[2]["conversations"]] == ["user", "assistant"] * 2
    assert [(c["id"], c["source"]) for c in out] == [("one", "t"), ("multi", "t"), ("full", "t")]
    assert convs[1]["conversations"][2]["content"] == "source answer"  # input untouched


def test_copy_answers_requires_source_answers():
    ok = [_conv("a", "u:x", "a:y")]
    assert copy_answers(ok) == ok
    with pytest.raises(MissingAnswerError, match=r"row 'b' of source 't'"):
        copy_answers([*ok, _conv("b", "u:x", "a:y", "u:z")])


PROMPTS = [
    [{"role": "user", "content": "Hi"}],
    [{"role": "user", "content": "Explain how a binary search works and why it runs fast."}],
    [
        {"role": "system", "content": "Be concise."},
        {"role": "user", "content": "What is the capital of France?"},
    ],
    [
        {"role": "user", "content": "Write a short story about a lighthouse keeper."},
        {"role": "assistant", "content": "Sure! Here is a short story."},
        {"role": "user", "content": "Shorter."},
    ],
    [{"role": "user", "content": "1 + 1 = ?"}],
]


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny models run fastest on one thread (two OpenMP threads thrash on a busy 2-core box)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def tiny_model(tiny_target):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_target)
    model = AutoModelForCausalLM.from_pretrained(tiny_target, dtype=torch.float32).eval()
    return model, tok


def test_left_padded_batch_equals_unbatched_greedy(tiny_model):
    model, tok = tiny_model
    gen = HFGenerator(model, tok, max_new_tokens=12, batch_size=8, progress=False)
    encoded = [gen._encode(p) for p in PROMPTS]
    assert len({len(e) for e in encoded}) > 1  # lengths differ: padding is exercised
    batched = gen.generate_ids(encoded)
    single = [gen.generate_ids([e])[0] for e in encoded]
    assert batched == single
    for ids in batched:  # each row stops at its first stop token or at max_new_tokens
        stops = [j for j, t in enumerate(ids) if t in gen.stop_ids]
        assert stops in ([], [len(ids) - 1])
        assert len(ids) <= 12


def test_generation_with_the_cache_written_in_place_equals_transformers_cache(tiny_model):
    model, tok = tiny_model
    gen = HFGenerator(model, tok, max_new_tokens=12, batch_size=8, progress=False)
    assert gen.slab  # draftsmith.runtime.kvcache, the default
    encoded = [gen._encode(p) for p in PROMPTS]
    ours = gen.generate_ids(encoded)
    gen.slab = False
    assert gen.generate_ids(encoded) == ours


def test_generator_returns_replies_in_input_order_and_counts_tokens(tiny_model):
    model, tok = tiny_model
    one_by_one = HFGenerator(model, tok, max_new_tokens=6, batch_size=1, progress=False)
    batched = HFGenerator(model, tok, max_new_tokens=6, batch_size=3, progress=False)
    expected = one_by_one(PROMPTS)
    assert batched(PROMPTS) == expected  # sorting by length for batching keeps input order
    assert batched.stats["prompts"] == len(PROMPTS)
    assert 0 < batched.stats["new_tokens"] <= 6 * len(PROMPTS)
    assert batched.tokens_per_second() > 0
    eot = tok.convert_tokens_to_ids("<|im_end|>")
    assert eot in batched.stop_ids


def test_sampling_is_seeded(tiny_model):
    model, tok = tiny_model
    a = HFGenerator(model, tok, max_new_tokens=8, temperature=1.0, seed=3, progress=False)
    b = HFGenerator(model, tok, max_new_tokens=8, temperature=1.0, seed=3, progress=False)
    assert a(PROMPTS) == b(PROMPTS)


def test_cli_regenerates_one_range(tiny_target, tmp_path):
    from draftsmith.stages.regenerate import main
    from draftsmith.targets.model import write_meta

    target = tmp_path / "target"
    shutil.copytree(tiny_target, target)
    write_meta(target, "path", str(tiny_target))
    src = tmp_path / "p.jsonl"
    src.write_text("".join(json.dumps({"prompt": f"Question {i}?"}) + "\n" for i in range(7)))
    cfg = with_defaults(
        {
            "data": {"sources": [{"format": "prompt", "path": str(src)}], "heldout_rows": 2},
            "regenerate": {"enabled": True, "max_new_tokens": 5, "batch_size": 2},
        }
    )
    out, rep = tmp_path / "rows_000002-000005.jsonl", tmp_path / "rows.report.json"
    main(
        [
            "--cfg",
            json.dumps(cfg),
            "--range",
            "rows_000002-000005",
            "--target",
            str(target),
            "--out",
            str(out),
            "--report",
            str(rep),
            "--threads",
            "1",
        ]
    )
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    # rows 1 and 5 of 7 are held out (evenly spaced): training rows 2-5 are sources 3, 4, 6
    assert [r["conversations"][0]["content"] for r in rows] == [
        "Question 3?",
        "Question 4?",
        "Question 6?",
    ]
    assert all(r["conversations"][-1]["role"] == "assistant" for r in rows)
    report = json.loads(rep.read_text())
    assert report["rows"] == 3 and report["prompts"] == 3 and report["tokens_per_second"] > 0
    # on a CPU the decode steps' linear layers were routed for each batch size met (2, then 1)
    assert (
        report["linear_routes"].startswith("1 rows: ") and "; 2 rows: " in report["linear_routes"]
    )

    cfg["regenerate"]["enabled"] = False
    with pytest.raises(SystemExit, match="no source answer"):
        main(
            [
                "--cfg",
                json.dumps(cfg),
                "--range",
                "rows_000002-000005",
                "--target",
                str(target),
                "--out",
                str(out),
                "--report",
                str(rep),
            ]
        )


def test_routed_regeneration_measures_each_batch_size_once(tiny_model, caplog):
    """route=True: the first batch of each size measures its linear layers' forms (logged),
    a later batch of that size does not; the replies are those of F.linear everywhere, up to
    rounding (compared here by count: a near tie may flip a token of a random-weight model)."""
    import logging

    from draftsmith.runtime import gemm

    model, tok = tiny_model
    plain = HFGenerator(model, tok, max_new_tokens=6, batch_size=2, progress=False)
    want = plain(PROMPTS[:5])
    gen = HFGenerator(model, tok, max_new_tokens=6, batch_size=2, progress=False, route=True)
    try:
        with caplog.at_level(logging.INFO, logger="draftsmith.engines.hf"):
            got = gen(PROMPTS[:5])
    finally:
        gemm.unroute(model)
    assert sorted({t["rows"] for t in gen.routes}) == [1, 2]  # batches of 2, 2, 1
    assert len([m for m in caplog.messages if m.startswith("linear layers at ")]) == 2
    assert len(got) == len(want) and all(isinstance(r, str) for r in got)


def test_prompt_plus_reply_never_exceeds_the_limit(tiny_model):
    """max_total (data.max_length, target positions): replies cut to fit, hopeless prompts skipped."""
    model, tok = tiny_model
    free = HFGenerator(model, tok, max_new_tokens=12, batch_size=8, progress=False)
    lengths = [len(free._encode(p)) for p in PROMPTS]
    limit = sorted(lengths)[2] + 3  # the two shortest get a capped reply, the rest do not fit
    gen = HFGenerator(model, tok, max_new_tokens=12, batch_size=8, max_total=limit, progress=False)
    assert gen.max_total == limit
    replies = gen(PROMPTS)
    assert [r is None for r in replies] == [n >= limit for n in lengths]
    assert gen.stats["too_long_turns"] == sum(n >= limit for n in lengths) >= 2
    # generated tokens: at most the room each prompt left (prompt + reply <= limit)
    assert 0 < gen.stats["new_tokens"] <= sum(limit - n for n in lengths if n < limit)
    assert gen.stats["capped_replies"] >= 1
    # the target's positions are a limit too
    assert free.max_total == model.config.max_position_embeddings


def test_regenerate_ends_a_conversation_at_a_turn_too_long():
    convs = [_conv("a", "u:short", "a:x", "u:long"), _conv("b", "u:long"), _conv("c", "u:ok")]

    def gen(prompts):
        return [None if p[-1]["content"] == "long" else "r" for p in prompts]

    out = regenerate(convs, gen)
    assert [c["id"] for c in out] == ["a", "c"]
    assert [t["content"] for t in out[0]["conversations"]] == ["short", "r"]
    assert dropped_ids(convs, out) == ["b"]


def test_cli_skips_a_100k_character_prompt_and_counts_it(tiny_target, tmp_path):
    from draftsmith.stages.regenerate import main
    from draftsmith.targets.model import write_meta

    target = tmp_path / "target"
    shutil.copytree(tiny_target, target)
    write_meta(target, "path", str(tiny_target))
    src = tmp_path / "p.jsonl"
    huge = "word " * 20_000  # 100,000 characters
    rows = [
        {"prompt": "Question 0?"},
        {"prompt": huge},
        {"prompt": "held"},
        {"prompt": "Question 3?"},
    ]
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = with_defaults(
        {
            "data": {
                "sources": [{"format": "prompt", "path": str(src)}],
                "heldout_rows": 1,
                "max_length": 4096,
            },
            "regenerate": {"enabled": True, "max_new_tokens": 4, "batch_size": 2},
        }
    )
    out, rep = tmp_path / "rows_000000-000003.jsonl", tmp_path / "rows.report.json"
    args = ["--range", "rows_000000-000003", "--target", str(target), "--threads", "1"]
    main([*args, "--cfg", json.dumps(cfg), "--out", str(out), "--report", str(rep)])
    kept = [
        json.loads(line)["conversations"][0]["content"] for line in out.read_text().splitlines()
    ]
    assert kept == ["Question 0?", "Question 3?"]  # row 2 is the held-out one
    report = json.loads(rep.read_text())
    assert report["too_long_turns"] == 1 and report["dropped_rows"] == 1
    assert report["max_total_tokens"] == 2048  # the tiny target's positions
    assert len(report["dropped_ids"]) == 1
