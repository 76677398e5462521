"""A tiktoken tokenizer made a fast (`tokenizers`) one, written beside the target in its stage.

Kimi-K2.5 (like Kimi-K2, Kimi-Linear) ships its tokenizer as a tiktoken rank file
(`tiktoken.model`: one `base64(token bytes) rank` per line) plus remote code
(`tokenization_kimi.py`, class `TikTokenTokenizer`) that splits text with its own pattern
(`pat_str`) and appends 256 reserved special tokens after the ranks. transformers loads that class
only with trust_remote_code, and as a slow tokenizer: no offsets, which the tokens stage needs.

`make_fast` writes, into the target's results directory, a `tokenizer.json` built by
transformers' own `TikTokenConverter` from:
- the ranks (read here; dense 0..N-1 is required, so the special ids follow them exactly),
- the split pattern: the tokenizer class's `pat_str`, read from its source file without running
  it (a string literal, a concatenation or `"|".join([...])` of literals); only when it is
  something else is the class imported, which needs `target.trust_remote_code`. A directory whose
  tokenizer is not remote code gets transformers' default tiktoken pattern (what transformers
  itself uses for a bare tiktoken file),
- the special tokens: ids N.. from `tokenizer_config.json`'s `added_tokens_decoder`, as many as
  the class's `num_reserved_special_tokens` (or the highest id given), gaps named
  `<|reserved_token_{id}|>` as Kimi's class names them,
and a `tokenizer_config.json` that loads it (`PreTrainedTokenizerFast`, the remote
`AutoTokenizer` entry dropped, everything else kept). The user's directory is not written.

The result is checked before it is used: every rank token has its rank, every special its id,
a probe text round-trips, and the probe encodes to the same ids as tiktoken itself with the same
ranks, pattern and specials. tiktoken is pinned in the cpu role (envs/cpu.txt), which runs the
target stage; an interpreter without it skips that last check with a warning in the log, and the
target's meta says so (`tokenizer.checked`).
"""

from __future__ import annotations

import ast
import base64
import binascii
import inspect
import json
import logging
import re
from pathlib import Path

log = logging.getLogger("draftsmith.targets.fasttok")

TIKTOKEN_NAMES = ("tiktoken.model", "tokenizer.model")
RANK_LINE = re.compile(rb"^[A-Za-z0-9+/]+=*[ \t]+\d+\s*$")
PROBE = (
    "Hello world! It's 2026, they're here: 12345 + 678 = 13023.\n"
    "def f(x):\n    return x * 2  # 注释\n你好，世界。Ünïcödé ÉCOLE straße  \t tabs\n\n"
)


class FastTokError(ValueError):
    """The tiktoken tokenizer cannot be converted; the message names the file and the fix."""


def tiktoken_file(path: Path) -> Path | None:
    """The tiktoken rank file of a directory that has no tokenizer.json, else None."""
    path = Path(path)
    if (path / "tokenizer.json").is_file():
        return None
    for name in TIKTOKEN_NAMES:
        f = path / name
        if f.is_file():
            with open(f, "rb") as fh:
                first = fh.readline()
            if RANK_LINE.match(first):
                return f
    return None


def read_ranks(path: Path) -> dict[bytes, int]:
    """{token bytes: rank} of a tiktoken rank file; ranks must be 0..N-1, each once."""
    ranks: dict[bytes, int] = {}
    with open(path, "rb") as fh:
        for lineno, line in enumerate(fh, start=1):
            if not line.strip():
                continue
            parts = line.split()
            try:
                token, rank = base64.b64decode(parts[0], validate=True), int(parts[1])
            except (IndexError, ValueError, binascii.Error):
                raise FastTokError(f"{path}:{lineno}: not a tiktoken rank line") from None
            if token in ranks:
                raise FastTokError(f"{path}:{lineno}: token {token!r} listed twice")
            ranks[token] = rank
    if sorted(ranks.values()) != list(range(len(ranks))):
        raise FastTokError(
            f"{path}: the ranks are not 0..{len(ranks) - 1}, each once: the special tokens' ids "
            "(which follow the ranks) would be ambiguous"
        )
    return ranks


