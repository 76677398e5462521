"""Export the draft in SGLang's EAGLE-3 checkpoint contract, plus a speculators/vLLM copy.

`results/draft/`:
    config.json          LlamaForCausalLMEagle3 config, read by SGLang and by vLLM
    model.safetensors    fc, midlayer.*, norm, lm_head, d2t, t2d (fp32; no embed_tokens)
    speculators/         the same weights as layers.0.* plus the target's embed_tokens, with a
                         speculators "eagle3" config (speculators' own loader; also vLLM)
    draftsmith_draft.json provenance (training config, shard checksums, versions)

One config serves both engines although they number the aux layers differently: SGLang reads
only `eagle_config.eagle_aux_hidden_state_layer_ids` (output of layer i; it adds 1 itself),
vLLM reads a top-level `eagle_aux_hidden_state_layer_ids` first (input of layer i: SGLang id +
1). Both keys are written and `check_export` refuses a config where they disagree. A draft whose
vocabulary is the whole target vocabulary carries no d2t/t2d (identity; vLLM refuses a d2t
there).

SGLang 0.5.23's `LlamaForCausalLMEagle3.load_weights` silently skips names it does not know, so
`check_export` replays its name mapping (legacy `midlayer` -> `layers.0`, q/k/v -> qkv_proj,
gate/up -> gate_up_proj, then the name or `model.<name>` must be a parameter) against the
parameter shapes that the config implies, and refuses anything unconsumed, missing or misshaped.

What differs per draft algorithm (draftsmith.algorithms: the config keys and tensors it adds,
what it refuses, whether a speculators copy is written) comes from the algorithm's module; the
algorithm of an exported config.json is told from its keys (`algorithms.of_export`).

CLI: `python -m draftsmith.export check results/draft`.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import sys
import tempfile
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from draftsmith import algorithms
from draftsmith.common import atomic_write_json, fsync_dir
from draftsmith.families import family_facts, serving_findings
from draftsmith.finite import metrics_problem, nonfinite_tensors
from draftsmith.layout import LayoutError, read_pieces
from draftsmith.model import DraftConfig, Eagle3Draft

ARCH = "LlamaForCausalLMEagle3"
WEIGHTS = "model.safetensors"
PROVENANCE = "draftsmith_draft.json"
# (SGLang fused parameter, checkpoint shard name, shard id), as in load_weights
STACKED = [
    (".qkv_proj", ".q_proj", "q"),
    (".qkv_proj", ".k_proj", "k"),
    (".qkv_proj", ".v_proj", "v"),
    (".gate_up_proj", ".gate_proj", 0),
    (".gate_up_proj", ".up_proj", 1),
]
LEGACY = {"midlayer": "layers.0"}


log = logging.getLogger("draftsmith.export")


class ExportError(ValueError):
    """The exported draft is not what SGLang's loader will consume."""


def target_family(target_dir, cfg: DraftConfig, trained_length: int) -> dict:
    """The target family's facts for the provenance (`draftsmith.families.family_facts`), read
    from the target's whole config.json (a multimodal wrapper's own model type included)."""
    full = json.loads((Path(target_dir) / "config.json").read_text())
    return family_facts(full, cfg.rope_scaling, trained_length)


def serving_problems(findings: list[dict]) -> list[str]:
    return [f"{f['engine']}: {f['file']}: {f['reason']}" for f in findings]


def serve_gate(target_dir, mode: str) -> None:
    """draft.serve_check strict: refuse, before training, a target an engine of the pinned
    wheels cannot serve an EAGLE-3 draft for (or serves with other aux states)."""
    full = json.loads((Path(target_dir) / "config.json").read_text())
    problems = serving_problems(serving_findings(full))
    if problems and mode == "strict":
        raise ExportError(
            f"{target_dir}: draft.serve_check is strict and a pinned engine cannot serve this "
            "target's EAGLE-3 draft as trained:\n  " + "\n  ".join(problems)
        )


def say_family(where, facts: dict) -> None:
    """The family warnings on stderr (the job's log): RoPE not carried, serving per engine."""
    for w in facts["warnings"]:
        log.warning("%s: %s", where, w)


