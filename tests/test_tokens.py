"""Golden loss masks for four chat-template families, built offline, plus packing and truncation.

Each family gets a word-level tokenizer (one token per word or punctuation run, specials split
out) and a Jinja template written after the real family's template, so the expected token list
and its mask can be written out by hand: assistant content + end-of-turn token only.
"""

from __future__ import annotations

import pytest

from draftsmith.data.tokens import (
    TemplateError,
    encode_with_mask,
    end_of_turn_id,
    read_tokens,
    tokenize_rows,
    write_tokens,
)

CHATML = (
    "{% for message in messages %}"
    "{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are SmolLM<|im_end|>\n' }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
LLAMA3 = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' "
    "+ message['content'] | trim + '<|eot_id|>' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}"
    "{% endif %}"
)
DEEPSEEK_V3 = (
    "{% set ns = namespace(system_prompt='') %}"
    "{% for message in messages %}{% if message['role'] == 'system' %}"
    "{% set ns.system_prompt = message['content'] %}{% endif %}{% endfor %}"
    "{{ bos_token }}{{ ns.system_prompt }}"
    "{% for message in messages %}"
    "{% if message['role'] == 'user' %}{{ '<｜User｜>' + message['content'] }}{% endif %}"
    "{% if message['role'] == 'assistant' %}"
    "{{ '<｜Assistant｜>' + message['content'] + '<｜end▁of▁sentence｜>' }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<｜Assistant｜>' }}{% endif %}"
)
KIMI_K2 = (
    "{%- for message in messages -%}"
    "{%- if loop.first and messages[0]['role'] != 'system' -%}"
    "<|im_system|>system<|im_middle|>You are Kimi<|im_end|>{%- endif -%}"
    "{%- if message['role'] == 'system' -%}<|im_system|>system<|im_middle|>"
    "{%- elif message['role'] == 'user' -%}<|im_user|>user<|im_middle|>"
    "{%- else -%}<|im_assistant|>assistant<|im_middle|>{%- endif -%}"
    "{{ message['content'] }}<|im_end|>"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|im_assistant|>assistant<|im_middle|>{%- endif -%}"
)

FAMILIES = {
    "chatml": (CHATML, ["<|im_start|>", "<|im_end|>"], None),
    "llama3": (
        LLAMA3,
        ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"],
        "<|begin_of_text|>",
    ),
    "deepseek_v3": (
        DEEPSEEK_V3,
        ["<｜begin▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>", "<｜end▁of▁sentence｜>"],
        "<｜begin▁of▁sentence｜>",
    ),
    "kimi_k2": (
        KIMI_K2,
        ["<|im_system|>", "<|im_user|>", "<|im_assistant|>", "<|im_middle|>", "<|im_end|>"],
        None,
    ),
}

TWO_TURNS = [
    {"role": "user", "content": "Hi there"},
    {"role": "assistant", "content": "Hello friend"},
    {"role": "user", "content": "Add two"},
    {"role": "assistant", "content": "Two plus two is four."},
]

