"""A tiny random-weight chat model, made offline in seconds: for smoke tests and the tests.

It is a real transformers model directory (config.json, model.safetensors, a byte-level BPE
tokenizer trained on a few sentences, a ChatML chat template), so every stage runs on it exactly
as on a real target; its weights are random, so a draft trained for it accepts almost nothing
(see docs/own-model.md, "What a smoke run shows"). Nothing is downloaded.

    python -m draftsmith tiny-model --out models/tiny-chat             # 6-layer Llama
    python -m draftsmith tiny-model --out models/tiny-dsv3 --arch deepseek_v3 --layers 5
    python -m draftsmith tiny-model --out models/tiny-kimi --arch deepseek_v3 --wrap kimi_k25 \
        --tokenizer tiktoken
    python -m draftsmith tiny-model --out models/tiny-dsv3-serve --arch deepseek_v3 \
        --engine-shapes --hidden 128 --layers 4

A DeepSeek-V3 model always carries the MoE routing keys the engines read (`topk_method:
noaux_tc`, `scoring_func: sigmoid`, `moe_layer_freq: 1`: how transformers routes it; without
them vLLM and SGLang build a different gate). `--engine-shapes` gives it the attention shapes
the engines' CPU MLA kernels accept and DeepSeek-V3's / Kimi's RoPE: `kv_lora_rank` 512 and
`qk_rope_head_dim` 64 (vLLM's CPU MLA kernels take a 576-wide latent only), qk_nope / v head
dims 32, q_lora_rank 64, and YaRN RoPE (SGLang's CPU RoPE takes DeepSeek-YaRN only); see
docs/kimi.md, "Serving engines on CPU".

`--wrap kimi_k25` lays the model out as Kimi-K2.5 ships: config.json names the wrapper
(`KimiK25ForConditionalGeneration`) and nests the text model's config under `text_config`; the
weights are renamed under `language_model.`, beside a stand-in vision tower and projector;
`preprocessor_config.json` carries Kimi-K2.5's media settings (`media_proc_cfg`), from which
vLLM builds the wrapper's processor before it serves even text (the vision tower's own
`vision_config` is not written: engines serving the text model alone never build it).
`--tokenizer tiktoken` ships the tokenizer as Kimi's does: a tiktoken rank file (`tiktoken.model`,
ranks learned here from CORPUS with Kimi's split pattern), a remote-code `TikTokenTokenizer` class
in `tokenization_kimi.py` and reserved special tokens after the ranks; no tokenizer.json (the
target stage makes one, draftsmith.targets.fasttok).
"""

from __future__ import annotations

import argparse
from pathlib import Path

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}"
    "{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Explain how a binary search works and why it runs in logarithmic time.",
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "def add(a, b):\n    return a + b\n",
    "What is the capital of France? Paris is the capital of France.",
    "Translate 'good morning' into Spanish: buenos dias.",
    "1 + 1 = 2, 2 * 3 = 6, 10 / 4 = 2.5",
    "Sure! Here is a concise answer with a few key points, examples and a summary.",
]

SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# Kimi's split pattern (the pat_str of its TikTokenTokenizer): Han runs, cased words with
# English contractions (letters other than Han), up to 3 digits, punctuation, newlines, spaces
KIMI_PATTERN_PARTS = [
    r"""[\p{Han}]+""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*"""
    r"""[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+"""
    r"""[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""\p{N}{1,3}""",
    r""" ?[^\s\p{L}\p{N}]+[\r\n]*""",
    r"""\s*[\r\n]+""",
    r"""\s+(?!\S)""",
    r"""\s+""",
]
KIMI_PATTERN = "|".join(KIMI_PATTERN_PARTS)
KIMI_SPECIAL = [
    "[BOS]",
    "[EOS]",
    "<|im_end|>",
    "<|im_user|>",
    "<|im_assistant|>",
    "<|im_system|>",
    "<|im_middle|>",
]
KIMI_TEMPLATE = (
    "{% for m in messages %}<|im_{{ m['role'] }}|>{{ m['role'] }}<|im_middle|>"
    "{{ m['content'] }}<|im_end|>{% endfor %}"
    "{% if add_generation_prompt %}<|im_assistant|>assistant<|im_middle|>{% endif %}"
)
# the remote-code tokenizer class written beside a tiktoken tiny model (Kimi's layout)
TIKTOKEN_CLASS = '''"""A tiktoken tokenizer class as Kimi ships one (draftsmith.targets.tinymodel): trust_remote_code."""

import tiktoken
from tiktoken.load import load_tiktoken_bpe
from transformers import PreTrainedTokenizer
from transformers.convert_slow_tokenizer import bytes_to_unicode


class TikTokenTokenizer(PreTrainedTokenizer):
    vocab_files_names = {"vocab_file": "tiktoken.model"}
    model_input_names = ["input_ids", "attention_mask"]
    num_reserved_special_tokens = RESERVED
    pat_str = "|".join(PARTS)

    def __init__(self, vocab_file, added_tokens_decoder=None, **kwargs):
        ranks = load_tiktoken_bpe(vocab_file)
        n = len(ranks)
        names = {int(i): getattr(t, "content", t) for i, t in (added_tokens_decoder or {}).items()}
        self.special_tokens = {
            names.get(i, f"<|reserved_token_{i}|>"): i
            for i in range(n, n + self.num_reserved_special_tokens)
        }
        self.model = tiktoken.Encoding(
            name="tiny", pat_str=self.pat_str, mergeable_ranks=ranks,
            special_tokens=self.special_tokens,
        )
        to_char = bytes_to_unicode()
        self.byte_decoder = {c: b for b, c in to_char.items()}
        self.decoder = {
            i: "".join(to_char[b] for b in self.model.decode_single_token_bytes(i))
            for i in range(self.model.n_vocab)
        }
        self.encoder = {t: i for i, t in self.decoder.items()}
        self.vocab_file = vocab_file
        super().__init__(added_tokens_decoder=added_tokens_decoder, **kwargs)

    @property
    def vocab_size(self):
        return self.model.n_vocab

    def get_vocab(self):
        return dict(self.encoder)

    def _tokenize(self, text, **kwargs):
        return [self.decoder[i] for i in self.model.encode(text, allowed_special="all")]

    def _convert_token_to_id(self, token):
        return self.encoder[token]

    def _convert_id_to_token(self, index):
        return self.decoder[index]

    def convert_tokens_to_string(self, tokens):
        return bytes(self.byte_decoder[c] for c in "".join(tokens)).decode("utf-8", "replace")
'''
# DeepSeek-V3's MoE routing as the engines read it (transformers always routes this way)
DEEPSEEK_MOE_KEYS = {"topk_method": "noaux_tc", "scoring_func": "sigmoid", "moe_layer_freq": 1}
# YaRN as DeepSeek-V3 and Kimi-K2.5 configure it, over a 512-token original window
DEEPSEEK_YARN = {
    "rope_type": "yarn",
    "factor": 4.0,
    "original_max_position_embeddings": 512,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "mscale": 1.0,
    "mscale_all_dim": 1.0,
}


def deepseek_shapes(engine_shapes: bool) -> dict:
    """MLA ranks and RoPE of a tiny DeepSeek-V3: the smallest transformers runs, or the ones
    the engines' CPU kernels accept (module docstring)."""
    if not engine_shapes:
        return dict(kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8,
                    v_head_dim=8)  # fmt: skip
    return dict(
        kv_lora_rank=512,
        q_lora_rank=64,
        qk_rope_head_dim=64,
        qk_nope_head_dim=32,
        v_head_dim=32,
        rope_parameters={"rope_theta": 10000.0, **DEEPSEEK_YARN},
    )


