"""Config preparation, row ranges and config-derived values shared by the Snakefile and the package.

Pure standard library: imported by the Snakefile at DAG-build time. The Snakefile calls
`coerce(config, schema)` before schema validation (Snakemake passes nested `--config` values
as strings), then `check_config(config)` for the rules that span sections.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

RANGE_RE = re.compile(r"^rows_(\d{6})-(\d{6})$")


def range_name(a: int, b: int) -> str:
    return f"rows_{a:06d}-{b:06d}"


def row_ranges(n_rows: int, rows_per_shard: int) -> list[str]:
    """Half-open, zero-padded ranges covering [0, n_rows)."""
    if rows_per_shard < 1:
        raise ValueError(f"data.rows_per_shard must be >= 1, got {rows_per_shard}")
    return [
        range_name(a, min(a + rows_per_shard, n_rows)) for a in range(0, n_rows, rows_per_shard)
    ]


def parse_range(name: str) -> tuple[int, int]:
    m = RANGE_RE.match(name)
    if not m:
        raise ValueError(f"not a row range name: {name!r} (expected rows_AAAAAA-BBBBBB)")
    a, b = int(m.group(1)), int(m.group(2))
    if b <= a:
        raise ValueError(f"empty or reversed row range: {name!r}")
    return a, b


AUTO_AUX = 3  # EAGLE-3's count, and SGLang's and vLLM's when a draft config names no ids


def aux_layer_count(setting) -> int:
    """Aux states per token that capture.aux_layer_ids `setting` asks for (auto: three, an
    upper bound: a 4-layer target of a class that needs a first id of 1 gets two)."""
    return AUTO_AUX if setting == "auto" else len(setting)


def aux_layer_ids(setting, num_layers: int, first_is_one: bool = False) -> list[int]:
    """SGLang's "output of layer i" ids of the aux states: K distinct ids < N - 1.

    Any K >= 1 trains and serves: both engines size the draft's fc from the count of ids in its
    config (EAGLE-3's three are the default; DFlash recipes use more, e.g. five). `auto` is
    SGLang's default [1, N//2-1, N-4] when those are three increasing ids (N >= 7); for
    4 <= N <= 6 they collide (N = 4 gives [1, 1, 0]), so `auto` spreads the ids instead:
    [0, (N-1)//2, N-2]. `first_is_one`: the target's class is one whose SGLang model file adds
    1 to the ids only when the first is 1 (DeepSeek-V2/V3, Kimi-K2.5's language model, ...:
    draftsmith.targets.layerids.first_is_one); `auto` then always starts at 1, so that every
    engine reads its ids as the layers training stored: [1, (N-1)//2, N-2] for N = 5, 6, and
    [1, 2] for N = 4 (no three such ids fit below the last layer). The last layer (N - 1) is
    never used: transformers exposes its output only after the final norm, so the benchmark
    could not read the state the capture stored. The exported draft records the ids it was
    trained with (eagle_aux_hidden_state_layer_ids).
    """
    if setting == "auto":
        if num_layers < 4:
            raise ValueError(
                f"capture.aux_layer_ids auto: the target has {num_layers} layers; EAGLE-3 "
                f"needs three distinct aux layers below the last, so at least 4 layers"
            )
        ids = [1, num_layers // 2 - 1, num_layers - 4]
        if not ids[0] < ids[1] < ids[2]:
            ids = [int(first_is_one), (num_layers - 1) // 2, num_layers - 2]
        return sorted(set(ids))
    ids = [int(i) for i in setting]
    if not ids:
        raise ValueError("capture.aux_layer_ids is empty: give at least one layer id, or auto")
    bad = [i for i in ids if not 0 <= i < num_layers - 1]
    if bad:
        raise ValueError(
            f"capture.aux_layer_ids {ids}: ids {bad} are outside [0, {num_layers - 1}) for a "
            f"target with {num_layers} layers (the last layer's raw output is not available)"
        )
    if len(set(ids)) != len(ids):
        raise ValueError(f"capture.aux_layer_ids {ids}: the ids must be distinct")
    return ids


def check_aux_layer_ids(setting, num_layers: int, first_is_one: bool, where: str) -> None:
    """Refuse capture.aux_layer_ids `setting` at parse time for a target of `num_layers` layers
    (`where` says whose count it is): ConfigError naming the key and the value."""
    try:
        aux_layer_ids(setting, num_layers, first_is_one)
    except ValueError as e:
        raise ConfigError(f"config: {e} ({where})") from None


def check_range(name: str, ranges: list[str], n_rows: int, rows_per_shard: int) -> None:
    """Raise ValueError unless `name` is one of the configured `ranges`; the message lists them."""
    if name in ranges:
        return
    shown = ranges if len(ranges) <= 6 else [*ranges[:3], "...", *ranges[-2:]]
    valid = (
        f"the {len(ranges)} configured ranges ({n_rows} training rows, data.rows_per_shard "
        f"{rows_per_shard}) are: {', '.join(shown)}"
    )
    try:
        a, b = parse_range(name)
    except ValueError as e:
        raise ValueError(f"{e}; {valid}") from None
    if b > n_rows:
        raise ValueError(
            f"row range {name} is past the end of the training rows [0, {n_rows}) "
            f"(data.sources minus data.heldout_rows); {valid}"
        )
    raise ValueError(f"row range {name} is not a configured range; {valid}")


# ---------------------------------------------------------------- config preparation


class ConfigError(ValueError):
    """A config value that cannot be used; the message names the key."""


_TRUE, _FALSE = ("true", "yes", "on"), ("false", "no", "off")


def _coerce_scalar(value: str, kind: str, where: str):
    text = value.strip()
    if kind == "boolean":
        if text.lower() in _TRUE:
            return True
        if text.lower() in _FALSE:
            return False
        raise ConfigError(f"config validation failed: {where} = {value!r} is not true or false")
    try:
        number = float(text)
    except ValueError:
        number = math.nan
    if not math.isfinite(number):
        noun = "an integer" if kind == "integer" else "a number"
        raise ConfigError(f"config validation failed: {where} = {value!r} is not {noun}")
    if kind == "number":
        return number
    if not number.is_integer():
        raise ConfigError(f"config validation failed: {where} = {value!r} is not an integer")
    return int(number)


def _fits(value, schema: dict) -> bool:
    """Whether a string `value` is already acceptable to a string-typed `schema`."""
    return schema.get("type") == "string" and value in schema.get("enum", [value])


def coerce(value, schema: dict, where: str = "config"):
    """`value` with strings turned into the integers, numbers and booleans `schema` asks for.

    Snakemake's `--config key={...}` hands nested values over as strings (YAML's BaseLoader),
    so `train={"lr": 0.002}` arrives as {"lr": "0.002"}. Values that already have a type are
    left for schema validation; a string that is not a number where one is required is a
    ConfigError naming the key. Returns a new value; the input is not changed.
    """
    if "oneOf" in schema:
        if isinstance(value, str) and any(_fits(value, s) for s in schema["oneOf"]):
            return value
        shape = {list: "array", dict: "object"}.get(type(value))
        for option in schema["oneOf"]:
            if shape is not None and option.get("type") != shape:
                continue
            try:
                return coerce(value, option, where)
            except ConfigError:
                continue
        return value
    kind = schema.get("type")
    if isinstance(value, str) and kind in ("integer", "number", "boolean"):
        return _coerce_scalar(value, kind, where)
    if isinstance(value, dict) and kind in ("object", None):
        props = schema.get("properties", {})
        extra = schema.get("additionalProperties")
        out = {}
        for key, item in value.items():
            sub = props.get(key, extra if isinstance(extra, dict) else None)
            out[key] = item if sub is None else coerce(item, sub, f"{where}.{key}")
        return out
    if isinstance(value, list) and isinstance(schema.get("items"), dict):
        return [coerce(v, schema["items"], f"{where}[{i}]") for i, v in enumerate(value)]
    return value


def check_finite(config: dict) -> None:
    """Refuse NaN and infinite numbers anywhere in the config (YAML's `.inf`, `.nan`): JSON-schema
    bounds let them through (`.inf` > 0, and every comparison with NaN is false). The Snakefile
    calls it before schema validation, so the message names the key whatever its bounds."""
    from draftsmith.runtime.finite import nonfinite_keys

    bad = nonfinite_keys(config)
    if bad:
        raise ConfigError(
            f"config validation failed: {'; '.join(bad)}: not a finite number (YAML's .inf and "
            ".nan are not accepted anywhere)"
        )


def check_config(config: dict) -> None:
    """Rules that span keys, checked at parse time after schema validation (defaults filled).

    (target.path is checked by `draftsmith.targets.model.source_signature`, also at parse time.)
    """
    check_finite(config)
    data, bench = config["data"], config["bench"]
    if bench["heldout_size"] > data["heldout_rows"]:
        raise ConfigError(
            f"config: bench.heldout_size = {bench['heldout_size']} is larger than "
            f"data.heldout_rows = {data['heldout_rows']}: the benchmark can only use rows held "
            f"out of training; raise data.heldout_rows or lower bench.heldout_size"
        )
    if bench["temperature"] > 0 and not honours(bench["backend"], "bench.temperature"):
        raise ConfigError(
            f"config: bench.temperature = {bench['temperature']} samples, which only the "
            f"{engines_text('bench.temperature', ' and ')} engine benchmarks so far; the "
            f"{bench['backend']} engine benchmarks greedy: set bench.temperature 0 or "
            f"bench.backend {engines_text('bench.temperature', ' or ')}"
        )
    levels = concurrency_levels(bench["concurrency"])
    if levels != [1] and not honours(bench["backend"], "bench.concurrency"):
        raise ConfigError(
            f"config: bench.concurrency = {bench['concurrency']}: the {bench['backend']} engine "
            "runs one request at a time; concurrency levels are run by the "
            f"{engines_text('bench.concurrency', ' and ')} engines: set bench.concurrency 1"
        )
    if bench["workers"] not in ("auto", 1) and not honours(bench["backend"], "bench.workers"):
        raise ConfigError(
            f"config: bench.workers = {bench['workers']}: only the "
            f"{engines_text('bench.workers', ' and ')} engine shares the prompts between "
            f"processes; the {bench['backend']} engine serves them: leave bench.workers auto"
        )
    if bench["top_p"] < 1 and bench["temperature"] == 0:
        raise ConfigError(
            f"config: bench.top_p = {bench['top_p']} applies to sampling, but bench.temperature "
            "is 0 (greedy): set bench.temperature > 0 or leave bench.top_p at 1"
        )
    regen = config["regenerate"]
    if regen["dtype"] not in ("auto", "float32") and not honours(
        regen["backend"], "regenerate.dtype"
    ):
        raise ConfigError(
            f"config: regenerate.dtype = {regen['dtype']} is the "
            f"{engines_text('regenerate.dtype', ' and ')} engine's; the {regen['backend']} "
            "engine serves target.dtype: leave regenerate.dtype auto"
        )
    ids = config["capture"]["aux_layer_ids"]
    if ids != "auto" and len(set(ids)) != len(ids):
        raise ConfigError(
            f"config: capture.aux_layer_ids = {list(ids)}: the ids must be distinct (each names "
            "one layer whose output is an aux state)"
        )
    capture = config["capture"]["storage"]
    if config["train"]["loss_positions"] == "all" and capture["final"] != "states":
        raise ConfigError(
            "config: train.loss_positions = all trains every position toward the target's "
            f"distribution there, but capture.storage.final = {capture['final']} keeps no "
            "teacher at untrained positions: use capture.storage.final states"
        )
    check_segments(config)


def check_segments(config: dict) -> None:
    """train.segment_rows and capture.keep false (segment mode, draftsmith.hidden.segments)."""
    train, data = config["train"], config["data"]
    rows = train.get("segment_rows", 0)
    if rows and rows % data["rows_per_shard"]:
        raise ConfigError(
            f"config: train.segment_rows = {rows} is not a multiple of data.rows_per_shard = "
            f"{data['rows_per_shard']}: a segment is made of whole row ranges"
        )
    if config["capture"].get("keep", True):
        return
    if not rows:
        raise ConfigError(
            "config: capture.keep = false (segment mode) needs train.segment_rows > 0, the rows "
            "captured and trained on at a time: set train.segment_rows (a multiple of "
            "data.rows_per_shard) or leave capture.keep true"
        )
    if train["nproc"] != 1:
        raise ConfigError(
            f"config: capture.keep = false trains in one process per segment; train.nproc = "
            f"{train['nproc']} is for offline training (capture.keep true): set train.nproc 1 "
            "or capture.keep true"
        )
    if train.get("eval_rows", 0):
        raise ConfigError(
            f"config: train.eval_rows = {train['eval_rows']} scores the final draft on held-out "
            "rows of every shard, which capture.keep = false deletes: set train.eval_rows 0"
        )


def concurrency_levels(value) -> list[int]:
    """bench.concurrency as a list of levels: a single level (the older scalar form) or the
    list as configured, in its order (the first level is the report's main table)."""
    levels = [int(value)] if isinstance(value, int | float | str) else [int(v) for v in value]
    if not levels or min(levels) < 1 or len(set(levels)) != len(levels):
        raise ConfigError(
            f"config: bench.concurrency = {value}: needs distinct levels >= 1 (e.g. [1, 4, 8])"
        )
    return levels


def honours(backend: str, setting: str) -> bool:
    """Whether engine `backend` honours a "stage.key" setting only some engines honour (its
    WORKFLOW, draftsmith.engines.needs)."""
    from draftsmith.config.engines import needs

    return setting in needs(backend)["honours"]


def engines_text(setting: str, sep: str) -> str:
    """The engines that honour `setting`, joined for a message."""
    from draftsmith.config.engines import honoured_by

    return sep.join(honoured_by(setting))


def storage_keys(storage: dict) -> dict:
    """capture.storage without the keys its mode does not use, so that a new or changed top-k
    or scale setting leaves the shards of another mode fresh (draftsmith.hidden.storage fills missing
    keys with the same defaults)."""
    keep = {"aux": storage.get("aux", "dtype"), "final": storage.get("final", "states")}
    if keep["aux"] == "float8_e4m3":
        keep["scale_block"] = storage.get("scale_block", 0)
    if keep["final"] == "topk":
        keep["topk"] = storage.get("topk", 32)
        keep["topk_vocab"] = storage.get("topk_vocab", "target")
    return keep


def load_schema() -> dict:
    """draftsmith/config/config.schema.yaml of the workflow beside the package."""
    import yaml

    return yaml.safe_load((Path(__file__).resolve().parent / "config.schema.yaml").read_text())


def neutral_defaults(schema: dict) -> dict[str, dict]:
    """{section: {key: default}} of the keys the schema marks `x-omit-default: true`: options
    added after outputs existed, whose default reproduces what was built before them."""
    out: dict[str, dict] = {}
    for section, spec in schema.get("properties", {}).items():
        for key, prop in spec.get("properties", {}).items():
            if prop.get("x-omit-default"):
                out.setdefault(section, {})[key] = prop["default"]
    return out


def execution_keys(schema: dict) -> dict[str, tuple[str, ...]]:
    """{section: keys} the schema marks `x-execution: true`: how a job runs, never what it
    builds (retries, requests in flight, checkpoint cadence, a server's port and timeouts).
    They are never in params; jobs get them as DRAFTSMITH_RUN (draftsmith.runtime.files.merge_run)."""
    out: dict[str, tuple[str, ...]] = {}
    for section, spec in schema.get("properties", {}).items():
        keys = tuple(k for k, p in spec.get("properties", {}).items() if p.get("x-execution"))
        if keys:
            out[section] = keys
    return out


def execution_defaults(section: str, schema: dict | None = None) -> dict:
    """The schema's defaults of a section's `x-execution` keys: what a job uses for the ones
    its DRAFTSMITH_RUN does not carry (a hand-run stage CLI). The schema file is read from the
    workflow beside the package when not given."""
    schema = load_schema() if schema is None else schema
    props = schema["properties"][section]["properties"]
    return {k: props[k]["default"] for k in execution_keys(schema).get(section, ())}


def sections_json(
    config: dict,
    sections,
    extra: dict | None = None,
    neutral: dict | None = None,
    only: dict | None = None,
    execution: dict | None = None,
) -> str:
    """The config sections a job reads, as the JSON of its `params` (what makes it stale), plus
    `extra` sections not already named; `only` {section: keys} takes just those keys of a
    section (added to `sections`). Left out, so that they stale nothing: the keys of `neutral`
    (neutral_defaults) while at their default, and the capture.storage keys its mode does not
    use, and always the `execution` keys {section: keys} (execution_keys)."""
    neutral, only, execution = neutral or {}, only or {}, execution or {}
    cfg = {}
    for s in [*sections, *(o for o in only if o not in sections)]:
        skip, run = neutral.get(s, {}), execution.get(s, ())
        keys = [k for k in only.get(s, config[s].keys()) if k not in run]
        cfg[s] = {k: config[s][k] for k in keys if k not in skip or skip[k] != config[s][k]}
    if "capture" in cfg:
        storage = storage_keys(cfg["capture"].get("storage", {}))
        cfg["capture"] = {**cfg["capture"], "storage": storage}
    for key, value in (extra or {}).items():
        cfg.setdefault(key, value)
    return json.dumps(cfg, sort_keys=True)
