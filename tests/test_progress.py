"""Long jobs log their progress at a bounded rate: done / total, rate and time left."""

from __future__ import annotations

import logging
import re
from types import SimpleNamespace

import pytest

from draftsmith.runtime.progress import LoggedBar, ProgressLog, seconds_text


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def test_lines_come_every_interval_or_fraction_and_at_the_end(caplog):
    clock, log = Clock(), logging.getLogger("draftsmith.test.progress")
    p = ProgressLog(log, "train", total=1000, unit="steps", every_s=10, clock=clock)
    with caplog.at_level(logging.INFO, logger=log.name):
        for step in range(1, 1001):
            clock.t += 0.1  # 10 steps/s: a line every 10 s = 100 steps, or 5% = 50 steps
            p.update(step, loss="1.234")
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 20 == p.lines  # every 50 steps (5%), the last at step 1000
    first = lines[0]
    assert first.startswith("train: 50/1000 steps (5%), loss 1.234, 10.00 steps/s")
    assert first.endswith("5 s elapsed, ~1.6 min left")  # 950 steps at 10/s
    assert lines[-1].startswith("train: 1000/1000 steps (100%)") and "~0 s left" in lines[-1]


def test_a_slow_job_logs_by_time_and_a_resumed_one_rates_only_its_own_work(caplog):
    clock, log = Clock(), logging.getLogger("draftsmith.test.progress")
    p = ProgressLog(log, "capture", total=10_000, unit="rows", done=5000, every_s=10, clock=clock)
    with caplog.at_level(logging.INFO, logger=log.name):
        clock.t = 4
        p.update(5010)  # neither 10 s nor 5% yet
        clock.t = 12
        p.update(5020)
    (line,) = [r.getMessage() for r in caplog.records]
    assert "5020/10000 rows (50%)" in line and "1.67 rows/s" in line  # 20 rows in 12 s
    assert "~49.8 min left" in line  # 4980 rows at 1.67/s


def test_seconds_text():
    assert [seconds_text(s) for s in (12, 270, 7560)] == ["12 s", "4.5 min", "2.1 h"]


class Bar:
    def __init__(self):
        self.n = 0

    def update(self, n=1):
        self.n += n


def test_a_logged_bar_counts_in_the_bar_and_the_log(caplog):
    clock, log = Clock(), logging.getLogger("draftsmith.test.progress")
    p = ProgressLog(log, "capture rows_0-8", total=8, unit="rows", every_s=10, clock=clock)
    bar = LoggedBar(Bar(), p, lambda: {"tokens": 3 * p.done})
    with caplog.at_level(logging.INFO, logger=log.name):
        for _ in range(8):
            clock.t += 1
            bar.update()
    assert bar.bar.n == p.done == 8
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 8  # 5% of 8 rows is less than one row: a line per row
    assert lines[-1].startswith("capture rows_0-8: 8/8 rows (100%), tokens 24, 1.00 rows/s")


def test_sglang_regeneration_logs_replies_done_of_total_and_rate(monkeypatch, caplog):
    from draftsmith.engines.sglang import engine as sglang

    class Tokenizer:
        def apply_chat_template(self, turns, **_):
            return turns[-1]["content"]

        def __call__(self, text, add_special_tokens=False):
            return SimpleNamespace(input_ids=[1] * len(text))

        def decode(self, ids, skip_special_tokens=True):
            return "x" * len(ids)

    def requests(_sup, items, _send, *, concurrency, on_done):
        answers = [{"output_ids": [5, 6, 2], "meta_info": {}} for _ in items]
        for i, answer in enumerate(answers):
            on_done(i, answer)
        return answers

    monkeypatch.setattr(sglang, "run_requests", requests)
    regen = SimpleNamespace(max_new_tokens=3, temperature=0.0, batch_size=4, thinking="template")
    gen = sglang.SGLangGenerator(None, Tokenizer(), [2], regen, 60.0)
    with caplog.at_level(logging.INFO, logger="draftsmith.engines.sglang"):
        replies = gen([[{"role": "user", "content": "hi"}]] * 40)
    assert replies == ["xx"] * 40
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("regenerate:")]
    assert lines and lines[-1].startswith("regenerate: 40/40 replies (100%), new tokens 120")
    assert "replies/s" in lines[-1] and "left" in lines[-1]


def test_sglang_capture_counts_rows_through_the_logged_bar(caplog):
    from draftsmith.engines.sglang.capture import run_rows

    class Rows:
        writer = SimpleNamespace(manifest={"row_range": [0, 6]})

        def send(self, url, r, attempt):
            return 10

    clock, log = Clock(), logging.getLogger("draftsmith.test.progress")
    p = ProgressLog(log, "capture rows_000000-000006", total=6, unit="rows", clock=clock)
    with caplog.at_level(logging.INFO, logger=log.name):
        run_rows(SimpleNamespace(url="http://x"), Rows(), list(range(6)), concurrency=2,
                 retries=0, bar=LoggedBar(Bar(), p))  # fmt: skip
    assert p.done == 6
    assert caplog.records[-1].getMessage().startswith("capture rows_000000-000006: 6/6 rows")