# wrapper name -> (architecture, model_type) of the top-level config
WRAPPERS = {"kimi_k25": ("KimiK25ForConditionalGeneration", "kimi_k25")}
# top-level config keys the wrapper's config.json carries and engines read: Kimi-K2.5's media
# placeholder id (its `<|media_pad|>`; outside a tiny vocabulary, never in a text prompt), which
# vLLM's EAGLE-3 loader hands the draft for a Kimi-K2.5 target
WRAPPER_KEYS = {"kimi_k25": {"media_placeholder_token_id": 163605}}
# Kimi-K2.5's preprocessor_config.json: the media settings its image processor reads (patch 14,
# 2x2 merge, 4-frame video chunks, ...); vLLM builds its processor from them even for text-only
# serving. The real file also names Moonshot's processor code (auto_map), not shipped here.
KIMI_MEDIA_PROC_CFG = {
    "in_patch_limit": 16384,
    "patch_size": 14,
    "image_mean": [0.5, 0.5, 0.5],
    "image_std": [0.5, 0.5, 0.5],
    "merge_kernel_size": 2,
    "fixed_output_tokens": None,
    "patch_limit_on_one_side": 512,
    "in_patch_limit_each_frame": 4096,
    "in_patch_limit_video": None,
    "sample_fps": 2.0,
    "max_num_frames_each_video": None,
    "temporal_merge_kernel_size": 4,
    "timestamp_mode": "hh:mm:ss.fff",
}


