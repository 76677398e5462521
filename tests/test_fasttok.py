"""A Kimi-style tiktoken tokenizer (rank file + remote-code class, no tokenizer.json) is made a
fast tokenizer by the target stage (draftsmith.targets.fasttok), equal to the class itself token for token.

The tokenizer is tiny and made here (draftsmith.targets.tinymodel --tokenizer tiktoken: ranks learned
from a few sentences with Kimi's split pattern, 16 reserved specials); nothing is downloaded.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

from draftsmith.targets import model as tgt
from draftsmith.targets.fasttok import FastTokError, read_ranks
from draftsmith.targets.tinykimi import KIMI_PATTERN
from draftsmith.targets.tinymodel import make_tiny_target

ROOT = Path(__file__).resolve().parents[1]

# letters of every kind Kimi's pattern treats apart: Han, kana (Lo but not Han), Latin cases,
# titlecase (Lt), modifier letters (Lm), combining marks (M), digits, punctuation, whitespace
ALPHABET = (
    "abcxyzABCXYZ你好世界天气中文日本語かなカナ한국어ÉéÜüßǅǈʰʲ\u0301\u0308ΩωжЖØ0123456789"
    " .,;:!?'\"-_()[]{}<>/\\@#$%^&*+=~`|\t\n\r😀🎉"
)
SAMPLES = [
    "Hello world! It's here; they're THERE, we've I'm you'll he'd.",
    "def add(a, b):\n    return a + b\n\n\n",
    "1234567 + 89 = 1234656, 3.14159",
    "你好，世界！今天天气很好。中文English混合Text日本語のテキスト",
    "ÉCOLE élève Straße ǅemal ʰello naïve café\u0301",
    "  leading and trailing spaces   \t\ttabs\r\nCRLF\r\n",
    "<|im_user|>user<|im_middle|>hi<|im_end|><|im_assistant|>assistant<|im_middle|>",
    "[BOS]text[EOS]<|reserved_token_430|>",
    "emoji 😀🎉 and symbols ©®™ → ∑∫",
]


def random_texts(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return ["".join(rng.choice(ALPHABET) for _ in range(rng.randint(1, 60))) for _ in range(n)]


@pytest.fixture(scope="module")
def kimi_tok(tmp_path_factory) -> Path:
    """A tiny wrapped DeepSeek-V3 laid out as Kimi-K2.5 ships, its tokenizer included."""
    path = tmp_path_factory.mktemp("kimi_tok") / "model"
    return make_tiny_target(
        path, arch="deepseek_v3", num_layers=4, wrap="kimi_k25", tokenizer_kind="tiktoken"
    )


def built(src: Path, out: Path, trust: bool = False) -> Path:
    out.parent.mkdir(parents=True, exist_ok=True)
    tgt.link_path_target(src, out, trust)
    return out


def test_target_stage_makes_the_tiktoken_tokenizer_fast(kimi_tok: Path, tmp_path: Path):
    from transformers import AutoTokenizer

    out = built(kimi_tok, tmp_path / "results" / "target")
    assert (out / "tokenizer.json").is_file() and not (out / "tokenizer.json").is_symlink()
    cfg = json.loads((out / "tokenizer_config.json").read_text())
    assert not (out / "tokenizer_config.json").is_symlink()
    assert cfg["tokenizer_class"] == "PreTrainedTokenizerFast" and "auto_map" not in cfg
    # the user's directory is untouched, the other files are still links to it
    assert not (kimi_tok / "tokenizer.json").exists()
    assert json.loads((kimi_tok / "tokenizer_config.json").read_text())["auto_map"]
    assert all((out / f).is_symlink() for f in ("tiktoken.model", "tokenization_kimi.py"))
    meta = tgt.read_meta(out)["tokenizer"]
    assert meta["converted_from"] == "tiktoken.model" and meta["special_tokens"] == 16
    assert meta["pattern_from"] == "tokenization_kimi.py: TikTokenTokenizer.pat_str"
    # no remote code needed to load it, and it gives offsets (the tokens stage needs them)
    fast = AutoTokenizer.from_pretrained(out)
    assert fast.is_fast
    assert (fast.bos_token, fast.eos_token, fast.pad_token) == ("[BOS]", "[EOS]", "[PAD]")
    assert fast.convert_tokens_to_ids("<|im_end|>") == read_ranks_len(kimi_tok) + 2
    enc = fast("Hello 你好", return_offsets_mapping=True, add_special_tokens=False)
    assert enc["offset_mapping"][0][0] == 0 and enc["offset_mapping"][-1][1] == len("Hello 你好")
    rendered = fast.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
    system = "<|im_system|>system<|im_middle|>You are Kimi, an AI assistant created by Moonshot AI."
    assert rendered == f"{system}<|im_end|><|im_user|>user<|im_middle|>hi<|im_end|>"


def read_ranks_len(path: Path) -> int:
    return len(read_ranks(path / "tiktoken.model"))


def test_fast_equals_the_remote_class_token_for_token(kimi_tok: Path, tmp_path: Path):
    """The independent reference: the remote-code class itself (tiktoken inside), loaded the way
    transformers loads Kimi's, against the converted tokenizer, on fixed and random texts."""
    pytest.importorskip("tiktoken")
    from transformers import AutoTokenizer

    out = built(kimi_tok, tmp_path / "results" / "target")
    assert "equal to tiktoken" in tgt.read_meta(out)["tokenizer"]["checked"]
    slow = AutoTokenizer.from_pretrained(kimi_tok, trust_remote_code=True)
    assert not slow.is_fast and type(slow).__name__ == "TikTokenTokenizer"
    fast = AutoTokenizer.from_pretrained(out)
    assert len(fast) == len(slow) == slow.vocab_size
    for text in SAMPLES + random_texts(300):
        want = slow.model.encode(text, allowed_special="all")
        got = fast(text, add_special_tokens=False)["input_ids"]
        assert got == want, repr(text)
        assert fast.decode(got) == slow.model.decode(want)