def _literal(node, names: dict):
    """The string value of a pattern expression, or None when it is not made of literals."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.Name):
        return names.get(node.id)
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        a, b = _literal(node.left, names), _literal(node.right, names)
        return None if a is None or b is None else a + b
    if (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr == "join"
        and len(node.args) == 1
        and not node.keywords
        and isinstance(node.args[0], (ast.List, ast.Tuple))
    ):
        sep = _literal(node.func.value, names)
        parts = [_literal(e, names) for e in node.args[0].elts]
        return None if sep is None or None in parts else sep.join(parts)
    return None


def class_attrs(source: str, class_name: str) -> dict:
    """{name: value} of a class's string and int attributes made of literals (not run)."""
    tree = ast.parse(source)
    module = {}
    for node in tree.body:  # module-level string constants a pattern may be built from
        if isinstance(node, ast.Assign) and len(node.targets) == 1:
            if isinstance(node.targets[0], ast.Name):
                value = _literal(node.value, module)
                if value is not None:
                    module[node.targets[0].id] = value
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == class_name:
            out = {}
            for item in node.body:
                target, value = None, None
                if isinstance(item, ast.Assign) and len(item.targets) == 1:
                    target, value = item.targets[0], item.value
                elif isinstance(item, ast.AnnAssign) and item.value is not None:
                    target, value = item.target, item.value
                if not isinstance(target, ast.Name):
                    continue
                if isinstance(value, ast.Constant) and isinstance(value.value, int):
                    out[target.id] = value.value
                else:
                    text = _literal(value, {**module, **out})
                    if text is not None:
                        out[target.id] = text
            return out
    raise FastTokError(f"no class {class_name} in the tokenizer module")


def remote_class(tok_cfg: dict) -> str | None:
    """ "module.Class" of the remote-code slow tokenizer named by tokenizer_config.json."""
    entry = (tok_cfg.get("auto_map") or {}).get("AutoTokenizer")
    if isinstance(entry, (list, tuple)):
        entry = entry[0] if entry else None
    return entry.split("--")[-1] if isinstance(entry, str) and entry else None


def split_pattern(src: Path, tok_cfg: dict, trust_remote_code: bool) -> tuple[str, int, str]:
    """(pattern, reserved special count or 0, where the pattern came from)."""
    from transformers.convert_slow_tokenizer import TikTokenConverter

    ref = remote_class(tok_cfg)
    if ref is None:
        default = inspect.signature(TikTokenConverter).parameters["pattern"].default
        return default, 0, "transformers' default tiktoken pattern (no tokenizer class)"
    module, _, cls = ref.rpartition(".")
    code = src / f"{module.replace('.', '/')}.py"
    if not code.is_file():
        raise FastTokError(f"{src}/tokenizer_config.json names {ref}, but {code} is missing")
    try:
        attrs = class_attrs(code.read_text(encoding="utf-8"), cls)
    except (SyntaxError, FastTokError) as e:
        raise FastTokError(f"{code}: {e}") from None
    reserved = attrs.get("num_reserved_special_tokens", 0)
    if isinstance(attrs.get("pat_str"), str):
        return attrs["pat_str"], int(reserved), f"{code.name}: {cls}.pat_str"
    if not trust_remote_code:
        raise FastTokError(
            f"{code}: {cls}.pat_str (the tokenizer's split pattern) is not made of string "
            "literals, so it can only be read by running that file: set "
            "target.trust_remote_code: true to allow it, or put a tokenizer.json beside it"
        )
    from transformers.dynamic_module_utils import get_class_from_dynamic_module

    klass = get_class_from_dynamic_module(ref, str(src))
    pattern = getattr(klass, "pat_str", None)
    if not isinstance(pattern, str):
        raise FastTokError(f"{code}: {cls} has no string pat_str: cannot convert its tokenizer")
    reserved = getattr(klass, "num_reserved_special_tokens", reserved)
    return pattern, int(reserved), f"{code.name}: {cls}.pat_str (run)"


def special_tokens(tok_cfg: dict, n_base: int, reserved: int, where: str) -> list[str]:
    """The special tokens with ids n_base, n_base + 1, ... in order."""
    added = {}
    for i, tok in (tok_cfg.get("added_tokens_decoder") or {}).items():
        content = tok["content"] if isinstance(tok, dict) else str(tok)
        if int(i) < n_base:
            raise FastTokError(
                f"{where}: added token {content!r} has id {i}, inside the {n_base} ranks"
            )
        added[int(i)] = content
    count = max(reserved, max(added, default=n_base - 1) - n_base + 1)
    names = [added.get(i, f"<|reserved_token_{i}|>") for i in range(n_base, n_base + count)]
    if len(set(names)) != len(names):
        raise FastTokError(f"{where}: added_tokens_decoder names one token twice")
    return names