def make_tokenizer(vocab_size: int = 384):
    """A byte-level BPE tokenizer trained on a few sentences, with ChatML specials."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS * 4, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|im_start|>",
        eos_token="<|im_end|>",
        pad_token="<|im_end|>",
        unk_token="<|endoftext|>",
    )
    fast.chat_template = CHATML_TEMPLATE
    return fast


def tiktoken_ranks(merges: int = 160) -> dict[bytes, int]:
    """Byte-level BPE ranks learned from CORPUS (pre-split with KIMI_PATTERN): the 256 bytes,
    then one token per merge, most frequent pair first (ties: the larger pair)."""
    from collections import Counter

    import regex

    split = regex.compile(KIMI_PATTERN, flags=regex.V1)
    text = "\n".join(CORPUS * 4) + "\n你好，世界。今天天气很好。"
    words = Counter(w.encode() for w in split.findall(text))
    ranks = {bytes([b]): b for b in range(256)}
    seqs = {w: [bytes([b]) for b in w] for w in words}
    for _ in range(merges):
        pairs = Counter()
        for w, s in seqs.items():
            for a, b in zip(s, s[1:], strict=False):
                pairs[(a, b)] += words[w]
        if not pairs:
            break
        (a, b), _n = max(pairs.items(), key=lambda kv: (kv[1], kv[0]))
        ranks[a + b] = len(ranks)
        for w, s in seqs.items():
            out, i = [], 0
            while i < len(s):
                if i + 1 < len(s) and s[i] == a and s[i + 1] == b:
                    out.append(a + b)
                    i += 2
                else:
                    out.append(s[i])
                    i += 1
            seqs[w] = out
    return ranks


def write_tiktoken_tokenizer(path: str | Path, reserved: int = 16, merges: int = 160) -> dict:
    """Write Kimi's tokenizer layout into `path` (module docstring); returns {"vocab_size",
    "bos_token_id", "eos_token_id", "pad_token_id"}."""
    import base64
    import json

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    ranks = tiktoken_ranks(merges)
    with open(path / "tiktoken.model", "w", encoding="ascii") as f:
        for token, rank in ranks.items():
            f.write(f"{base64.b64encode(token).decode()} {rank}\n")
    n = len(ranks)
    parts = ",\n        ".join(repr(p) for p in KIMI_PATTERN_PARTS)
    code = TIKTOKEN_CLASS.replace("RESERVED", str(reserved)).replace(
        "PARTS", f"[\n        {parts},\n    ]"
    )
    (path / "tokenization_kimi.py").write_text(code)
    ids = {name: n + i for i, name in enumerate(KIMI_SPECIAL)}
    ids["[UNK]"], ids["[PAD]"] = n + reserved - 2, n + reserved - 1
    entry = {"lstrip": False, "normalized": False, "rstrip": False, "single_word": False}
    cfg = {
        "added_tokens_decoder": {
            str(i): {"content": name, **entry, "special": True} for name, i in ids.items()
        },
        "additional_special_tokens": ["<|im_end|>", "<|im_user|>", "<|im_assistant|>"],
        "auto_map": {"AutoTokenizer": ["tokenization_kimi.TikTokenTokenizer", None]},
        "bos_token": "[BOS]",
        "eos_token": "[EOS]",
        "pad_token": "[PAD]",
        "unk_token": "[UNK]",
        "clean_up_tokenization_spaces": False,
        "model_max_length": 1048576,
        "tokenizer_class": "TikTokenTokenizer",
    }
    (path / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    (path / "chat_template.jinja").write_text(KIMI_TEMPLATE)
    return {
        "vocab_size": n + reserved,
        "bos_token_id": ids["[BOS]"],
        "eos_token_id": ids["<|im_end|>"],
        "pad_token_id": ids["[PAD]"],
    }


def tiny_config(arch: str, vocab: int, hidden_size: int, num_layers: int, tokenizer, engine_shapes):
    """The transformers config of a tiny target of family `arch` (llama, deepseek_v3,
    gemma3_text) with the tokenizer's special token ids."""
    special = {
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
    }
    if arch == "llama":
        from transformers import LlamaConfig

        return LlamaConfig(
            vocab_size=vocab,
            hidden_size=hidden_size,
            intermediate_size=2 * hidden_size,
            num_hidden_layers=num_layers,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=hidden_size // 4,
            max_position_embeddings=2048,
            rms_norm_eps=1e-5,
            rope_theta=10000.0,
            tie_word_embeddings=True,
            **special,
        )
    if arch == "deepseek_v3":
        from transformers import DeepseekV3Config

        return DeepseekV3Config(
            vocab_size=vocab,
            hidden_size=hidden_size,
            intermediate_size=2 * hidden_size,
            moe_intermediate_size=hidden_size,
            num_hidden_layers=num_layers,
            num_attention_heads=4,
            num_key_value_heads=4,
            n_shared_experts=1,
            n_routed_experts=4,
            num_experts_per_tok=2,
            n_group=1,
            topk_group=1,
            first_k_dense_replace=1,
            **deepseek_shapes(engine_shapes),
            **DEEPSEEK_MOE_KEYS,
            max_position_embeddings=2048,
            tie_word_embeddings=False,
            **special,
        )
    if arch == "gemma3_text":
        from transformers import Gemma3TextConfig

        return Gemma3TextConfig(  # every 6th layer global, the others a sliding window
            vocab_size=vocab,
            hidden_size=hidden_size,
            intermediate_size=2 * hidden_size,
            num_hidden_layers=num_layers,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=hidden_size // 4,
            query_pre_attn_scalar=hidden_size // 4,
            sliding_window=16,  # binds within a tiny run
            max_position_embeddings=2048,
            tie_word_embeddings=True,
            **special,
        )
    raise ValueError(f"unknown tiny arch {arch!r}")


