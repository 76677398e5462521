"""What the rules ask of a validated config, as plain functions (rules/common.smk wraps each in
a one-line helper of the same name): the role and interpreter of a stage, the GPUs its jobs
take, the run settings jobs get outside params, and the server settings that are params.

Every function takes the config (validated, defaults filled) and never changes it.
"""

from __future__ import annotations

import sys

from draftsmith.config.engines import NEEDS, needs

STAGES = ("regenerate", "capture", "train", "bench")


def role_of(config: dict, stage: str) -> str:
    """The role whose interpreter runs a stage's jobs (env, target and data run on cpu)."""
    return "cpu" if stage in ("env", "target", "data") else config[stage]["role"]


def role_python(config: dict, role: str, conda: bool = False) -> str:
    """The interpreter a role's commands run with (validated by validate_env): `python` under
    --sdm conda, this one for "", the workflow's venv for "venv", else the path given."""
    python = config["envs"].get(role, {}).get("python", "")
    if conda:
        return "python"
    if python == "":
        return sys.executable
    if python == "venv":
        return f"results/venv/{role}/bin/python"
    return python


def role_gpus(config: dict, role: str) -> int:
    """GPUs the role's interpreter must see (envs.<role>.gpus); 0 = a CPU role."""
    return int(config["envs"].get(role, {}).get("gpus", 0))


def engine_needs(config: dict, stage: str) -> dict:
    """What the workflow needs from the stage's engine (its WORKFLOW declaration); the
    defaults for a stage without a backend (train)."""
    backend = config[stage].get("backend")
    return needs(backend) if backend else dict(NEEDS)


def engine_gpus(config: dict, stage: str) -> int:
    """GPUs one job of the stage's engine takes on a GPU role: its WORKFLOW's number, or the
    config key it names (a server's tensor-parallel size)."""
    gpus = engine_needs(config, stage)["gpus"]
    if isinstance(gpus, str):
        section, key = gpus.split(".")
        return int(config[section][key])
    return int(gpus)


def stage_gpus(config: dict, stage: str) -> int:
    """GPUs one job of the stage uses (what it asks SLURM for): none on a CPU role; on a GPU
    role train.nproc per node (train), else what the stage's engine declares."""
    if role_gpus(config, role_of(config, stage)) == 0:
        return 0
    if stage == "train":
        return int(config["train"]["nproc"])
    return engine_gpus(config, stage)


def range_threads(config: dict, stage: str) -> int:
    """Threads of one range job of `stage` (regenerate, capture): 1 (two jobs side by side on
    2 cores measured faster than one of 2 threads, benchmarks/bench_job_threads.py), or on a CPU
    role the engine's tensor-parallel size, one core per rank of its server."""
    if role_gpus(config, role_of(config, stage)) > 0:
        return 1
    return max(1, engine_gpus(config, stage))


def range_priority(config: dict, stage: str) -> int:
    """Snakemake priority of a range job: regeneration's first (1) where its engine's server
    holds GPUs, so that the stage's jobs run before the capture jobs that would stop its idle
    server (draftsmith.runtime.serverhosts) and one load serves the stage; else 0."""
    if stage != "regenerate" or role_gpus(config, role_of(config, stage)) == 0:
        return 0
    return int(engine_needs(config, stage)["settings"] is not None)


def gpu_resources(config: dict, stage: str) -> dict:
    """The GPU part of a rule's resources: {} on CPU, else gpu=N (train: gres, per node)."""
    n = stage_gpus(config, stage)
    if n == 0:
        return {}
    if stage == "train":  # per node: a multi-node job gets train.nproc GPUs on each
        return {"gres": f"gpu:{n}"}
    return {"gpu": n}


def gpu_roles(config: dict, roles) -> list[str]:
    return [r for r in roles if role_gpus(config, r) > 0]