# Expected (token, mask) per family for TWO_TURNS: assistant content + end-of-turn token only.
# fmt: off
GOLDEN = {
    "chatml": [
        ("<|im_start|>", 0), ("system", 0), ("You", 0), ("are", 0), ("SmolLM", 0),
        ("<|im_end|>", 0),
        ("<|im_start|>", 0), ("user", 0), ("Hi", 0), ("there", 0), ("<|im_end|>", 0),
        ("<|im_start|>", 0), ("assistant", 0), ("Hello", 1), ("friend", 1), ("<|im_end|>", 1),
        ("<|im_start|>", 0), ("user", 0), ("Add", 0), ("two", 0), ("<|im_end|>", 0),
        ("<|im_start|>", 0), ("assistant", 0), ("Two", 1), ("plus", 1), ("two", 1), ("is", 1),
        ("four", 1), (".", 1), ("<|im_end|>", 1),
    ],
    "llama3": [
        ("<|begin_of_text|>", 0),
        ("<|start_header_id|>", 0), ("user", 0), ("<|end_header_id|>", 0), ("Hi", 0),
        ("there", 0), ("<|eot_id|>", 0),
        ("<|start_header_id|>", 0), ("assistant", 0), ("<|end_header_id|>", 0), ("Hello", 1),
        ("friend", 1), ("<|eot_id|>", 1),
        ("<|start_header_id|>", 0), ("user", 0), ("<|end_header_id|>", 0), ("Add", 0),
        ("two", 0), ("<|eot_id|>", 0),
        ("<|start_header_id|>", 0), ("assistant", 0), ("<|end_header_id|>", 0), ("Two", 1),
        ("plus", 1), ("two", 1), ("is", 1), ("four", 1), (".", 1), ("<|eot_id|>", 1),
    ],
    "deepseek_v3": [
        ("<｜begin▁of▁sentence｜>", 0),
        ("<｜User｜>", 0), ("Hi", 0), ("there", 0),
        ("<｜Assistant｜>", 0), ("Hello", 1), ("friend", 1), ("<｜end▁of▁sentence｜>", 1),
        ("<｜User｜>", 0), ("Add", 0), ("two", 0),
        ("<｜Assistant｜>", 0), ("Two", 1), ("plus", 1), ("two", 1), ("is", 1), ("four", 1),
        (".", 1), ("<｜end▁of▁sentence｜>", 1),
    ],
    "kimi_k2": [
        ("<|im_system|>", 0), ("system", 0), ("<|im_middle|>", 0), ("You", 0), ("are", 0),
        ("Kimi", 0), ("<|im_end|>", 0),
        ("<|im_user|>", 0), ("user", 0), ("<|im_middle|>", 0), ("Hi", 0), ("there", 0),
        ("<|im_end|>", 0),
        ("<|im_assistant|>", 0), ("assistant", 0), ("<|im_middle|>", 0), ("Hello", 1),
        ("friend", 1), ("<|im_end|>", 1),
        ("<|im_user|>", 0), ("user", 0), ("<|im_middle|>", 0), ("Add", 0), ("two", 0),
        ("<|im_end|>", 0),
        ("<|im_assistant|>", 0), ("assistant", 0), ("<|im_middle|>", 0), ("Two", 1),
        ("plus", 1), ("two", 1), ("is", 1), ("four", 1), (".", 1), ("<|im_end|>", 1),
    ],
}
# fmt: on

WORDS = (
    "system user assistant You are SmolLM Kimi Hi there Hello friend Add two Two plus is four . "
    "Be brief Sure Question Answer"
).split()


