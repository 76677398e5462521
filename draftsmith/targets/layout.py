"""Where a target checkpoint keeps its text model: the config nesting and the weight-name prefix.

A plain causal LM (Llama, Qwen, DeepSeek-V3) has its config at the top of `config.json` and its
weights named `model.embed_tokens.weight`, `model.layers.<i>.*`, `model.norm.weight` and
`lm_head.weight` (absent when tied). Wrapped checkpoints nest the text model: Kimi-K2.5
(`KimiK25ForConditionalGeneration`) and multimodal Gemma-3 as saved before transformers 4.52 keep
its config under `text_config` and its weights under `language_model.model.*` with
`language_model.lm_head.weight`; later transformers saves use `model.language_model.*` and a
top-level `lm_head.weight`. Vision towers and projectors sit beside it and are never read.

`find_layout` reads the nesting from config.json and the prefix from the weight names (the
safetensors index, else the files' headers; no tensor data), so every stage that reads the
target (training's frozen pieces, the hf engine's model, the export's embedding, the recorded
target metadata) names the same tensors.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

CONFIG_KEY = "text_config"
PLAIN_BASE = "model."
PLAIN_HEAD = "lm_head.weight"
INDEX_FILE = "model.safetensors.index.json"
# where a loaded transformers model keeps its text decoder (plain, then multimodal wrappers)
MODULE_PATHS = ("model", "model.language_model", "language_model.model", "language_model")


class LayoutError(ValueError):
    """A checkpoint whose text model cannot be found; the message names the directory and why."""


def text_config(config: dict) -> dict:
    """The text model's config: `text_config` of a wrapper, else the config itself."""
    return config.get(CONFIG_KEY) or config


@dataclass(frozen=True)
class Layout:
    """The names of the text model's pieces in one checkpoint."""

    base: str  # prefix of embed_tokens, layers.<i>, norm ("model." when plain)
    lm_head: str | None  # full name of the output head; None: tied to the embedding
    nested: bool  # config.json nests the text model's config under `text_config`
    architectures: tuple[str, ...]  # config.json's top-level architectures

    @property
    def embed(self) -> str:
        return f"{self.base}embed_tokens.weight"

    @property
    def norm(self) -> str:
        return f"{self.base}norm.weight"

    @property
    def wrapped(self) -> bool:
        return self.nested or self.base != PLAIN_BASE or self.lm_head not in (None, PLAIN_HEAD)

    def key_mapping(self) -> dict[str, str]:
        """Regexes from this checkpoint's names to a plain causal LM's (transformers' key_mapping)."""
        out = {}
        if self.base != PLAIN_BASE:
            out[f"^{re.escape(self.base)}"] = PLAIN_BASE
        if self.lm_head not in (None, PLAIN_HEAD):
            out[f"^{re.escape(self.lm_head)}$"] = PLAIN_HEAD
        return out

    def describe(self) -> dict:
        """What draftsmith_target.json records of a wrapped target."""
        return {
            "architectures": list(self.architectures),
            "config": CONFIG_KEY if self.nested else None,
            "prefix": self.base,
            "lm_head": self.lm_head,
        }


def weight_files(target_dir: Path) -> dict[str, Path]:
    """Every tensor name of a checkpoint and the file holding it (index first, else headers)."""
    from safetensors import safe_open

    target_dir = Path(target_dir)
    index = target_dir / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (ValueError, KeyError, TypeError) as e:
            raise LayoutError(f"{index}: no readable weight_map ({e})") from None
        return {k: target_dir / v for k, v in weight_map.items()}
    files = sorted(target_dir.glob("*.safetensors"))
    if not files:
        raise LayoutError(f"{target_dir}: no *.safetensors weights")
    names: dict[str, Path] = {}
    for path in files:
        with safe_open(str(path), framework="pt") as f:
            names.update(dict.fromkeys(f.keys(), path))
    return names


def _find_base(target_dir: Path, names) -> str:
    """The one prefix P with Pembed_tokens.weight and Pnorm.weight outside any decoder layer (of
    several, the ones with Players.*)."""
    embeds = [n for n in names if n.endswith("embed_tokens.weight") and "layers." not in n]
    bases = [e.removesuffix("embed_tokens.weight") for e in embeds]
    bases = [b for b in bases if f"{b}norm.weight" in names]
    if len(bases) > 1:
        bases = [b for b in bases if any(n.startswith(f"{b}layers.") for n in names)]
    if len(bases) != 1:
        why = "several" if bases else "no"
        raise LayoutError(
            f"{target_dir}: {why} text model found in the weight names (want one prefix P with "
            f"Pembed_tokens.weight, Pnorm.weight and Players.*; embeddings seen: {embeds[:6]}, "
            f"prefixes that fit: {bases})"
        )
    return bases[0]


def _find_head(target_dir: Path, names, base: str) -> str | None:
    """The output head: the one `*lm_head.weight` outside the decoder layers (None: tied); of
    several, the one beside the text model (its prefix begins `base`)."""
    heads = [n for n in names if n.endswith(PLAIN_HEAD) and "layers." not in n]
    if len(heads) > 1:
        beside = [h for h in heads if base.startswith(h.removesuffix(PLAIN_HEAD))]
        if not beside:
            raise LayoutError(
                f"{target_dir}: several output heads {heads}, none beside the text model {base!r}"
            )
        heads = [max(beside, key=len)]
    return heads[0] if heads else None


