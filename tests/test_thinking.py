"""Thinking replies: rows whose assistant turns carry a `<think>...</think>` block,
tokenized under templates written after three families' (Qwen3 and Kimi-K2.5 drop the reasoning
of earlier turns, DeepSeek-R1 of every turn), with `data.reasoning` last / all; the masks are
checked by hand and, for the last turn, against an independent rendering of what the server
saw (the prefix with the generation prompt) followed by the reply; `regenerate.thinking` reaches
the template's switch."""

from __future__ import annotations

import json

import pytest
from test_tokens import word_tokenizer

from draftsmith.data.tokens import (
    TemplateError,
    encode_turns,
    render,
    template_kwargs,
    tokenize_rows,
)

QWEN3 = (
    "{%- set ns = namespace(last_user=-1) -%}"
    "{%- for m in messages -%}{%- if m.role == 'user' -%}{%- set ns.last_user = loop.index0 -%}"
    "{%- endif -%}{%- endfor -%}"
    "{%- for m in messages -%}"
    "{%- if m.role == 'assistant' -%}"
    "{%- set content = m.content -%}{%- set reasoning = '' -%}"
    "{%- if '</think>' in content -%}"
    "{%- set reasoning = content.split('</think>')[0].split('<think>')[-1].strip('\n') -%}"
    "{%- set content = content.split('</think>')[-1].lstrip('\n') -%}{%- endif -%}"
    "{%- if loop.index0 > ns.last_user -%}"
    "{{ '<|im_start|>assistant\n<think>\n' + reasoning + '\n</think>\n\n' + content }}"
    "{%- else -%}{{ '<|im_start|>assistant\n' + content }}{%- endif -%}"
    "{{ '<|im_end|>\n' }}"
    "{%- else -%}{{ '<|im_start|>' + m.role + '\n' + m.content + '<|im_end|>\n' }}{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\n' }}"
    "{%- if enable_thinking is defined and not enable_thinking -%}"
    "{{ '<think>\n\n</think>\n\n' }}{%- endif -%}{%- endif -%}"
)
KIMI_K25 = (
    "{%- set ns = namespace(last_user=-1) -%}"
    "{%- for m in messages -%}{%- if m.role == 'user' -%}{%- set ns.last_user = loop.index0 -%}"
    "{%- endif -%}{%- endfor -%}"
    "{%- for m in messages -%}"
    "{%- if m.role == 'user' -%}<|im_user|>user<|im_middle|>{{ m.content }}<|im_end|>"
    "{%- else -%}<|im_assistant|>assistant<|im_middle|>"
    "{%- set answer = m.content.split('</think>')[-1].strip() -%}"
    "{%- if loop.index0 > ns.last_user and '</think>' in m.content -%}"
    "<think>{{ m.content.split('</think>')[0].split('<think>')[-1].strip() }}</think>"
    "{%- else -%}<think></think>{%- endif -%}"
    "{{ answer }}<|im_end|>"
    "{%- endif -%}{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|im_assistant|>assistant<|im_middle|>"
    "{%- if thinking is defined and not thinking -%}<think></think>{%- endif -%}{%- endif -%}"
)
DEEPSEEK_R1 = (
    "{{ bos_token }}{%- for m in messages -%}"
    "{%- if m.role == 'user' -%}{{ '<｜User｜>' + m.content }}"
    "{%- else -%}{{ '<｜Assistant｜>' + m.content.split('</think>')[-1].strip() "
    "+ '<｜end▁of▁sentence｜>' }}{%- endif -%}{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<｜Assistant｜><think>\n' }}{%- endif -%}"
)
THINK = ["<think>", "</think>"]
STYLES = {
    "qwen3": (QWEN3, ["<|im_start|>", "<|im_end|>", *THINK], None),
    "kimi_k25": (
        KIMI_K25,
        ["<|im_user|>", "<|im_assistant|>", "<|im_middle|>", "<|im_end|>", *THINK],
        None,
    ),
    "deepseek_r1": (
        DEEPSEEK_R1,
        [
            "<｜begin▁of▁sentence｜>",
            "<｜User｜>",
            "<｜Assistant｜>",
            "<｜end▁of▁sentence｜>",
            *THINK,
        ],
        "<｜begin▁of▁sentence｜>",
    ),
}
# the replies as each family's model writes them (R1's prompt opens the block itself)
REPLIES = {
    "qwen3": ["<think>\nSure Question\n</think>\n\nHello friend", None],
    "kimi_k25": ["<think>Sure Question</think>Hello friend", None],
    "deepseek_r1": ["Sure Question\n</think>\n\nHello friend", None],
}
LAST = {
    "qwen3": "<think>\nTwo plus two\n</think>\n\nTwo plus two is four.",
    "kimi_k25": "<think>\nTwo plus two\n</think>\n\nTwo plus two is four.",  # re-spaced by it
    "deepseek_r1": "Two plus two\n</think>\n\nTwo plus two is four.",
}
ANSWER_2 = ["Two", "plus", "two", "is", "four", "."]
REASONED_2 = ["<think>", "Two", "plus", "two", "</think>", *ANSWER_2]
# (masked tokens, turns whose reasoning the template did not render) per style and rule
EXPECTED = {
    ("qwen3", "last"): ([*REASONED_2, "<|im_end|>"], 1),
    ("qwen3", "all"): (["Hello", "friend", "<|im_end|>", *REASONED_2, "<|im_end|>"], 1),
    ("kimi_k25", "last"): ([*REASONED_2, "<|im_end|>"], 1),
    ("kimi_k25", "all"): (["Hello", "friend", "<|im_end|>", *REASONED_2, "<|im_end|>"], 1),
    ("deepseek_r1", "last"): ([*ANSWER_2, "<｜end▁of▁sentence｜>"], 2),
    ("deepseek_r1", "all"): (
        ["Hello", "friend", "<｜end▁of▁sentence｜>", *ANSWER_2, "<｜end▁of▁sentence｜>"],
        2,
    ),
}