def test_tokens_stage_reads_the_converted_tokenizer(kimi_tok: Path, tmp_path: Path):
    from transformers import AutoTokenizer

    from draftsmith.data.tokens import tokenize_rows

    fast = AutoTokenizer.from_pretrained(built(kimi_tok, tmp_path / "t" / "target"))
    turns = [
        {"role": "user", "content": "Hi there, 你好"},
        {"role": "assistant", "content": "Hello friend."},
    ]
    tensors, stats = tokenize_rows(fast, [{"id": "r0", "conversations": turns}], 256)
    ids, mask = tensors["input_ids"].tolist(), tensors["loss_mask"].tolist()
    trained = fast.decode([i for i, m in zip(ids, mask, strict=True) if m])
    assert trained == "Hello friend.<|im_end|>", trained
    assert stats["kept"] == 1


def test_a_pattern_that_is_not_a_literal_needs_remote_code(kimi_tok: Path, tmp_path: Path):
    src = tmp_path / "computed"
    src.mkdir()
    for f in kimi_tok.iterdir():
        (src / f.name).write_bytes(f.read_bytes())
    code = (src / "tokenization_kimi.py").read_text()
    start = code.index("    pat_str = ")
    end = code.index("\n\n", start)
    computed = f"    pat_str = str({KIMI_PATTERN!r})\n"  # a call: not read without running it
    (src / "tokenization_kimi.py").write_text(code[:start] + computed + code[end + 1 :])
    with pytest.raises(tgt.TargetError, match="target.trust_remote_code: true"):
        built(src, tmp_path / "a" / "target")
    assert not (tmp_path / "a" / "target").exists()
    pytest.importorskip("tiktoken")  # the class imports it
    out = built(src, tmp_path / "b" / "target", trust=True)
    assert tgt.read_meta(out)["tokenizer"]["pattern_from"].endswith("pat_str (run)")


def test_plain_tokenizer_left_as_it_is(tiny_target: Path, tmp_path: Path):
    out = built(tiny_target, tmp_path / "results" / "target")
    assert all(f.is_symlink() for f in out.iterdir() if f.name != tgt.META_FILE)
    assert "tokenizer" not in tgt.read_meta(out)


def test_bad_rank_files_name_the_file(kimi_tok: Path, tmp_path: Path):
    src = tmp_path / "bad"
    src.mkdir()
    for f in kimi_tok.iterdir():
        (src / f.name).write_bytes(f.read_bytes())
    lines = (src / "tiktoken.model").read_text().splitlines()
    (src / "tiktoken.model").write_text("\n".join(lines[:-2] + [lines[-1]]) + "\n")  # a gap
    with pytest.raises(tgt.TargetError, match=r"tiktoken.model: the ranks are not 0\.\."):
        built(src, tmp_path / "x" / "target")
    (src / "tiktoken.model").write_text("\n".join([*lines[:3], "!!notbase64 3"]) + "\n")
    with pytest.raises(FastTokError, match=r"tiktoken.model:4: not a tiktoken rank line"):
        read_ranks(src / "tiktoken.model")


def test_build_cli_converts(kimi_tok: Path, tmp_path: Path):
    """The rule's command line (target.trust_remote_code absent at its default)."""
    cfg = json.dumps({"target": {"source": "path", "path": str(kimi_tok)}})
    out = tmp_path / "results" / "target"
    out.parent.mkdir()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), *sys.path])}
    proc = subprocess.run(
        [sys.executable, "-m", "draftsmith", "target", "build", "--cfg", cfg, "--out", str(out)],
        capture_output=True, text=True, env=env, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert (out / "tokenizer.json").is_file()
    assert '"converted_from": "tiktoken.model"' in proc.stderr


def test_the_role_that_runs_the_target_stage_pins_tiktoken():
    """The target stage (the cpu role's, draftsmith.config.workflow.role_of) compares the
    converted tokenizer with tiktoken: the cpu role's pins carry it, so the check never skips."""
    from draftsmith.config.workflow import role_of
    from draftsmith.runtime.pins import read_pins

    assert role_of({}, "target") == "cpu"
    assert read_pins(ROOT / "envs" / "cpu.txt").get("tiktoken") == "0.14.0"


def test_without_tiktoken_the_check_says_so_in_the_log(
    kimi_tok: Path, tmp_path: Path, monkeypatch, caplog
):
    monkeypatch.setitem(sys.modules, "tiktoken", None)  # import tiktoken raises ImportError
    with caplog.at_level("WARNING", logger="draftsmith.targets.fasttok"):
        out = built(kimi_tok, tmp_path / "results" / "target")
    assert "(tiktoken not installed)" in tgt.read_meta(out)["tokenizer"]["checked"]
    assert any("tiktoken is not installed" in r.getMessage() for r in caplog.records)
