"""Export the draft in SGLang's EAGLE-3 checkpoint contract, plus a speculators/vLLM copy.

`results/draft/`:
    config.json          LlamaForCausalLMEagle3 config, read by SGLang and by vLLM
    model.safetensors    fc, midlayer.*, norm, lm_head, d2t, t2d (fp32; no embed_tokens)
    speculators/         the same weights as layers.0.* plus the target's embed_tokens, with a
                         speculators "eagle3" config (speculators' own loader; also vLLM)
    draftsmith_draft.json provenance (training config, shard checksums, versions)

The config.json and tensor contract itself (what SGLang's loader consumes, how both engines
number the aux layers) is draftsmith.algorithms.eagle3.contract; `check_export` applies it to the files and
adds what needs them: non-finite weights, the layers each engine would feed the draft for the
target's model class (draftsmith.targets.layerids, from the provenance), the speculators copy.

What differs per draft algorithm (draftsmith.algorithms: the config keys and tensors it adds,
what it refuses, whether a speculators copy is written) comes from the algorithm's module; the
algorithm of an exported config.json is told from its keys (`algorithms.of_export`).

CLI: `python -m draftsmith export check results/draft`.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from draftsmith import algorithms
from draftsmith.algorithms.eagle3 import contract as draft_contract
from draftsmith.algorithms.eagle3 import contract_mla as draft_contract_mla
from draftsmith.algorithms.eagle3.contract import full_vocab, sglang_config, vllm_layer_ids
from draftsmith.algorithms.eagle3.model import DraftConfig, Eagle3Draft
from draftsmith.runtime.files import atomic_dir, atomic_write_json
from draftsmith.runtime.finite import metrics_problem, nonfinite_tensors
from draftsmith.targets import layerids, serving
from draftsmith.targets.families import family_facts
from draftsmith.targets.layout import LayoutError, read_pieces

WEIGHTS = "model.safetensors"
PROVENANCE = "draftsmith_draft.json"


log = logging.getLogger("draftsmith.algorithms.export")


class ExportError(ValueError):
    """The exported draft is not what SGLang's loader will consume."""


def contract(c):
    """The config/tensor contract module of a DraftConfig or an exported config.json: the MLA
    draft's (draftsmith.algorithms.eagle3.contract_mla) or the Llama draft's (draftsmith.algorithms.eagle3.contract)."""
    if isinstance(c, DraftConfig):
        mla = c.attention == "mla"
    else:
        mla = draft_contract_mla.is_mla(c)
    return draft_contract_mla if mla else draft_contract


def read_provenance(draft_dir) -> dict:
    """The draft's provenance (PROVENANCE beside its weights), or {} for a draft without one."""
    path = Path(draft_dir) / PROVENANCE
    return json.loads(path.read_text()) if path.is_file() else {}


def target_family(target_dir, cfg: DraftConfig, trained_length: int) -> dict:
    """The target family's facts for the provenance (`draftsmith.targets.families.family_facts`), read
    from the target's whole config.json (a multimodal wrapper's own model type included)."""
    full = json.loads((Path(target_dir) / "config.json").read_text())
    facts = family_facts(full, cfg.rope_scaling, trained_length)
    facts["serving"] = serving.findings(full)
    facts["warnings"] += serving.warnings(facts["serving"])
    if not isinstance(cfg, DraftConfig):  # an algorithm with its own export checks its ids
        return facts
    view = layerids.target_view(full)
    facts["layer_ids"] = {
        "target": view,
        **layerids.resolve(contract(cfg).sglang_config(cfg), view),
    }
    refused = {f["engine"] for f in facts["serving"] if f["verdict"] == "refuse"}
    if not facts["layer_ids"]["sglang_known"] and "sglang" not in refused:
        klass = view["architectures"][0] if view["architectures"] else "(config.json names none)"
        facts["warnings"].append(
            f"layer ids: class {klass} is not in draftsmith.targets.layerids' table of SGLang 0.5.23's "
            "EAGLE-3 captures: which layers SGLang feeds the draft was not checked"
        )
    return facts


def serve_gate(target_dir, mode: str, ids: list[int] | None = None) -> None:
    """draft.serve_check strict: refuse, before training, a target an engine of the pinned
    wheels cannot serve an EAGLE-3 draft for (or serves with other aux states). Aux layer ids
    (`ids`, SGLang numbering) that an engine would read as other layers are refused whatever
    the mode (draftsmith.targets.layerids): the export would refuse them after training."""
    full = json.loads((Path(target_dir) / "config.json").read_text())
    if ids is not None:
        bad = layerids.setting_problems(full, list(ids))
        if bad:
            raise ExportError(
                f"{target_dir}: a pinned engine would feed the draft other layers than "
                "training uses:\n  " + "\n  ".join(bad)
            )
    problems = serving.problems(serving.findings(full))
    if problems and mode == "strict":
        raise ExportError(
            f"{target_dir}: draft.serve_check is strict and a pinned engine cannot serve this "
            "target's EAGLE-3 draft as trained:\n  " + "\n  ".join(problems)
        )