def find_layout(target_dir: str | Path) -> Layout:
    """Where the text model's pieces are in the checkpoint at `target_dir`."""
    target_dir = Path(target_dir)
    cfg_file = target_dir / "config.json"
    try:
        config = json.loads(cfg_file.read_text())
    except (OSError, ValueError) as e:
        raise LayoutError(f"{cfg_file}: not readable as JSON ({e})") from None
    names = weight_files(target_dir)
    base = _find_base(target_dir, names)
    return Layout(
        base=base,
        lm_head=_find_head(target_dir, names, base),
        nested=bool(config.get(CONFIG_KEY)),
        architectures=tuple(config.get("architectures") or ()),
    )


def read_pieces(
    target_dir: str | Path, roles=("embed", "norm", "lm_head"), layout: Layout | None = None
) -> dict:
    """Frozen pieces as stored, by role: embed, norm, lm_head (the embedding when tied)."""
    layout = layout or find_layout(target_dir)
    named = {"embed": layout.embed, "norm": layout.norm, "lm_head": layout.lm_head or layout.embed}
    want = {role: named[role] for role in roles}
    return read_named(weight_files(Path(target_dir)), want)


def read_layer(target_dir: str | Path, index: int, suffixes, layout: Layout | None = None) -> dict:
    """Tensors of decoder layer `index` as stored, by suffix (`self_attn.q_proj.weight`, ...);
    a suffix the layer does not hold is left out (the caller names what it needs)."""
    layout = layout or find_layout(target_dir)
    names = weight_files(Path(target_dir))
    prefix = f"{layout.base}layers.{int(index)}."
    want = {suffix: prefix + suffix for suffix in suffixes if prefix + suffix in names}
    return read_named(names, want)


def read_named(names: dict[str, Path], want: dict) -> dict:
    """{key: tensor} for `want` ({key: tensor name}), from the files `names` maps each name to
    (weight_files); a name wanted under two keys (a tied head) is read once."""
    from safetensors import safe_open

    read: dict[str, object] = {}
    for name in dict.fromkeys(want.values()):
        with safe_open(str(names[name]), framework="pt") as f:
            read[name] = f.get_tensor(name)
    return {key: read[name] for key, name in want.items()}


def decoder_modules(model):
    """(base model, its decoder layers) of a loaded transformers LM, plain or multimodal; None
    when neither path holds `.layers` and `.norm`."""
    import torch

    for path in MODULE_PATHS:
        base = model
        for attr in path.split("."):
            base = getattr(base, attr, None)
        layers = getattr(base, "layers", None)
        if isinstance(layers, torch.nn.ModuleList) and hasattr(base, "norm"):
            return base, layers
    return None


def load_text_model(target_dir: str | Path, layout: Layout, **kwargs):
    """The text model of a wrapped checkpoint as a plain transformers causal LM, its weights
    renamed by `layout.key_mapping()` (vision tower and projector left unread); `kwargs` go to
    from_pretrained (dtype, device_map)."""
    import transformers

    target_dir = Path(target_dir)
    cfg = text_config(json.loads((target_dir / "config.json").read_text()))
    known = [a for a in cfg.get("architectures") or () if hasattr(transformers, a)]
    rest = {k: v for k, v in cfg.items() if k != "model_type"}
    try:
        if known:
            cls = getattr(transformers, known[0])
            config = cls.config_class.from_dict(rest)
        else:
            cls = transformers.AutoModelForCausalLM
            config = transformers.AutoConfig.for_model(cfg.get("model_type"), **rest)
    except ValueError as e:
        raise LayoutError(
            f"{target_dir}/config.json: its {CONFIG_KEY} (model_type {cfg.get('model_type')!r}, "
            f"architectures {cfg.get('architectures')}) is no model transformers knows: {e}"
        ) from None
    return cls.from_pretrained(
        target_dir, config=config, key_mapping=layout.key_mapping(), **kwargs
    )


def serve_text_only(path: Path) -> dict | None:
    """Declare a multimodal wrapper (`text_config` beside a `vision_config`) text-only in the
    served config.json at `path` (results/target; a link to the user's file becomes a file):
    `language_model_only: true`. Every engine draftsmith starts sends text only. SGLang 0.5.23
    then loads the tokenizer every other stage reads (results/target's, made fast there) instead
    of building the checkpoint's multimodal processor, whose remote code the target stage's
    tokenizer rewrite may not suit; its Kimi-K2.5 class still builds the tower (it does not
    read the key), so the vision weights stay. vLLM serves a wrapper with the same option
    (draftsmith.engines.vllm); transformers' configs keep the key as an attribute. Returns what
    was written (recorded in draftsmith_target.json), None for other targets."""
    file = Path(path) / "config.json"
    cfg = json.loads(file.read_text())
    if not (isinstance(cfg.get(CONFIG_KEY), dict) and isinstance(cfg.get("vision_config"), dict)):
        return None
    written = {"language_model_only": True}
    cfg.update(written)
    tmp = file.with_name(".config.json.tmp")
    tmp.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    file.unlink()
    tmp.rename(file)
    return written
