"""EAGLE-3's exporter (EAGLE-3 and EAGLE-3.1 name it): SGLang's checkpoint contract, plus a
speculators/vLLM copy.

`results/draft/`:
    config.json          LlamaForCausalLMEagle3 config, read by SGLang and by vLLM
    model.safetensors    fc, midlayer.*, norm, lm_head, d2t, t2d (fp32; no embed_tokens)
    speculators/         the same weights as layers.0.* plus the target's embed_tokens, with a
                         speculators "eagle3" config (speculators' own loader; also vLLM)
    draftsmith_draft.json provenance (training config, shard checksums, versions)

The config.json and tensor contract itself (what SGLang's loader consumes, how both engines
number the aux layers) is draftsmith.algorithms.eagle3.contract (contract_mla for the MLA
draft); `check_export` applies it to the files and adds what needs them: non-finite weights,
the layers each engine would feed the draft for the target's model class
(draftsmith.targets.layerids, from the provenance), the speculators copy.

Every function is given the algorithm's spec (`spec`, resolved once by the caller: the
dispatcher draftsmith.algorithms.export): what it refuses in a config.json, whether a
speculators copy is written, the switches a config read back carries.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

import draftsmith.algorithms.eagle3.contract as draft_contract
import draftsmith.algorithms.eagle3.contract_mla as draft_contract_mla
from draftsmith.algorithms.artifact import (
    PROVENANCE,
    WEIGHTS,
    ExportError,
    read_config,
    read_provenance,
)
from draftsmith.algorithms.eagle3.contract import full_vocab, sglang_config, vllm_layer_ids
from draftsmith.algorithms.eagle3.model import DraftConfig, Eagle3Draft
from draftsmith.algorithms.spec import AlgorithmSpec, foreign_problems
from draftsmith.runtime.files import atomic_dir, atomic_write_json
from draftsmith.runtime.finite import metrics_problem, nonfinite_tensors
from draftsmith.targets import layerids


def contract(c):
    """The config/tensor contract module of a DraftConfig or an exported config.json: the MLA
    draft's (draftsmith.algorithms.eagle3.contract_mla) or the Llama draft's (.contract)."""
    if isinstance(c, DraftConfig):
        mla = c.attention == "mla"
    else:
        mla = draft_contract_mla.is_mla(c)
    return draft_contract_mla if mla else draft_contract


def arch(c: dict) -> str:
    """The architecture config.json `c` is written for, in words."""
    return f"SGLang {contract(c).ARCH}"


def config_problems(c: dict, spec: AlgorithmSpec) -> list[str]:
    """What is wrong with config.json `c`: the contract's keys, FOREIGN keys, and what the
    algorithm `spec` refuses (EAGLE-3.1's switches in an EAGLE-3 draft, or missing)."""
    return contract(c).config_problems(c) + foreign_problems(c) + spec.config_problems(c)


def layer_ids(c: dict) -> dict:
    """The draft's aux ids (SGLang numbering, eagle_config's) and vLLM's (the top-level key it
    reads first) in config.json `c`."""
    return {
        "aux_layer_ids": c["eagle_config"]["eagle_aux_hidden_state_layer_ids"],
        "vllm_aux_layer_ids": c.get("eagle_aux_hidden_state_layer_ids"),
    }


def family_layer_ids(full: dict, cfg: DraftConfig, facts: dict) -> dict:
    """`facts` (the target family's, for the provenance) with the layer ids each engine feeds
    the draft for the target's model class (draftsmith.targets.layerids)."""
    view = layerids.target_view(full)
    facts["layer_ids"] = {
        "target": view,
        **layerids.resolve(contract(cfg).sglang_config(cfg), view),
    }
    refused = {f["engine"] for f in facts["serving"] if f["verdict"] == "refuse"}
    if not facts["layer_ids"]["sglang_known"] and "sglang" not in refused:
        klass = view["architectures"][0] if view["architectures"] else "(config.json names none)"
        facts["warnings"].append(
            f"layer ids: class {klass} is not in draftsmith.targets.layerids' table of SGLang "
            "0.5.23's EAGLE-3 captures: which layers SGLang feeds the draft was not checked"
        )
    return facts


def check_export(out_dir, metrics=None, *, spec: AlgorithmSpec) -> None:
    """Raise ExportError listing every way `out_dir` breaks SGLang's EAGLE-3 contract, or holds
    NaN or infinite weights, or (with `metrics`, when that file exists) comes from a training run
    whose metrics end non-finite."""
    out = Path(out_dir)
    w_path = out / WEIGHTS
    c = read_config(out / "config.json")
    problems = config_problems(c, spec)
    if not problems:
        problems = tensor_problems(c, w_path)
    if not problems and (out / PROVENANCE).is_file():  # the layers each engine feeds
        family = read_provenance(out).get("target_family") or {}
        view = (family.get("layer_ids") or {}).get("target")
        problems = layerids.problems(c, view) if view else []
    if not problems and (out / "speculators").exists():
        if spec.speculators and contract(c).SPECULATORS:
            problems = speculators_problems(out / "speculators", c)
        else:
            problems = [
                f"{out / 'speculators'}: a {spec.name} {contract(c).ARCH} draft "
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


def tensor_problems(c: dict, w_path: Path) -> list[str]:
    """The tensors of `w_path` against config.json `c`: names and shapes, d2t and t2d."""
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
    return problems


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


def export_draft(
    draft: Eagle3Draft,
    out_dir: str | os.PathLike,
    provenance: dict,
    *,
    spec: AlgorithmSpec,
    embed: torch.Tensor,
    verifier: dict,
    num_tokens: int = 4,
    family: dict | None = None,
) -> None:
    """Write `out_dir` atomically (staging dir, fsync, rename) and contract-check it first.

    `embed` is the target's input embedding as stored (its dtype): the speculators copy carries
    it, because speculators' loader otherwise leaves the embedding uninitialized (zeros under
    transformers 5.x), and vLLM shares it with the target when it is bit-identical."""
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
        if spec.speculators and contract(cfg).SPECULATORS:
            spec_dir = stage / "speculators"
            spec_dir.mkdir()
            renamed = {k.replace("midlayer.", "layers.0."): v for k, v in state.items()}
            renamed["embed_tokens.weight"] = embed.detach().to("cpu").contiguous()
            save_file(renamed, str(spec_dir / WEIGHTS), metadata={"format": "pt"})
            atomic_write_json(
                spec_dir / "config.json", speculators_config(cfg, verifier, num_tokens)
            )
        facts = {"target_family": family} if family is not None else {}
        atomic_write_json(
            stage / PROVENANCE, {**provenance, "draft_config": cfg.to_dict(), **facts}
        )
        check_export(stage, spec=spec)


def speculators_problems(spec_dir: Path, c: dict) -> list[str]:
    """What is wrong with the speculators copy next to an SGLang config `c`."""
    cfg_path, w_path = spec_dir / "config.json", spec_dir / WEIGHTS
    if not (cfg_path.is_file() and w_path.is_file()):
        return [f"{spec_dir}: config.json or {WEIGHTS} is missing"]
    s = read_config(cfg_path)
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


def load_export(out_dir, *, spec: AlgorithmSpec) -> Eagle3Draft:
    """The exported draft back as an `Eagle3Draft` of algorithm `spec` (checked first)."""
    from safetensors.torch import load_file

    check_export(out_dir, spec=spec)
    c = read_config(Path(out_dir) / "config.json")
    cfg = contract(c).config_from_sglang(c, spec)
    draft = Eagle3Draft(cfg)
    state = load_file(str(Path(out_dir) / WEIGHTS))
    if cfg.draft_vocab_size == cfg.vocab_size:
        state["d2t"] = torch.zeros(cfg.vocab_size, dtype=torch.long)
        state["t2d"] = torch.ones(cfg.vocab_size, dtype=torch.bool)
    draft.load_state_dict(state, strict=True)
    return draft.eval()