def turns(style: str) -> list[dict]:
    return [
        {"role": "user", "content": "Hi there"},
        {"role": "assistant", "content": REPLIES[style][0]},
        {"role": "user", "content": "Add two"},
        {"role": "assistant", "content": LAST[style]},
    ]


def tokenizer(style: str):
    return word_tokenizer(*STYLES[style])


@pytest.mark.parametrize("style", sorted(STYLES))
def test_verbatim_refuses_a_thinking_row_and_names_the_key(style):
    with pytest.raises(TemplateError, match=r"rewrites assistant content.*data\.reasoning"):
        encode_turns(tokenizer(style), turns(style))


@pytest.mark.parametrize("rule", ["last", "all"])
@pytest.mark.parametrize("style", sorted(STYLES))
def test_thinking_rows_masked_as_rendered(style, rule):
    tok = tokenizer(style)
    ids, mask, dropped = encode_turns(tok, turns(style), reasoning=rule)
    toks = tok.convert_ids_to_tokens(ids)
    assert "[UNK]" not in toks
    assert ([t for t, m in zip(toks, mask, strict=True) if m], dropped) == EXPECTED[style, rule]
    # the ids are the rendering's own: the template's text, tokenized once
    assert ids == tok(render(tok, turns(style)), add_special_tokens=False)["input_ids"]


@pytest.mark.parametrize("style", ["qwen3", "kimi_k25"])
def test_last_turn_is_what_the_server_saw_and_generated(style):
    """Independent rendering: the prompt the server got for the last turn (the history with the
    generation prompt) is unmasked, then the reply the model wrote (reasoning included) and the
    end-of-turn token are masked; nothing else is."""
    tok = tokenizer(style)
    conv = turns(style)
    ids, mask, _ = encode_turns(tok, conv, reasoning="last")
    prompt = tok(render(tok, conv[:3], add_generation_prompt=True), add_special_tokens=False)
    prompt = prompt["input_ids"]
    assert ids[: len(prompt)] == prompt and not any(mask[: len(prompt)])
    reply = [i for i, m in zip(ids, mask, strict=True) if m]
    assert ids[len(prompt) : len(prompt) + len(reply)] == reply
    assert not any(mask[len(prompt) + len(reply) :])
    eot = {"qwen3": "<|im_end|>", "kimi_k25": "<|im_end|>"}[style]
    assert (
        tok.decode(reply[:-1]).split()
        == tok.decode(tok(LAST[style], add_special_tokens=False)["input_ids"]).split()
    )
    assert tok.convert_ids_to_tokens(reply[-1]) == eot


def test_rows_without_reasoning_are_masked_as_before_under_every_rule():
    """A plain multi-turn row: all equals verbatim; last is verbatim less the first turn."""
    tok = tokenizer("qwen3")
    conv = turns("qwen3")
    conv[1] = {"role": "assistant", "content": "Hello friend"}
    conv[3] = {"role": "assistant", "content": "Two plus two is four."}
    ids, verbatim, _ = encode_turns(tok, conv)
    assert encode_turns(tok, conv, reasoning="all")[:2] == (ids, verbatim)
    _, last, _ = encode_turns(tok, conv, reasoning="last")
    toks = tok.convert_ids_to_tokens(ids)
    first_end = toks.index("<|im_end|>", toks.index("Hello"))
    expect = [0 if i <= first_end else m for i, m in enumerate(verbatim)]
    assert last == expect and sum(last) == 7