def word_tokenizer(template: str, specials: list[str], bos: str | None):
    """One token per word/punctuation run (WordLevel + Whitespace), specials split out first."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"[UNK]": 0}
    for w in [*specials, *WORDS]:
        vocab.setdefault(w, len(vocab))
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token="[UNK]",
        bos_token=bos,
        additional_special_tokens=[s for s in specials if s != bos],
    )
    fast.chat_template = template
    return fast


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_golden_two_turn_mask(family):
    template, specials, bos = FAMILIES[family]
    tok = word_tokenizer(template, specials, bos)
    ids, mask = encode_with_mask(tok, TWO_TURNS)
    got = list(zip(tok.convert_ids_to_tokens(ids), mask, strict=True))
    assert got == GOLDEN[family]


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_system_turn_is_never_masked(family):
    template, specials, bos = FAMILIES[family]
    tok = word_tokenizer(template, specials, bos)
    turns = [{"role": "system", "content": "Be brief"}, *TWO_TURNS[:2]]
    ids, mask = encode_with_mask(tok, turns)
    masked = [t for t, m in zip(tok.convert_ids_to_tokens(ids), mask, strict=True) if m]
    assert masked[:2] == ["Hello", "friend"] and len(masked) == 3
    assert masked[2] == tok.convert_ids_to_tokens(end_of_turn_id(tok))


def test_assistant_content_equal_to_header_word_is_found_after_header():
    # "assistant" as content must not match the role header that precedes it.
    tok = word_tokenizer(*FAMILIES["chatml"])
    turns = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "assistant"}]
    ids, mask = encode_with_mask(tok, turns)
    toks = tok.convert_ids_to_tokens(ids)
    assert [t for t, m in zip(toks, mask, strict=True) if m] == ["assistant", "<|im_end|>"]
    assert mask[toks.index("assistant")] == 0  # the header's "assistant"


def test_byte_level_bpe_chatml_masks_exact_spans():
    """A trained byte-level BPE (like SmolLM2/Qwen): masked runs decode to content + <|im_end|>."""
    from draftsmith.targets.tinymodel import make_tokenizer

    tok = make_tokenizer()
    turns = [
        {"role": "user", "content": "What is the capital of France?"},
        {"role": "assistant", "content": "Paris is the capital of France."},
        {"role": "user", "content": "And Spain?"},
        {"role": "assistant", "content": "Madrid, with a short answer."},
    ]
    ids, mask = encode_with_mask(tok, turns)
    runs, cur = [], []
    for i, m in zip(ids, mask, strict=True):
        if m:
            cur.append(i)
        elif cur:
            runs.append(cur)
            cur = []
    if cur:
        runs.append(cur)
    decoded = [tok.decode(r) for r in runs]
    assert decoded == [
        "Paris is the capital of France.<|im_end|>",
        "Madrid, with a short answer.<|im_end|>",
    ]
    # Nothing outside the assistant turns is masked: unmasked text still holds every header.
    unmasked = tok.decode([i for i, m in zip(ids, mask, strict=True) if not m])
    assert unmasked.count("<|im_start|>assistant\n") == 2


def test_template_without_special_end_of_turn_is_rejected():
    template = "{% for m in messages %}{{ m['role'] + ' ' + m['content'] + ' . ' }}{% endfor %}"
    tok = word_tokenizer(template, [], None)
    with pytest.raises(TemplateError, match="end-of-turn"):
        encode_with_mask(tok, TWO_TURNS[:2])


def _rows(n):
    return [
        {"id": f"r{i}", "source": "t", "conversations": TWO_TURNS[: 2 + 2 * (i % 2)]}
        for i in range(n)
    ]


def test_pack_truncate_and_drop(tmp_path):
    tok = word_tokenizer(*FAMILIES["deepseek_v3"])
    rows = _rows(4)  # lengths 8, 19, 8, 19
    tensors, stats = tokenize_rows(tok, rows, max_length=12, overlong="truncate")
    assert tensors["row_offsets"].tolist() == [0, 8, 20, 28, 40]
    assert stats["truncated"] == ["r1", "r3"] and stats["dropped"] == []
    full_ids, full_mask = encode_with_mask(tok, rows[1]["conversations"])
    assert tensors["input_ids"][8:20].tolist() == full_ids[:12]
    assert tensors["loss_mask"][8:20].tolist() == full_mask[:12]
    assert str(tensors["input_ids"].dtype) == "int64" and str(tensors["loss_mask"].dtype) == "uint8"

    tensors, stats = tokenize_rows(tok, rows, max_length=12, overlong="drop")
    assert tensors["row_offsets"].tolist() == [0, 8, 16]
    assert stats["dropped"] == ["r1", "r3"] and stats["kept_rows"] == [0, 2]

    path = tmp_path / "rows_000000-000004.safetensors"
    write_tokens(path, tensors, stats)
    back = read_tokens(path)
    assert back["input_ids"].tolist() == tensors["input_ids"].tolist()
    assert back["loss_mask"].tolist() == tensors["loss_mask"].tolist()
    assert sorted(p.name for p in tmp_path.iterdir()) == [path.name]  # no temp files left


def test_load_tokenizer_takes_the_class_autotokenizer_would(tiny_target, tmp_path):
    """The generic fast tokenizer is loaded by its class directly (no torch in the tokenize
    job), and it is the class AutoTokenizer resolves, encoding and templating the same; a
    config with its own class goes through AutoTokenizer."""
    import json
    import shutil
    import subprocess
    import sys

    from transformers import AutoTokenizer

    from draftsmith.data.tokens import GENERIC_FAST, load_tokenizer

    cfg = json.loads((tiny_target / "tokenizer_config.json").read_text())
    assert cfg.get("tokenizer_class") in GENERIC_FAST
    fast, auto = load_tokenizer(tiny_target), AutoTokenizer.from_pretrained(tiny_target)
    assert type(fast) is type(auto)
    turns = [{"role": "user", "content": "Hi there"}, {"role": "assistant", "content": "Hello"}]
    assert fast.apply_chat_template(turns, tokenize=False) == auto.apply_chat_template(
        turns, tokenize=False
    )
    assert fast("a b, c")["input_ids"] == auto("a b, c")["input_ids"]
    code = (
        "import sys; from draftsmith.data.tokens import load_tokenizer; "
        f"load_tokenizer({str(tiny_target)!r}); print('torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
    other = tmp_path / "other"
    shutil.copytree(tiny_target, other)
    (other / "tokenizer_config.json").write_text(
        json.dumps({**cfg, "tokenizer_class": "GPT2Tokenizer"})
    )
    assert (
        type(load_tokenizer(other)).__name__ == type(AutoTokenizer.from_pretrained(other)).__name__
    )