def make_fast(src: Path, out: Path, trust_remote_code: bool = False) -> dict | None:
    """Write out/tokenizer.json and out/tokenizer_config.json for the tiktoken tokenizer of
    `src` (out/tokenizer_config.json, a link to src's, is replaced by a file). Returns what was
    done, for the target's meta, or None when `src` needs nothing (it has a tokenizer.json, or
    no tiktoken file)."""
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import TikTokenConverter

    src, out = Path(src), Path(out)
    rank_file = tiktoken_file(src)
    if rank_file is None:
        return None
    cfg_file = src / "tokenizer_config.json"
    try:
        tok_cfg = json.loads(cfg_file.read_text(encoding="utf-8")) if cfg_file.is_file() else {}
    except ValueError as e:
        raise FastTokError(f"{cfg_file}: not JSON ({e})") from None
    ranks = read_ranks(rank_file)
    pattern, reserved, pattern_from = split_pattern(src, tok_cfg, trust_remote_code)
    specials = special_tokens(tok_cfg, len(ranks), reserved, str(cfg_file))

    class Converter(TikTokenConverter):
        @staticmethod
        def load_tiktoken_bpe(_url):
            return ranks

    backend = Converter(str(rank_file), pattern=pattern, extra_special_tokens=specials).converted()
    new_cfg = {k: v for k, v in tok_cfg.items() if k not in ("auto_map", "tokenizer_class")}
    auto_map = {k: v for k, v in (tok_cfg.get("auto_map") or {}).items() if k != "AutoTokenizer"}
    if auto_map:
        new_cfg["auto_map"] = auto_map
    new_cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    for name in ("tokenizer.json", "tokenizer_config.json"):
        if (out / name).is_symlink() or (out / name).exists():
            (out / name).unlink()
    backend.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps(new_cfg, indent=2) + "\n")
    fast = PreTrainedTokenizerFast.from_pretrained(str(out))
    checked = check_fast(fast, ranks, pattern, specials, str(out / "tokenizer.json"))
    return {
        "converted_from": rank_file.name,
        "pattern_from": pattern_from,
        "ranks": len(ranks),
        "special_tokens": len(specials),
        "checked": checked,
    }


def check_fast(fast, ranks: dict, pattern: str, specials: list[str], where: str) -> str:
    """Raise FastTokError unless `fast` is the tiktoken tokenizer; returns what was checked."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    enc = bytes_to_unicode()
    vocab = fast.get_vocab()
    wrong = [t for t, r in ranks.items() if vocab.get("".join(enc[b] for b in t)) != r]
    wrong += [s for i, s in enumerate(specials) if vocab.get(s) != len(ranks) + i]
    if wrong:
        raise FastTokError(f"{where}: {len(wrong)} tokens got other ids, e.g. {wrong[:3]!r}")
    probe = PROBE + "".join(specials[:2])
    ids = fast(probe, add_special_tokens=False)["input_ids"]
    if fast.decode(ids, clean_up_tokenization_spaces=False) != probe:
        raise FastTokError(f"{where}: the probe text does not decode back to itself")
    try:
        import tiktoken
    except ImportError:
        log.warning(
            "%s: tiktoken is not installed (envs/cpu.txt pins it), so the converted tokenizer was "
            "not compared with tiktoken itself; only its ids and a round trip were checked",
            where,
        )
        return "ids of every token, probe round trip (tiktoken not installed)"
    ref = tiktoken.Encoding(
        name="draftsmith-check",
        pat_str=pattern,
        mergeable_ranks=ranks,
        special_tokens={s: len(ranks) + i for i, s in enumerate(specials)},
    ).encode(probe, allowed_special="all")
    if ref != ids:
        at = next(
            (i for i, (a, b) in enumerate(zip(ref, ids, strict=False)) if a != b),
            min(len(ref), len(ids)),
        )
        raise FastTokError(
            f"{where}: the converted tokenizer encodes the probe text differently from tiktoken "
            f"(first difference at token {at}): the pattern {pattern!r} may use a construct "
            "the tokenizers library reads differently"
        )
    return f"ids of every token, probe round trip, probe equal to tiktoken {tiktoken.__version__}"
