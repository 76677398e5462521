"""The Kimi-K2.5 pieces of a tiny model (draftsmith.targets.tinymodel `--wrap kimi_k25`,
`--tokenizer tiktoken`): what SGLang's and vLLM's Kimi-K2.5 classes read of the checkpoint
Moonshot ships, at tiny sizes. Nothing is downloaded; the code files are written for the tests
after the published interface, not copied.

- The tokenizer: a tiktoken rank file (`tiktoken.model`, ranks learned from a corpus with
  Kimi's split pattern), a remote-code `TikTokenTokenizer` class (`tokenization_kimi.py`),
  reserved special tokens after the ranks, and a thinking chat template after Kimi-K2.5's
  (KIMI_TEMPLATE).
- The vision tower: a 1-layer MoonViT and its projector under Kimi's own tensor names
  (`vision_tower.*`, `mm_projector.*`: moonvit_tensors), and a `vision_config` with both
  naming sets (vision_config): SGLang's tower reads the canonical names (`hidden_size`, ...),
  its projector the `vt_*` names Kimi-K2.5's config uses; the real tower's sizes equal
  SGLang's defaults, so the real config needs only the second set, a tiny one must write both.
- The processor: `preprocessor_config.json` with Kimi-K2.5's media settings (`media_proc_cfg`)
  and an `auto_map` to a small remote processor (PROCESSOR_CODE: `KimiK25Processor`, which
  wraps the directory's tokenizer and a `media_processor` holding `media_proc_cfg`, what
  SGLang's Kimi-K2.5 processor reads).
"""

from __future__ import annotations

import base64
import json
from collections import Counter
from pathlib import Path

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
    "<think>",
    "</think>",
    "<|media_pad|>",
]
# Kimi-K2.5's chat template, shortened: a default system turn, `<|im_{role}|>{role}<|im_middle|>`
# headers, earlier assistant turns without their reasoning (`<think></think>` + answer), the
# last turn after the last user turn with it (`<think>R</think>answer`, or as stored when it has
# no block), and `thinking` false closing the block in the generation prompt (instant mode)
KIMI_TEMPLATE = (
    "{%- set ns = namespace(last_user=-1) -%}"
    "{%- for m in messages -%}{%- if m['role'] == 'user' -%}{%- set ns.last_user = loop.index0 -%}"
    "{%- endif -%}{%- endfor -%}"
    "{%- if not messages or messages[0]['role'] != 'system' -%}"
    "<|im_system|>system<|im_middle|>You are Kimi, an AI assistant created by Moonshot AI."
    "<|im_end|>{%- endif -%}"
    "{%- for m in messages -%}"
    "{%- if m['role'] != 'assistant' -%}"
    "<|im_{{ m['role'] }}|>{{ m['role'] }}<|im_middle|>{{ m['content'] }}<|im_end|>"
    "{%- else -%}<|im_assistant|>assistant<|im_middle|>"
    "{%- set answer = m['content'].split('</think>')[-1] -%}"
    "{%- if loop.index0 > ns.last_user -%}"
    "{%- if '</think>' in m['content'] -%}"
    "<think>{{ m['content'].split('</think>')[0].split('<think>')[-1] }}</think>"
    "{%- elif thinking is defined and not thinking -%}<think></think>{%- endif -%}"
    "{%- else -%}<think></think>{%- endif -%}"
    "{{ answer }}<|im_end|>"
    "{%- endif -%}{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|im_assistant|>assistant<|im_middle|>"
    "{%- if thinking is defined and not thinking -%}<think></think>{%- endif -%}{%- endif -%}"
)
# the remote-code tokenizer class written beside a tiktoken tiny model (Kimi's layout)
TIKTOKEN_CLASS = '''"""A tiktoken tokenizer class as Kimi ships one (draftsmith.targets.tinykimi): trust_remote_code."""

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
# Kimi-K2.5's preprocessor_config.json media settings (patch 14, 2x2 merge, 4-frame video
# chunks, ...); vLLM builds its processor from them even for text-only serving
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
# the remote processor (kimi_k25_processor.py): what SGLang's Kimi-K2.5 processor calls of
# Moonshot's (`tokenizer`, `image_processor`, `media_processor.media_proc_cfg`,
# `media_processor.media_tokens_calculator`); images are resized to whole 28-pixel merge cells
# within the patch limits and cut into normalized 14 x 14 patches
PROCESSOR_CODE = '''"""A processor after Kimi-K2.5's published interface (draftsmith.targets.tinykimi): trust_remote_code."""