def sglang_config(cfg: DraftConfig) -> dict:
    """The draft's config.json (Llama fields + EAGLE-3 keys + its algorithm's keys) in
    SGLang's contract."""
    return {
        "architectures": [ARCH],
        "model_type": "llama",
        "num_hidden_layers": 1,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": cfg.hidden_act,
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_scaling": cfg.rope_scaling,
        "max_position_embeddings": cfg.max_position_embeddings,
        "vocab_size": cfg.vocab_size,
        "draft_vocab_size": cfg.draft_vocab_size,
        "target_hidden_size": cfg.target_hidden_size,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "mlp_bias": False,
        "torch_dtype": "float32",
        "eagle_config": {
            "eagle_aux_hidden_state_layer_ids": list(cfg.aux_layer_ids),
            "use_aux_hidden_state": True,
        },
        # vLLM's reading of the same layers (it looks here before eagle_config); SGLang ignores it
        "eagle_aux_hidden_state_layer_ids": vllm_layer_ids(cfg.aux_layer_ids),
        "norm_before_residual": False,
        **algorithms.get(cfg.algorithm).export_keys(cfg),
    }


def vllm_layer_ids(sglang_ids) -> list[int]:
    """SGLang "output of layer i" -> vLLM/speculators/HF "input of layer i + 1"."""
    return [int(i) + 1 for i in sglang_ids]


def full_vocab(c: dict) -> bool:
    """The draft predicts the whole target vocabulary: no d2t/t2d in the export."""
    return c["draft_vocab_size"] == c["vocab_size"]


