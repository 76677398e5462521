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
(`KimiK25ForConditionalGeneration`), nests the text model's config under `text_config` and
describes the vision tower (`vision_config`); the weights are renamed under `language_model.`,
beside a tiny MoonViT and its projector under Kimi's tensor names; `preprocessor_config.json`
carries Kimi-K2.5's media settings (`media_proc_cfg`), from which vLLM builds the wrapper's
processor before it serves even text, and names a small remote processor written beside it.
`--tokenizer tiktoken` ships the tokenizer as Kimi's does: a tiktoken rank file (`tiktoken.model`,
ranks learned here from CORPUS with Kimi's split pattern), a remote-code `TikTokenTokenizer` class
in `tokenization_kimi.py`, reserved special tokens after the ranks and Kimi's thinking chat
template; no tokenizer.json (the target stage makes one, draftsmith.targets.fasttok). The Kimi
pieces: draftsmith.targets.tinykimi.
"""

from __future__ import annotations

from pathlib import Path

from draftsmith.runtime.files import command_parser
from draftsmith.targets import tinykimi

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


def write_tiktoken_tokenizer(path: str | Path, reserved: int = 16, merges: int = 160) -> dict:
    """Write Kimi's tokenizer layout into `path`, ranks learned from CORPUS
    (draftsmith.targets.tinykimi.write_tokenizer); returns {"vocab_size", "bos_token_id",
    "eos_token_id", "pad_token_id"}."""
    return tinykimi.write_tokenizer(Path(path), CORPUS, reserved, merges)


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

    from safetensors.torch import load_file, save_file

    path = Path(path)
    arch, model_type = WRAPPERS[wrapper]
    weights = path / "model.safetensors"
    tensors = {f"language_model.{k}": v for k, v in load_file(weights).items()}
    text = json.loads((path / "config.json").read_text())
    if wrapper == "kimi_k25":
        tensors.update(tinykimi.moonvit_tensors(int(text["hidden_size"])))
    save_file(tensors, weights, metadata={"format": "pt"})
    config = {"architectures": [arch], "model_type": model_type, "text_config": text}
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        config[key] = text.get(key)
    config["tie_word_embeddings"] = bool(text.get("tie_word_embeddings"))  # as the text model
    config.update(WRAPPER_KEYS.get(wrapper, {}))
    if wrapper == "kimi_k25":
        config["vision_config"] = tinykimi.vision_config(int(text["hidden_size"]))
    (path / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    if wrapper == "kimi_k25":
        tinykimi.write_processor(path)
    return path


def main(argv: list[str] | None = None) -> None:
    ap = command_parser("tiny-model", __doc__)
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
