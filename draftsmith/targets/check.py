"""The target is checked where it enters (rule target_model), so that no later job meets a bad
file: every floating tensor of the checkpoint is finite (read slice by slice: memory stays
bounded whatever the checkpoint's size), the tokenizer loads and round-trips a probe text, and
the chat template renders a conversation. Each problem names the file and the tensor or what
failed."""

from __future__ import annotations

from pathlib import Path

from draftsmith.runtime.finite import nonfinite_tensors

PROBE = "Hello, world: 12 + 30 = 42."


def nonfinite_weights(files: list[Path]) -> list[str]:
    """Every non-finite tensor of the checkpoint's safetensors files, named with its file
    (draftsmith.runtime.finite.nonfinite_tensors, read slice by slice)."""
    return [f"{path.name}: {bad}" for path in files for bad in nonfinite_tensors(path)]


def last_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[-1] if text else ''}"


def tokenizer_problems(target: Path, trust_remote_code: bool = False) -> list[str]:
    """The tokenizer loads, round-trips PROBE, and the chat template renders a conversation."""
    from transformers import AutoTokenizer

    files = ", ".join(
        n for n in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "tiktoken.model")
        if (target / n).exists()
    )  # fmt: skip
    try:
        tok = AutoTokenizer.from_pretrained(str(target), trust_remote_code=trust_remote_code)
    except Exception as e:  # a corrupt file fails inside transformers with any error
        return [f"the tokenizer ({files}) does not load: {last_line(e)}"]
    try:
        back = tok.decode(tok.encode(PROBE, add_special_tokens=False))
    except Exception as e:
        return [f"the tokenizer ({files}) cannot encode and decode text: {last_line(e)}"]
    out = []
    if back.strip() != PROBE:
        out.append(f"the tokenizer ({files}) does not round-trip {PROBE!r}: got {back!r}")
    try:
        conversation = [
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "hello"},
        ]
        tok.apply_chat_template(conversation, tokenize=False)
    except Exception as e:
        out.append(f"the chat template does not render a conversation: {last_line(e)}")
    return out


def target_problems(target: Path, weights: list[Path], trust_remote_code: bool = False):
    """Everything wrong with a target directory's weights and tokenizer (empty: usable)."""
    bad = nonfinite_weights(weights)
    out = [f"non-finite weights (a corrupt or wrongly converted checkpoint): {b}" for b in bad]
    return out + tokenizer_problems(target, trust_remote_code)