def config_from_sglang(c: dict) -> DraftConfig:
    """Inverse of `sglang_config` (checks the contract keys on the way)."""
    problems = config_problems(c)
    if problems:
        raise ExportError("; ".join(problems))
    return DraftConfig(
        hidden_size=c["hidden_size"],
        num_attention_heads=c["num_attention_heads"],
        num_key_value_heads=c.get("num_key_value_heads", c["num_attention_heads"]),
        head_dim=c.get("head_dim", c["hidden_size"] // c["num_attention_heads"]),
        intermediate_size=c["intermediate_size"],
        vocab_size=c["vocab_size"],
        draft_vocab_size=c["draft_vocab_size"],
        aux_layer_ids=list(c["eagle_config"]["eagle_aux_hidden_state_layer_ids"]),
        target_hidden_size=c.get("target_hidden_size", c["hidden_size"]),
        rms_norm_eps=c["rms_norm_eps"],
        rope_theta=c.get("rope_theta", 10000.0),
        rope_scaling=c.get("rope_scaling"),
        max_position_embeddings=c.get("max_position_embeddings", 8192),
        hidden_act=c.get("hidden_act", "silu"),
        algorithm=algorithms.of_export(c).NAME,
    )


def config_problems(c: dict) -> list[str]:
    want = {
        "architectures": [ARCH],
        "model_type": "llama",
        "num_hidden_layers": 1,
        "tie_word_embeddings": False,
        "hidden_act": "silu",
    }
    out = [
        f"config.json {k} is {c.get(k)!r}, SGLang needs {v!r}"
        for k, v in want.items()
        if c.get(k) != v
    ]
    for k in (
        "hidden_size",
        "intermediate_size",
        "num_attention_heads",
        "rms_norm_eps",
        "vocab_size",
        "draft_vocab_size",
    ):
        if k not in c:
            out.append(f"config.json has no {k!r}")
    ids = (c.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    if not (isinstance(ids, list) and ids and all(isinstance(i, int) for i in ids)):
        out.append(f"config.json eagle_config.eagle_aux_hidden_state_layer_ids is {ids!r}")
    if (c.get("eagle_config") or {}).get("use_aux_hidden_state") is not True:
        out.append("config.json eagle_config.use_aux_hidden_state must be true")
    if c.get("rope_parameters") is not None:
        out.append("config.json has rope_parameters: SGLang would prefer it over rope_theta")
    top = c.get("eagle_aux_hidden_state_layer_ids")
    if isinstance(ids, list) and top != vllm_layer_ids(ids):
        out.append(
            f"config.json eagle_aux_hidden_state_layer_ids is {top!r}: vLLM reads it before "
            f"eagle_config and needs the SGLang ids + 1, {vllm_layer_ids(ids)} (re-export the "
            "draft: an older export feeds vLLM states one layer too early)"
        )
    if c.get("norm_before_residual", False) is not False:
        out.append("config.json norm_before_residual must be false (SGLang/EAGLE-3 layer)")
    return out + algorithms.export_problems(c)


def sglang_params(c: dict) -> dict[str, tuple]:
    """Parameter name -> shape of SGLang's LlamaForCausalLMEagle3 (TP 1) for this config."""
    h, i = c["hidden_size"], c["intermediate_size"]
    nh = c["num_attention_heads"]
    nkv = c.get("num_key_value_heads", nh)
    hd = c.get("head_dim", h // nh)
    ht = c.get("target_hidden_size", h)
    n_aux = len(c["eagle_config"]["eagle_aux_hidden_state_layer_ids"])
    p = "model.layers.0."
    return {
        "model.embed_tokens.weight": (c["vocab_size"], h),
        "model.fc.weight": (h, ht * n_aux),
        p + "self_attn.qkv_proj.weight": ((nh + 2 * nkv) * hd, 2 * h),
        p + "self_attn.o_proj.weight": (h, nh * hd),
        p + "mlp.gate_up_proj.weight": (2 * i, h),
        p + "mlp.down_proj.weight": (h, i),
        p + "input_layernorm.weight": (h,),
        p + "post_attention_layernorm.weight": (h,),
        p + "hidden_norm.weight": (h,),
        "model.norm.weight": (h,),
        "lm_head.weight": (c["draft_vocab_size"], h),
        **algorithms.of_export(c).extra_params(c),
    }


def _shard_rows(c: dict, shard_id) -> int:
    nh = c["num_attention_heads"]
    hd = c.get("head_dim", c["hidden_size"] // nh)
    return {
        "q": nh * hd,
        "k": c.get("num_key_value_heads", nh) * hd,
        "v": c.get("num_key_value_heads", nh) * hd,
    }.get(shard_id, c["intermediate_size"])


def sglang_destination(name: str, params: dict) -> tuple[str, object] | None:
    """Where SGLang's load_weights puts checkpoint tensor `name`: (param, shard id) or None."""
    for legacy, new in LEGACY.items():
        if legacy in name:
            name = name.replace(legacy, new)
    if "d2t" in name or "t2d" in name:
        return ("d2t" if "d2t" in name else "t2d"), None
    for param, shard, shard_id in STACKED:
        if shard in name:
            name = name.replace(shard, param)
            full = name if name in params else f"model.{name}"
            return (full, shard_id) if full in params else None
    full = name if name in params else f"model.{name}"
    return (full, None) if full in params else None


def check_tensors(c: dict, tensors: dict[str, tuple[tuple, str]]) -> list[str]:
    """Problems with {name: (shape, safetensors dtype tag)} against what SGLang consumes for config `c`."""
    params = sglang_params(c)
    problems, filled = [], {}
    for name, (shape, dtype) in sorted(tensors.items()):
        dest = sglang_destination(name, params)
        if dest is None:
            problems.append(f"tensor {name} {list(shape)}: SGLang's loader would skip it")
            continue
        param, shard_id = dest
        if param == "model.embed_tokens.weight":
            problems.append(f"tensor {name}: the draft must not carry embed_tokens (shared)")
            continue
        if param == "d2t":
            want, want_dtype = (c["draft_vocab_size"],), "I64"
        elif param == "t2d":
            want, want_dtype = (c["vocab_size"],), "BOOL"
        elif shard_id is None:
            want, want_dtype = params[param], None
        else:
            full = params[param]
            want, want_dtype = (_shard_rows(c, shard_id), full[1]), None
        if tuple(shape) != tuple(want):
            problems.append(f"tensor {name} is {list(shape)}, SGLang's {param} needs {list(want)}")
        if want_dtype and dtype != want_dtype:
            problems.append(f"tensor {name} is {dtype}, expected {want_dtype}")
        filled.setdefault(param, set()).add(shard_id)
    shards = {
        "model.layers.0.self_attn.qkv_proj.weight": {"q", "k", "v"},
        "model.layers.0.mlp.gate_up_proj.weight": {0, 1},
    }
    mapping = [] if full_vocab(c) else ["d2t", "t2d"]
    if full_vocab(c):
        problems += [
            f"tensor {k}: a full-vocabulary draft must not carry it (vLLM refuses d2t there)"
            for k in ("d2t", "t2d")
            if k in filled
        ]
    for param in [*params, *mapping]:
        if param == "model.embed_tokens.weight":
            continue
        need = shards.get(param, {None})
        missing = need - filled.get(param, set())
        if missing:
            problems.append(
                f"SGLang parameter {param} is not (fully) provided: {sorted(map(str, missing))}"
            )
    return problems


def check_export(out_dir: str | os.PathLike, metrics: str | os.PathLike | None = None) -> None:
    """Raise ExportError listing every way `out_dir` breaks SGLang's EAGLE-3 contract, or holds
    NaN or infinite weights, or (with `metrics`, when that file exists) comes from a training run
    whose metrics end non-finite."""
    out = Path(out_dir)
    cfg_path, w_path = out / "config.json", out / WEIGHTS
    for p in (cfg_path, w_path):
        if not p.is_file():
            raise ExportError(f"{p} is missing")
    c = json.loads(cfg_path.read_text())
    own = algorithms.part(algorithms.of_export(c), "EXPORTER")
    if own is not None:  # an algorithm with its own format (dflash)
        return own.check_export(out, metrics)
    problems = config_problems(c)
    if not problems:
        with safe_open(str(w_path), framework="pt") as f:
            tensors = {
                k: (tuple(f.get_slice(k).get_shape()), f.get_slice(k).get_dtype()) for k in f.keys()
            }
            problems = check_tensors(c, tensors)
            if not problems and not full_vocab(c):
                d2t, t2d = f.get_tensor("d2t"), f.get_tensor("t2d")
                hot = d2t + torch.arange(d2t.shape[0])
                if int(hot.min()) < 0 or int(hot.max()) >= c["vocab_size"]:
                    problems.append("d2t maps draft ids outside the target vocabulary")
                elif not bool(t2d[hot].all()) or int(t2d.sum()) != d2t.shape[0]:
                    problems.append("t2d is not true exactly at d2t[i] + i")
    if not problems and (out / "speculators").exists():
        if algorithms.of_export(c).SPECULATORS:
            problems = speculators_problems(out / "speculators", c)
        else:
            problems = [
                f"{out / 'speculators'}: a {algorithms.of_export(c).NAME} draft has no "
                "speculators copy (vLLM's speculators format would drop its keys)"
            ]
    if not problems:
        for w in (w_path, out / "speculators" / WEIGHTS):
            problems += [f"{w}: {b}" for b in (nonfinite_tensors(w) if w.is_file() else [])]
    if not problems and metrics is not None and Path(metrics).is_file():
        problem = metrics_problem(metrics)
        problems += [problem] if problem else []
    if problems:
        raise ExportError(f"{out}: not a valid SGLang EAGLE-3 draft:\n  " + "\n  ".join(problems))


def speculators_config(cfg: DraftConfig, verifier: dict, num_tokens: int) -> dict:
    """speculators "eagle3" config; its ids are input-of-layer (SGLang id + 1), as vLLM's.

    `verifier` is {"name_or_path", "architectures"}: a path relative to the directory the
    engines are started from (the project root), so the export stays valid when moved."""
    layer = sglang_config(cfg)
    for k in (
        "architectures",
        "eagle_config",
        "draft_vocab_size",
        "target_hidden_size",
        "eagle_aux_hidden_state_layer_ids",
        "norm_before_residual",
    ):
        layer.pop(k)
    return {
        "architectures": ["Eagle3Speculator"],
        "speculators_model_type": "eagle3",
        "transformer_layer_config": layer,
        "draft_vocab_size": cfg.draft_vocab_size,
        "target_hidden_size": cfg.target_hidden_size,
        "norm_before_residual": False,
        "eagle_aux_hidden_state_layer_ids": vllm_layer_ids(cfg.aux_layer_ids),
        "speculators_config": {
            "algorithm": "eagle3",
            "proposal_methods": [
                {
                    "proposal_type": "greedy",
                    "speculative_tokens": num_tokens,
                    "verifier_accept_k": 1,
                    "accept_tolerance": 0.0,
                }
            ],
            "default_proposal_method": "greedy",
            "verifier": {
                "name_or_path": verifier["name_or_path"],
                "architectures": list(verifier["architectures"]),
            },
        },
    }


def verifier_ref(target_dir: str | os.PathLike) -> dict:
    """The speculators `verifier` entry for a target directory: a path relative to the
    current directory (the workflow root) when the target lies below it, and its architectures."""
    target = Path(target_dir)
    rel = os.path.relpath(target.absolute())
    arch = json.loads((target / "config.json").read_text()).get("architectures") or []
    if not arch:
        raise ExportError(f"{target}/config.json has no architectures: speculators needs them")
    return {"name_or_path": str(target) if rel.startswith("..") else rel, "architectures": arch}


def target_embedding(target_dir: str | os.PathLike) -> torch.Tensor:
    """The target's input embedding exactly as stored: the text model's `embed_tokens.weight`,
    under whatever prefix a wrapped checkpoint puts it (draftsmith.layout)."""
    try:
        return read_pieces(target_dir, roles=("embed",))["embed"]
    except LayoutError as e:
        raise ExportError(str(e)) from None


def export_draft(
    draft: Eagle3Draft,
    out_dir,
    provenance: dict,
    *,
    embed: torch.Tensor,
    verifier: dict,
    num_tokens: int = 4,
    family: dict | None = None,
) -> None:
    """Write `out_dir` atomically (staging dir, fsync, rename) and contract-check it first.

    `embed` is the target's input embedding as stored (its dtype): the speculators copy carries
    it, because speculators' loader otherwise leaves the embedding uninitialized (zeros under
    transformers 5.x), and vLLM shares it with the target when it is bit-identical."""
    own = algorithms.part(algorithms.get(draft.config.algorithm), "EXPORTER")
    if own is not None:  # an algorithm with its own format (dflash)
        return own.export_draft(draft, out_dir, provenance, family=family)
    out = Path(out_dir)
    out.parent.mkdir(parents=True, exist_ok=True)
    stage = Path(tempfile.mkdtemp(prefix=f".tmp-{out.name}-", dir=out.parent))
    cfg = draft.config
    if tuple(embed.shape) != (cfg.vocab_size, cfg.target_hidden_size):
        raise ExportError(
            f"target embedding is {list(embed.shape)}, the draft needs "
            f"[{cfg.vocab_size}, {cfg.target_hidden_size}]"
        )
    try:
        state = {k: v.detach().to("cpu").contiguous() for k, v in draft.state_dict().items()}
        state = {k: (v.float() if v.is_floating_point() else v) for k, v in state.items()}
        if cfg.draft_vocab_size == cfg.vocab_size:
            state.pop("d2t"), state.pop("t2d")  # identity mapping; vLLM refuses a d2t here
        save_file(state, str(stage / WEIGHTS), metadata={"format": "pt"})
        atomic_write_json(stage / "config.json", sglang_config(cfg))
        spec = stage / "speculators"
        if algorithms.get(cfg.algorithm).SPECULATORS:
            spec.mkdir()
            renamed = {k.replace("midlayer.", "layers.0."): v for k, v in state.items()}
            renamed["embed_tokens.weight"] = embed.detach().to("cpu").contiguous()
            save_file(renamed, str(spec / WEIGHTS), metadata={"format": "pt"})
            atomic_write_json(spec / "config.json", speculators_config(cfg, verifier, num_tokens))
        facts = {"target_family": family} if family is not None else {}
        atomic_write_json(
            stage / PROVENANCE, {**provenance, "draft_config": cfg.to_dict(), **facts}
        )
        check_export(stage)
        for p in [*stage.iterdir(), *(spec.iterdir() if spec.is_dir() else ())]:
            if p.is_file():
                with open(p, "rb") as f:
                    os.fsync(f.fileno())
        os.chmod(stage, 0o755)
        if out.exists():
            shutil.rmtree(out)
        os.replace(stage, out)
        fsync_dir(out.parent)
    except BaseException:
        shutil.rmtree(stage, ignore_errors=True)
        raise


def speculators_problems(spec_dir: Path, c: dict) -> list[str]:
    """What is wrong with the speculators copy next to an SGLang config `c`."""
    cfg_path, w_path = spec_dir / "config.json", spec_dir / WEIGHTS
    if not (cfg_path.is_file() and w_path.is_file()):
        return [f"{spec_dir}: config.json or {WEIGHTS} is missing"]
    s = json.loads(cfg_path.read_text())
    ids = vllm_layer_ids(c["eagle_config"]["eagle_aux_hidden_state_layer_ids"])
    out = []
    if s.get("eagle_aux_hidden_state_layer_ids") != ids:
        out.append(
            f"{cfg_path}: eagle_aux_hidden_state_layer_ids {s.get('eagle_aux_hidden_state_layer_ids')}"
            f" != {ids} (SGLang ids + 1)"
        )
    if s.get("norm_before_residual") is not False:
        out.append(f"{cfg_path}: norm_before_residual must be false (vLLM defaults it to true)")
    ver = (s.get("speculators_config") or {}).get("verifier") or {}
    if not ver.get("architectures"):
        out.append(f"{cfg_path}: speculators_config.verifier.architectures is empty")
    with safe_open(str(w_path), framework="pt") as f:
        keys = set(f.keys())
        shape = (
            tuple(f.get_slice("embed_tokens.weight").get_shape())
            if "embed_tokens.weight" in keys
            else None
        )
    if shape != (c["vocab_size"], c.get("target_hidden_size", c["hidden_size"])):
        out.append(f"{w_path}: embed_tokens.weight is {shape}, speculators needs the target's")
    if any(k.startswith("midlayer.") for k in keys):
        out.append(f"{w_path}: midlayer.* names; speculators wants layers.0.*")
    return out


def load_export(out_dir) -> Eagle3Draft:
    """The exported draft back as an `Eagle3Draft` (contract-checked first)."""
    from safetensors.torch import load_file

    c = json.loads((Path(out_dir) / "config.json").read_text())
    own = algorithms.part(algorithms.of_export(c), "EXPORTER")
    if own is not None:  # an algorithm with its own format (dflash)
        return own.load_export(out_dir)
    check_export(out_dir)
    cfg = config_from_sglang(json.loads((Path(out_dir) / "config.json").read_text()))
    draft = Eagle3Draft(cfg)
    state = load_file(str(Path(out_dir) / WEIGHTS))
    if cfg.draft_vocab_size == cfg.vocab_size:
        state["d2t"] = torch.zeros(cfg.vocab_size, dtype=torch.long)
        state["t2d"] = torch.ones(cfg.vocab_size, dtype=torch.bool)
    draft.load_state_dict(state, strict=True)
    return draft.eval()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(
        prog="python -m draftsmith.export",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = ap.add_subparsers(dest="cmd", required=True)
    chk = sub.add_parser("check", help="contract-check an exported draft directory")
    chk.add_argument("draft_dir")
    chk.add_argument(
        "--strict",
        action="store_true",
        help="fail when a pinned engine cannot serve the draft's target as trained (the "
        "target_family.serving entries of draftsmith_draft.json); warn otherwise",
    )
    chk.add_argument(
        "--metrics",
        help="training metrics whose last record must be finite (default: "
        "<draft_dir>/../train/metrics.jsonl, the workflow's layout, when it exists)",
    )
    args = ap.parse_args(argv)
    if args.metrics and not Path(args.metrics).is_file():
        raise SystemExit(f"--metrics {args.metrics}: no such file")
    metrics = args.metrics or Path(args.draft_dir).resolve().parent / "train" / "metrics.jsonl"
    try:
        check_export(args.draft_dir, metrics)
    except ExportError as e:
        raise SystemExit(str(e)) from None
    prov = Path(args.draft_dir) / PROVENANCE
    family = json.loads(prov.read_text()).get("target_family") if prov.is_file() else None
    for w in (family or {}).get("warnings", []):
        print(f"{args.draft_dir}: warning: {w}", file=sys.stderr)
    if args.strict and family and family["serving"]:
        raise SystemExit(
            f"{args.draft_dir}: --strict: " + "; ".join(serving_problems(family["serving"]))
        )
    algo = algorithms.of_export(json.loads((Path(args.draft_dir) / "config.json").read_text()))
    arch = getattr(algo, "ARCH", f"SGLang {ARCH}")
    print(f"{args.draft_dir}: OK ({arch} contract, {algo.NAME})")


if __name__ == "__main__":
    main()