import json
import math
import os

import numpy as np
from transformers import AutoTokenizer
from transformers.image_processing_utils import BaseImageProcessor, BatchFeature
from transformers.processing_utils import ProcessorMixin


class KimiK25VisionProcessor(BaseImageProcessor):
    model_input_names = ["pixel_values", "grid_thws"]

    def __init__(self, media_proc_cfg=None, **kwargs):
        super().__init__(**kwargs)
        self.media_proc_cfg = dict(media_proc_cfg or {})

    def _size(self, width, height):
        cfg = self.media_proc_cfg
        p, m = cfg["patch_size"], cfg["merge_kernel_size"]
        side = cfg["patch_limit_on_one_side"] * p
        scale = min(1.0, math.sqrt(cfg["in_patch_limit"] / max(1, (width // p) * (height // p))),
                    side / width, side / height)
        cell = p * m
        return (max(cell, int(width * scale) // cell * cell),
                max(cell, int(height * scale) // cell * cell))

    def media_tokens_calculator(self, media):
        image = media["content"] if isinstance(media, dict) else media
        w, h = self._size(*image.size)
        cell = self.media_proc_cfg["patch_size"] * self.media_proc_cfg["merge_kernel_size"]
        return (w // cell) * (h // cell)

    def preprocess(self, images, return_tensors=None, **kwargs):
        cfg, patches, grids = self.media_proc_cfg, [], []
        p = cfg["patch_size"]
        for image in images if isinstance(images, list) else [images]:
            w, h = self._size(*image.size)
            x = np.asarray(image.convert("RGB").resize((w, h)), dtype=np.float32) / 255.0
            x = (x - np.array(cfg["image_mean"])) / np.array(cfg["image_std"])
            x = x.reshape(h // p, p, w // p, p, 3).transpose(0, 2, 4, 1, 3)
            patches.append(x.reshape(-1, 3, p, p))
            grids.append([1, h // p, w // p])
        data = {"pixel_values": np.concatenate(patches).astype(np.float32),
                "grid_thws": np.array(grids, dtype=np.int64)}
        return BatchFeature(data=data, tensor_type=return_tensors)


class KimiK25Processor(ProcessorMixin):
    attributes = ["tokenizer"]
    tokenizer_class = "AutoTokenizer"

    def __init__(self, media_processor=None, tokenizer=None, chat_template=None, **kwargs):
        super().__init__(tokenizer, chat_template=chat_template)
        self.media_processor = media_processor
        self.image_processor = media_processor

    @classmethod
    def from_pretrained(cls, path, **kwargs):
        kwargs.pop("trust_remote_code", None)
        tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=True)
        with open(os.path.join(path, "preprocessor_config.json")) as f:
            cfg = json.load(f)
        media = KimiK25VisionProcessor(media_proc_cfg=cfg["media_proc_cfg"])
        return cls(media_processor=media, tokenizer=tokenizer,
                   chat_template=getattr(tokenizer, "chat_template", None))

    def __call__(self, text=None, medias=None, images=None, return_tensors=None, **kwargs):
        images = images or [m["content"] for m in medias or []]
        out = dict(self.tokenizer(text, return_tensors=return_tensors)) if text is not None else {}
        if images:
            out.update(self.media_processor.preprocess(images, return_tensors=return_tensors))
        return BatchFeature(data=out, tensor_type=return_tensors)
'''
PROCESSOR_AUTO_MAP = {
    "AutoProcessor": "kimi_k25_processor.KimiK25Processor",
    "AutoImageProcessor": "kimi_k25_processor.KimiK25VisionProcessor",
}
# the tiny MoonViT: Kimi-K2.5's 27 layers of width 1152 cut to one of width 16, and a 4 x 4
# learned position grid (Kimi's 64 x 64); its heads of 8 keep the 2-D RoPE's multiple of 4
VIT = {"hidden": 16, "heads": 2, "mlp": 32, "layers": 1, "grid": 4}


def tiktoken_ranks(corpus: list[str], merges: int = 160) -> dict[bytes, int]:
    """Byte-level BPE ranks learned from `corpus` (pre-split with KIMI_PATTERN): the 256 bytes,
    then one token per merge, most frequent pair first (ties: the larger pair)."""
    import regex

    split = regex.compile(KIMI_PATTERN, flags=regex.V1)
    text = "\n".join(corpus * 4) + "\n你好，世界。今天天气很好。"
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


def write_tokenizer(path: Path, corpus: list[str], reserved: int = 16, merges: int = 160) -> dict:
    """Write Kimi's tokenizer layout into `path` (module docstring); returns {"vocab_size",
    "bos_token_id", "eos_token_id", "pad_token_id"}."""
    path.mkdir(parents=True, exist_ok=True)
    ranks = tiktoken_ranks(corpus, merges)
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


def vision_config(text_hidden: int) -> dict:
    """The tiny tower's `vision_config`: both naming sets (module docstring), Kimi's other
    settings as published."""
    h, heads, mlp, layers = VIT["hidden"], VIT["heads"], VIT["mlp"], VIT["layers"]
    return {
        "patch_size": 14,
        "init_pos_emb_height": VIT["grid"],
        "init_pos_emb_width": VIT["grid"],
        "init_pos_emb_time": 4,
        "pos_emb_type": "divided_fixed",
        "hidden_size": h,
        "num_attention_heads": heads,
        "num_hidden_layers": layers,
        "intermediate_size": mlp,
        "vt_hidden_size": h,
        "vt_num_attention_heads": heads,
        "vt_num_hidden_layers": layers,
        "vt_intermediate_size": mlp,
        "merge_kernel_size": [2, 2],
        "video_attn_type": "spatial_temporal",
        "merge_type": "sd2_tpool",
        "mm_projector_type": "patchmerger",
        "mm_hidden_size": h,
        "projector_hidden_act": "gelu",
        "projector_ln_eps": 1e-5,
        "text_hidden_size": text_hidden,
    }


def moonvit_tensors(text_hidden: int, seed: int = 0) -> dict:
    """Random weights of the tiny tower and projector under Kimi-K2.5's tensor names (the
    shapes SGLang's MoonViT3dPretrainedModel and K2VLMultiModalProjector load)."""
    import torch

    h, mlp, grid = VIT["hidden"], VIT["mlp"], VIT["grid"]
    merged = 4 * h  # the 2 x 2 merge concatenates four patches
    shapes = {
        "vision_tower.patch_embed.proj.weight": (h, 3, 14, 14),
        "vision_tower.patch_embed.proj.bias": (h,),
        "vision_tower.patch_embed.pos_emb.weight": (grid, grid, h),
        "vision_tower.encoder.final_layernorm.weight": (h,),
        "vision_tower.encoder.final_layernorm.bias": (h,),
        "mm_projector.pre_norm.weight": (h,),
        "mm_projector.pre_norm.bias": (h,),
        "mm_projector.proj.0.weight": (merged, merged),
        "mm_projector.proj.0.bias": (merged,),
        "mm_projector.proj.2.weight": (text_hidden, merged),
        "mm_projector.proj.2.bias": (text_hidden,),
    }
    for i in range(VIT["layers"]):
        block = f"vision_tower.encoder.blocks.{i}."
        for norm in ("norm0", "norm1"):
            shapes |= {f"{block}{norm}.weight": (h,), f"{block}{norm}.bias": (h,)}
        shapes |= {
            f"{block}wqkv.weight": (3 * h, h),
            f"{block}wqkv.bias": (3 * h,),
            f"{block}wo.weight": (h, h),
            f"{block}wo.bias": (h,),
            f"{block}mlp.fc0.weight": (mlp, h),
            f"{block}mlp.fc0.bias": (mlp,),
            f"{block}mlp.fc1.weight": (h, mlp),
            f"{block}mlp.fc1.bias": (h,),
        }
    gen = torch.Generator().manual_seed(seed)
    return {k: torch.randn(*s, generator=gen) * 0.02 for k, s in shapes.items()}


def write_processor(path: Path) -> None:
    """preprocessor_config.json (media settings, auto_map) and the remote processor's code."""
    cfg = {"auto_map": PROCESSOR_AUTO_MAP, "media_proc_cfg": KIMI_MEDIA_PROC_CFG}
    (path / "preprocessor_config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    (path / "kimi_k25_processor.py").write_text(PROCESSOR_CODE)