def make_tiny_target(
    path: str | Path,
    arch: str = "llama",
    num_layers: int = 6,
    hidden_size: int = 64,
    seed: int = 0,
    wrap: str | None = None,
    tokenizer_kind: str = "bpe",
    engine_shapes: bool = False,
) -> Path:
    """Save a random-weight HF causal LM with a real tokenizer and chat template at `path`
    (`wrap`: laid out as that wrapper ships, see WRAPPERS; `tokenizer_kind` "tiktoken": Kimi's
    tokenizer layout, see write_tiktoken_tokenizer; `engine_shapes`: a DeepSeek-V3 the
    serving engines' CPU MLA kernels accept, see deepseek_shapes)."""
    from types import SimpleNamespace

    import torch
    from transformers import AutoModelForCausalLM

    path = Path(path)
    if tokenizer_kind == "tiktoken":
        facts = write_tiktoken_tokenizer(path)
        vocab, tokenizer = facts.pop("vocab_size"), SimpleNamespace(**facts)
    else:
        tokenizer = make_tokenizer()
        vocab = len(tokenizer)
    config = tiny_config(arch, vocab, hidden_size, num_layers, tokenizer, engine_shapes)
    if engine_shapes and arch != "deepseek_v3":
        raise ValueError("engine_shapes: only for arch deepseek_v3 (the MLA engine kernels)")
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config).to(torch.float32).eval()
    with torch.no_grad():  # larger init so hidden states are not all near zero
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.08)
        if arch == "gemma3_text":  # Gemma scales the embedding by sqrt(hidden): undo it here,
            # else the residual stream is the input embedding and greedy repeats one token
            model.get_input_embeddings().weight.mul_(hidden_size**-0.5)
    model.save_pretrained(path, safe_serialization=True)
    if tokenizer_kind != "tiktoken":
        tokenizer.save_pretrained(path)
    if wrap:
        wrap_target(path, wrap)
    return path


def wrap_target(path: str | Path, wrapper: str = "kimi_k25") -> Path:
    """Rewrite a saved causal LM in place as a wrapped checkpoint (module docstring)."""
    import json

    import torch
    from safetensors.torch import load_file, save_file

    path = Path(path)
    arch, model_type = WRAPPERS[wrapper]
    weights = path / "model.safetensors"
    tensors = {f"language_model.{k}": v for k, v in load_file(weights).items()}
    gen = torch.Generator().manual_seed(0)
    tensors["vision_tower.patch_embed.proj.weight"] = torch.randn(8, 3, 2, 2, generator=gen)
    tensors["mm_projector.proj.0.weight"] = torch.randn(8, 8, generator=gen)
    save_file(tensors, weights, metadata={"format": "pt"})
    text = json.loads((path / "config.json").read_text())
    config = {"architectures": [arch], "model_type": model_type, "text_config": text}
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        config[key] = text.get(key)
    config["tie_word_embeddings"] = bool(text.get("tie_word_embeddings"))  # as the text model
    config.update(WRAPPER_KEYS.get(wrapper, {}))
    (path / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    if wrapper == "kimi_k25":
        media = {"media_proc_cfg": KIMI_MEDIA_PROC_CFG}
        (path / "preprocessor_config.json").write_text(json.dumps(media, indent=2) + "\n")
    return path


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(
        prog="python -m draftsmith tiny-model",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--out", type=Path, required=True, help="the model directory to write")
    ap.add_argument("--arch", choices=["llama", "deepseek_v3", "gemma3_text"], default="llama")
    ap.add_argument("--layers", type=int, default=6, help="decoder layers (at least 4)")
    ap.add_argument("--hidden", type=int, default=64, help="hidden size")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--wrap", choices=sorted(WRAPPERS), help="lay out as this wrapper ships")
    ap.add_argument(
        "--tokenizer",
        choices=["bpe", "tiktoken"],
        default="bpe",
        help="tiktoken: a rank file and a remote-code class, as Kimi ships its tokenizer",
    )
    ap.add_argument(
        "--engine-shapes",
        action="store_true",
        help="deepseek_v3 only: kv_lora_rank 512, qk_rope_head_dim 64 and YaRN RoPE, the "
        "shapes vLLM's and SGLang's CPU MLA paths accept",
    )
    args = ap.parse_args(argv)
    if args.out.exists() and any(args.out.iterdir()):
        raise SystemExit(f"error: {args.out} exists and is not empty")
    if args.engine_shapes and args.arch != "deepseek_v3":
        raise SystemExit("error: --engine-shapes needs --arch deepseek_v3")
    make_tiny_target(
        args.out, args.arch, args.layers, args.hidden, args.seed, args.wrap, args.tokenizer,
        args.engine_shapes,
    )  # fmt: skip
    shape = f" wrapped as {args.wrap}" if args.wrap else ""
    print(
        f"wrote a random-weight {args.arch} chat model ({args.layers} layers){shape} to {args.out}"
    )
