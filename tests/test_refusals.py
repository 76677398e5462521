"""Settings that cannot work together are refused before any job, from one table.

The table is made, not listed: every engine an algorithm's spec refuses to serve
(`spec.serving`), every setting a spec refuses (`spec.refuses`), every "stage.key" setting only
some engines honour (each engine module's WORKFLOW["honours"]) set for an engine that does not,
and segment mode's exclusions (draftsmith.config.checks.check_segments). For each pair the
parse-time checks (the ones rules/common.smk runs) must refuse it with a message that names the
keys and says what to set instead; and `snakemake -n` on a tiny project with that pair stops
with the same message and plans nothing.
"""

from __future__ import annotations

import copy

import pytest
from wf import snakemake, tiny_config, with_defaults, write_config

from draftsmith import algorithms
from draftsmith.config.checks import ConfigError, check_config, load_schema
from draftsmith.config.engines import ENGINES, needs

SCHEMA = load_schema()
# the engine key of each stage whose settings only some engines honour
BACKEND_KEY = {"bench": "bench.backend", "regenerate": "regenerate.backend"}
# words that say what to do instead (every refusal ends with one)
ALTERNATIVE = ("set ", "use ", "leave ", "serve it", " or ")


def prop(key: str) -> dict:
    section, _, name = key.partition(".")
    return SCHEMA["properties"][section]["properties"][name]


def other_value(key: str):
    """A schema-valid value of "section.key" that is not its default (its off value)."""
    p, default = prop(key), prop(key)["default"]
    if "enum" in p:
        return next(v for v in p["enum"] if v != default)
    kind = p.get("type") or [o.get("type") for o in p.get("oneOf", [])]
    kinds = kind if isinstance(kind, list) else [kind]
    if "boolean" in kinds:
        return not default
    if "integer" in kinds:  # a number where the default is a word (auto)
        return default + 2 if isinstance(default, int) else 2
    if "number" in kinds:
        return 0.7 if default == 0 else default / 2
    raise AssertionError(f"no other value known for {key} ({p})")


def put(sections: dict, key: str, value) -> dict:
    section, _, name = key.partition(".")
    out = copy.deepcopy(sections)
    out.setdefault(section, {})[name] = value
    return out


def table() -> list:
    """(id, config sections, words the refusal must hold) for every pair refused."""
    rows = []
    for name in algorithms.names():
        spec = algorithms.get(name)
        base = {"draft": {"algorithm": name}}
        for engine in ENGINES:
            if spec.serves(engine).refused:
                words = [f"draft.algorithm {name}", f"bench.backend {engine}"]
                rows.append((f"{name}+{engine}", put(base, "bench.backend", engine), words))
        for key in spec.refuses:
            value = other_value(key)
            rows.append((f"{name}+{key}", put(base, key, value), [f"draft.algorithm {name}", key]))
    for engine in ENGINES:
        for stage, backend in BACKEND_KEY.items():
            for key in {k for e in ENGINES for k in needs(e)["honours"] if k.startswith(stage)}:
                if key in needs(engine)["honours"] or engine not in prop(backend).get("enum", []):
                    continue
                sections = put(put({}, backend, engine), key, other_value(key))
                rows.append((f"{engine}+{key}", sections, [key, engine]))
    segment = {"capture": {"keep": False}, "train": {"segment_rows": 64}}
    rows.append(("segments+train.nproc", put(segment, "train.nproc", 2), ["capture.keep", "train.nproc"]))  # fmt: skip
    rows.append(("segments+train.eval_rows", put(segment, "train.eval_rows", 2), ["train.eval_rows"]))  # fmt: skip
    rows.append(("segments without segment_rows", {"capture": {"keep": False}}, ["capture.keep", "train.segment_rows"]))  # fmt: skip
    return rows


TABLE = table()


def parse_time_refusal(sections: dict) -> str:
    """What the parse-time checks say of a config with `sections` ('' if nothing)."""
    cfg = with_defaults(sections)
    try:
        check_config(cfg)
    except ConfigError as e:
        return str(e)
    return "; ".join(algorithms.refusals(cfg, SCHEMA))


def test_the_table_covers_every_kind_of_refusal():
    ids = [r[0] for r in TABLE]
    assert "dflash+sglang" in ids and "dflash+train.eval_rows" in ids, ids
    assert "dflash+draft.attention" in ids and "dflash+bench.temperature" in ids, ids
    assert "hf+bench.concurrency" in ids and "sglang+bench.workers" in ids, ids
    assert "sglang+regenerate.dtype" in ids and "segments+train.nproc" in ids, ids
    assert len(ids) == len(set(ids))


@pytest.mark.parametrize(("pair", "sections", "words"), TABLE, ids=[r[0] for r in TABLE])
def test_each_pair_is_refused_at_parse_naming_its_keys(pair, sections, words):
    msg = parse_time_refusal(sections)
    assert msg, f"{pair}: not refused"
    for w in words:
        assert w in msg, (pair, w, msg)
    assert any(a in msg for a in ALTERNATIVE), (pair, "no alternative given", msg)


def test_the_default_is_refused_nowhere():
    for name in algorithms.names():
        for engine in ENGINES:
            if algorithms.get(name).serves(engine).refused:
                continue
            sections = {"draft": {"algorithm": name}, "bench": {"backend": engine}}
            assert parse_time_refusal(sections) == "", (name, engine)


@pytest.mark.workflow
@pytest.mark.parametrize(("pair", "sections", "words"), TABLE, ids=[r[0] for r in TABLE])
def test_each_pair_stops_the_dry_run_before_any_job(tmp_path, tiny_target, pair, sections, words):
    cfg = tiny_config(tiny_target)
    for section, values in sections.items():
        cfg[section] = {**cfg.get(section, {}), **values}
    write_config(tmp_path, cfg)
    proc = snakemake(tmp_path, "-n", check=False)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, (pair, out[-2000:])
    for w in words:
        assert w in out, (pair, w, out[-3000:])
    assert "Job stats" not in out and not (tmp_path / "results").exists(), pair