def test_tokenize_rows_counts_unrendered_reasoning_only_when_asked():
    tok = tokenizer("deepseek_r1")
    rows = [{"id": "r0", "source": "t", "conversations": turns("deepseek_r1")}]
    _, stats = tokenize_rows(tok, rows, 64, reasoning="last")
    assert stats["reasoning_not_rendered"] == 2 and stats["kept"] == 1
    plain = [{**rows[0], "conversations": turns("deepseek_r1")[:1]}]
    plain[0]["conversations"] += [{"role": "assistant", "content": "Hello friend"}]
    _, stats = tokenize_rows(tok, plain, 64)
    assert "reasoning_not_rendered" not in stats  # the default's token files stay as they were
    with pytest.raises(TemplateError, match=r"row r0 \(t\).*data\.reasoning"):
        tokenize_rows(tok, rows, 64)


@pytest.mark.parametrize(
    ("style", "thinking", "tail"),
    [
        ("qwen3", "template", "<|im_start|>assistant\n"),
        ("qwen3", "enabled", "<|im_start|>assistant\n"),
        ("qwen3", "disabled", "<|im_start|>assistant\n<think>\n\n</think>\n\n"),
        ("kimi_k25", "template", "<|im_middle|>"),
        ("kimi_k25", "disabled", "<|im_middle|><think></think>"),
    ],
)
def test_regenerate_thinking_reaches_the_template_switch(style, thinking, tail):
    tok = tokenizer(style)
    text = render(tok, turns(style)[:1], add_generation_prompt=True, thinking=thinking)
    assert text.endswith(tail)
    assert template_kwargs("template") == {}
    with pytest.raises(ValueError, match="regenerate.thinking"):
        template_kwargs("on")


def test_disabled_thinking_rows_mask_the_answer_after_the_empty_block():
    """Thinking switched off: the empty block is part of the prompt, the answer is trained."""
    tok = tokenizer("qwen3")
    conv = [{"role": "user", "content": "Hi there"}, {"role": "assistant", "content": "Hello"}]
    ids, mask, dropped = encode_turns(tok, conv, reasoning="last", thinking="disabled")
    toks = tok.convert_ids_to_tokens(ids)
    assert [t for t, m in zip(toks, mask, strict=True) if m] == ["Hello", "<|im_end|>"]
    assert toks[toks.index("Hello") - 3 : toks.index("Hello")] == ["assistant", *THINK]
    assert dropped == 0


def test_hf_regeneration_renders_with_the_switch(tiny_target):
    """The hf engine's prompts carry the switch (regenerate.thinking disabled)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from draftsmith.engines.hf.engine import HFGenerator

    tok = AutoTokenizer.from_pretrained(tiny_target)
    tok.chat_template = QWEN3
    model = AutoModelForCausalLM.from_pretrained(tiny_target)
    prompt = [{"role": "user", "content": "Hi there"}]
    off = HFGenerator(model, tok, thinking="disabled", progress=False)._encode(prompt)
    default = HFGenerator(model, tok, progress=False)._encode(prompt)
    assert tok.decode(off).endswith("assistant\n<think>\n\n</think>\n\n")
    assert tok.decode(default).endswith("assistant\n")


def test_tokens_cli_reads_both_keys(tmp_path, tiny_target):
    """python -m draftsmith tokens with data.reasoning and regenerate.thinking in its cfg."""
    import shutil

    from safetensors import safe_open

    from draftsmith.data.tokens import main

    target = shutil.copytree(tiny_target, tmp_path / "target")
    cfg_file = target / "tokenizer_config.json"
    tcfg = json.loads(cfg_file.read_text())
    (target / "chat_template.jinja").write_text(QWEN3)
    cfg_file.write_text(json.dumps({k: v for k, v in tcfg.items() if k != "chat_template"}))
    rows = tmp_path / "rows_000000-000001.jsonl"
    conv = turns("qwen3")
    rows.write_text(json.dumps({"id": "r0", "source": "t", "conversations": conv}) + "\n")
    out = tmp_path / "tokens.safetensors"
    cfg = {
        "data": {"max_length": 256, "overlong": "truncate", "reasoning": "last"},
        "target": {},
        "regenerate": {"thinking": "enabled"},
    }
    main(["--cfg", json.dumps(cfg), "--rows", str(rows), "--target", str(target)]
         + ["--out", str(out)])  # fmt: skip
    with safe_open(str(out), "pt") as f:
        stats = json.loads(f.metadata()["stats"])
    assert stats["reasoning_not_rendered"] == 1 and stats["kept"] == 1
    cfg["data"]["reasoning"] = "verbatim"
    with pytest.raises(SystemExit, match="data.reasoning"):
        main(["--cfg", json.dumps(cfg), "--rows", str(rows), "--target", str(target)]
             + ["--out", str(out)])  # fmt: skip