def gpu_layout(config: dict, roles) -> str | None:
    """The GPUs each GPU stage's job takes and why, for the parse-time print; None on CPU."""
    with_gpus = gpu_roles(config, roles)
    if not with_gpus:
        return None
    stages = ["regenerate"] if config["regenerate"]["enabled"] else []
    parts = []
    for stage in [*stages, "capture", "train", "bench"]:
        n, role = stage_gpus(config, stage), role_of(config, stage)
        if n == 0:
            how = "CPU"
        elif stage == "train":
            how = f"{n} training process{'es' if n > 1 else ''} per node, train.nproc"
        else:
            how = engine_needs(config, stage)["gpus_why"].format(n=n)
        parts.append(f"{stage} {n} ({role}: {how})")
    node = ", ".join(f"envs.{r}.gpus {role_gpus(config, r)}" for r in with_gpus)
    return (
        f"GPU layout, GPUs per job: {'; '.join(parts)}; per node: {node} (jobs whose GPUs "
        "fill the node run one at a time)"
    )


def run_settings(config: dict, run_keys: dict) -> dict:
    """The settings that change no result (the schema's x-execution keys), as jobs get them in
    DRAFTSMITH_RUN. An engine's `shared_server: auto` is resolved here: `run` (one server per
    stage for the range jobs of a run; a server holding GPUs is stopped before other GPU work,
    draftsmith.runtime.serverhosts)."""
    out = {s: {k: config[s][k] for k in keys} for s, keys in run_keys.items()}
    for section, keys in out.items():
        if keys.get("shared_server") == "auto":
            out[section] = {**keys, "shared_server": "run"}
    return out


def server_cfg(config: dict, stage: str, run_keys: dict) -> dict:
    """The result-relevant settings of the stage's engine (its WORKFLOW's settings section,
    without the x-execution keys) and the target's dtype and remote-code permission; {} for an
    engine without a settings section."""
    section = engine_needs(config, stage)["settings"]
    if section is None:
        return {}
    run = run_keys.get(section, ())
    keep = {k: v for k, v in config[section].items() if k not in run}
    target = {k: config["target"][k] for k in ("dtype", "trust_remote_code")}
    return {section: keep, "target": target}


def remote_code_cfg(config: dict) -> dict:
    """{"target": {"trust_remote_code": true}} when the config allows the target's code."""
    return {"target": {"trust_remote_code": True}} if config["target"]["trust_remote_code"] else {}


def set_away(config: dict, neutral: dict, section: str, *keys: str) -> tuple[str, ...]:
    """Those of `keys` (x-omit-default) set away from their default: a job's params name them
    only then, so the default's params stay as they were."""
    return tuple(k for k in keys if config[section][k] != neutral[section][k])


def params_config(config: dict, target_cfg: dict | None, first_is_one: bool = False) -> dict:
    """The config as params see it: a setting written out as what its `auto` resolves to is
    `auto` there, so spelling out the chosen value plans nothing new (capture.aux_layer_ids on
    a target whose config.json is readable; train.precision bf16 on a GPU train role).
    `target_cfg`: the target's config.json, None where it is not readable at parse time (the
    embedded target before conversion); `first_is_one`: its class needs ids starting at 1
    (draftsmith.targets.layerids.first_is_one, which the Snakefile passes). The config is not
    changed; a changed copy is returned (the config itself when nothing is spelled out)."""
    out = config
    if aux_ids_are_auto(config, target_cfg, first_is_one):
        out = {**out, "capture": {**out["capture"], "aux_layer_ids": "auto"}}
    if precision_is_auto(config):
        out = {**out, "train": {**out["train"], "precision": "auto"}}
    return out


def aux_ids_are_auto(config: dict, target_cfg: dict | None, first_is_one: bool) -> bool:
    """Whether capture.aux_layer_ids is a list equal to what `auto` resolves to on the target."""
    from draftsmith.config.checks import aux_layer_ids

    ids = config["capture"]["aux_layer_ids"]
    if target_cfg is None or ids == "auto":
        return False
    cfg = target_cfg.get("text_config", target_cfg)
    try:
        auto = aux_layer_ids("auto", int(cfg["num_hidden_layers"]), first_is_one)
    except (KeyError, ValueError):
        return False
    return [int(i) for i in ids] == auto


def precision_is_auto(config: dict) -> bool:
    """Whether train.precision is what `auto` is certain to resolve to at parse time: bf16 on a
    GPU train role (draftsmith.runtime.hardware.resolve_precision). On a CPU role auto is the
    training machine's timed probe, unknown here; the run key then holds the resolved precision
    only (draftsmith.train.data.run_key), so the rerun resumes the finished run."""
    train = config["train"]
    return train["precision"] == "bf16" and role_gpus(config, role_of(config, "train")) > 0