# ---------------------------------------------------------------- the stages write them

# `<what>: <done>/<total> <unit> (<pct>%), <figures>, <rate> <unit>/s, <elapsed> elapsed, ~<left> left`
LINE = re.compile(
    r"^(?P<what>[^:]+): (?P<done>\d+)/(?P<total>\d+) (?P<unit>\w+) \((?P<pct>\d+)%\)"
    r"(?P<figures>(?:, [\w ]+ [\w.-]+)*), [\d.]+ (?P=unit)/s, \d+(?:\.\d)? (?:s|min|h) elapsed, "
    r"~(?:\d+(?:\.\d)? (?:s|min|h)|unknown) left$"
)


def progress_lines(caplog, logger: str, what: str) -> list[re.Match]:
    """The progress lines `logger` wrote for `what`, parsed (LINE)."""
    found = []
    for record in caplog.records:
        if record.name == logger and record.levelno == logging.INFO:
            m = LINE.match(record.getMessage())
            if m and m["what"] == what:
                found.append(m)
    return found


def assert_counts_to_the_end(lines: list[re.Match], total: int, unit: str, figures: list[str]):
    """Lines were written, count up to `total` `unit`s and end at 100%, with `figures`."""
    assert lines, "no progress line"
    done = [int(m["done"]) for m in lines]
    assert done == sorted(done) and done[-1] == total, done
    assert {int(m["total"]) for m in lines} == {total} and {m["unit"] for m in lines} == {unit}
    assert lines[-1]["pct"] == "100"
    for name in figures:
        assert f", {name} " in lines[-1]["figures"], lines[-1].group(0)


@pytest.fixture(scope="module")
def one_thread():
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def test_training_logs_its_progress(tmp_path, caplog, one_thread):
    """train/loop.py: `train: <step>/<total> steps (...)` up to the last step."""
    from test_train import cfg_json, make_inputs, read_metrics, train_args

    from draftsmith.stages.train import main

    inputs = make_inputs(tmp_path / "in", n_shards=1, rows=8)
    cfg = cfg_json(epochs=1, checkpoint_every=0)
    with caplog.at_level(logging.INFO):
        main(train_args(inputs, tmp_path / "run", cfg))
    steps = len(read_metrics(tmp_path / "run" / "metrics.jsonl"))
    lines = progress_lines(caplog, "draftsmith.train.loop", "train")
    assert_counts_to_the_end(lines, steps, "steps", ["loss", "acc0", "tokens per s"])


def test_hf_regeneration_logs_its_progress(tiny_target, caplog, one_thread):
    """engines/hf/engine.py: `regenerate: <done>/<prompts> prompts (...)` after each batch."""
    import torch
    from test_regenerate import PROMPTS
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from draftsmith.engines.hf.engine import HFGenerator

    tok = AutoTokenizer.from_pretrained(tiny_target)
    model = AutoModelForCausalLM.from_pretrained(tiny_target, dtype=torch.float32).eval()
    gen = HFGenerator(model, tok, max_new_tokens=4, batch_size=2, progress=False)
    with caplog.at_level(logging.INFO):
        gen(PROMPTS)
    lines = progress_lines(caplog, "draftsmith.engines.hf", "regenerate")
    assert_counts_to_the_end(lines, len(PROMPTS), "prompts", ["new tokens", "tokens per s"])
    # each batch of 2 is more than 5% of the prompts: a line per batch
    assert [int(m["done"]) for m in lines] == list(range(2, len(PROMPTS) + 1, 2)) + (
        [len(PROMPTS)] if len(PROMPTS) % 2 else []
    )


def test_hf_capture_logs_its_progress(tiny_target, tmp_path, caplog, one_thread):
    """engines/hf/engine.py: `capture <range>: <done>/<rows> rows (...)` as the batches finish."""
    from test_capture import load, random_tokens

    from draftsmith.engines.hf.engine import capture_shard

    model = load(tiny_target)
    tokens = random_tokens(model.config.vocab_size, [7, 19, 4, 11, 16], seed=3)
    out = tmp_path / "rows_000010-000015.safetensors"
    with caplog.at_level(logging.INFO):
        manifest = capture_shard(
            model, tokens, out, [1, 2, 4], "float32", batch_tokens=40,
            manifest={"row_range": [10, 15], "target_fingerprint": "fp"}, progress=False,
        )  # fmt: skip
    assert manifest["batches"] > 1
    lines = progress_lines(caplog, "draftsmith.engines.hf", "capture rows_000010-000015")
    assert_counts_to_the_end(lines, 5, "rows", ["tokens", "tokens per s"])
    assert len(lines) == manifest["batches"]  # every batch is over 5% of 5 rows