def say_family(where, facts: dict) -> None:
    """The family warnings on stderr (the job's log): RoPE not carried, serving per engine."""
    for w in facts["warnings"]:
        log.warning("%s: %s", where, w)


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
    own = algorithms.part(algorithms.of_export(c), "exporter")
    if own is not None:  # an algorithm with its own format (dflash)
        return own.check_export(out, metrics)
    problems = contract(c).config_problems(c)
    if not problems:
        with safe_open(str(w_path), framework="pt") as f:
            tensors = {
                k: (tuple(f.get_slice(k).get_shape()), f.get_slice(k).get_dtype()) for k in f.keys()
            }
            problems = contract(c).check_tensors(c, tensors)
            if not problems and not full_vocab(c):
                d2t, t2d = f.get_tensor("d2t"), f.get_tensor("t2d")
                hot = d2t + torch.arange(d2t.shape[0])
                if int(hot.min()) < 0 or int(hot.max()) >= c["vocab_size"]:
                    problems.append("d2t maps draft ids outside the target vocabulary")
                elif not bool(t2d[hot].all()) or int(t2d.sum()) != d2t.shape[0]:
                    problems.append("t2d is not true exactly at d2t[i] + i")
    if not problems and (out / PROVENANCE).is_file():  # the layers each engine feeds
        family = read_provenance(out).get("target_family") or {}
        view = (family.get("layer_ids") or {}).get("target")
        problems = layerids.problems(c, view) if view else []
    if not problems and (out / "speculators").exists():
        if algorithms.of_export(c).speculators and contract(c).SPECULATORS:
            problems = speculators_problems(out / "speculators", c)
        else:
            problems = [
                f"{out / 'speculators'}: a {algorithms.of_export(c).name} {contract(c).ARCH} draft "
                "has no speculators copy (speculators' format would drop its keys or layer)"
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
    under whatever prefix a wrapped checkpoint puts it (draftsmith.targets.layout)."""
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
    own = algorithms.part(algorithms.get(draft.config.algorithm), "exporter")
    if own is not None:  # an algorithm with its own format (dflash)
        return own.export_draft(draft, out_dir, provenance, family=family)
    cfg = draft.config
    if tuple(embed.shape) != (cfg.vocab_size, cfg.target_hidden_size):
        raise ExportError(
            f"target embedding is {list(embed.shape)}, the draft needs "
            f"[{cfg.vocab_size}, {cfg.target_hidden_size}]"
        )
    with atomic_dir(out_dir) as stage:
        state = {k: v.detach().to("cpu").contiguous() for k, v in draft.state_dict().items()}
        state = {k: (v.float() if v.is_floating_point() else v) for k, v in state.items()}
        if cfg.draft_vocab_size == cfg.vocab_size:
            state.pop("d2t"), state.pop("t2d")  # identity mapping; vLLM refuses a d2t here
        save_file(state, str(stage / WEIGHTS), metadata={"format": "pt"})
        atomic_write_json(stage / "config.json", contract(cfg).sglang_config(cfg))
        if algorithms.get(cfg.algorithm).speculators and contract(cfg).SPECULATORS:
            spec = stage / "speculators"
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

    path = Path(out_dir) / "config.json"
    try:
        c = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ExportError(f"{path}: not a readable draft config ({e})") from None
    own = algorithms.part(algorithms.of_export(c), "exporter")
    if own is not None:  # an algorithm with its own format (dflash)
        return own.load_export(out_dir)
    check_export(out_dir)
    cfg = contract(c).config_from_sglang(c)
    draft = Eagle3Draft(cfg)
    state = load_file(str(Path(out_dir) / WEIGHTS))
    if cfg.draft_vocab_size == cfg.vocab_size:
        state["d2t"] = torch.zeros(cfg.vocab_size, dtype=torch.long)
        state["t2d"] = torch.ones(cfg.vocab_size, dtype=torch.bool)
    draft.load_state_dict(state, strict=True)
    return draft.eval()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(
        prog="python -m draftsmith export",
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
    family = read_provenance(args.draft_dir).get("target_family") or {}
    for w in family.get("warnings", []):
        print(f"{args.draft_dir}: warning: {w}", file=sys.stderr)
    bad = serving.problems(family.get("serving", []))
    if args.strict and bad:
        raise SystemExit(f"{args.draft_dir}: --strict: " + "; ".join(bad))
    c = json.loads((Path(args.draft_dir) / "config.json").read_text())
    algo = algorithms.of_export(c)
    arch = algo.arch or f"SGLang {contract(c).ARCH}"
    print(f"{args.draft_dir}: OK ({arch} contract, {algo.name})")
