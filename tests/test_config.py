"""Config preparation: --config strings coerced by schema type, one source of defaults,
cross-key checks and automatic aux layer ids, all at parse time."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import yaml
from wf import ROOT, snakemake, tiny_config, with_defaults, write_config

from draftsmith.config.checks import ConfigError, aux_layer_ids, check_config, coerce

SCHEMA = yaml.safe_load((ROOT / "draftsmith" / "config" / "config.schema.yaml").read_text())


# ---------------------------------------------------------------- coercion


def test_nested_strings_become_the_schema_types():
    got = coerce(
        {
            "train": {"lr": "0.002", "epochs": "3", "seed": "-1"},
            "envs": {"cpu": {"python": "", "gpus": "0"}},
            "regenerate": {"enabled": "false", "temperature": "0"},
            "capture": {"aux_layer_ids": ["0", "2", "5"]},
            "data": {"sources": [{"format": "prompt", "path": "1.jsonl", "max_rows": "7"}]},
        },
        SCHEMA,
    )
    assert got["train"] == {"lr": 0.002, "epochs": 3, "seed": -1}
    assert got["envs"]["cpu"] == {"python": "", "gpus": 0}
    assert got["regenerate"] == {"enabled": False, "temperature": 0.0}
    assert got["capture"]["aux_layer_ids"] == [0, 2, 5]
    assert got["data"]["sources"][0] == {"format": "prompt", "path": "1.jsonl", "max_rows": 7}
    assert coerce({"capture": {"aux_layer_ids": "auto"}}, SCHEMA)["capture"]["aux_layer_ids"] == (
        "auto"
    )
    # typed values and unknown keys are left to schema validation
    assert coerce({"train": {"lr": 0.5, "nope": "1"}}, SCHEMA) == {
        "train": {"lr": 0.5, "nope": "1"}
    }


@pytest.mark.parametrize(
    "cfg, needle",
    [
        ({"train": {"lr": "fast"}}, "train.lr = 'fast' is not a number"),
        ({"train": {"epochs": "2.5"}}, "train.epochs = '2.5' is not an integer"),
        ({"train": {"lr": "nan"}}, "train.lr = 'nan' is not a number"),
        ({"envs": {"cpu": {"gpus": "one"}}}, "envs.cpu.gpus = 'one' is not an integer"),
        ({"regenerate": {"enabled": "maybe"}}, "regenerate.enabled = 'maybe' is not true or false"),
    ],
)
def test_a_string_that_is_not_a_number_names_the_key(cfg, needle):
    with pytest.raises(ConfigError, match=re.escape(needle)):
        coerce(cfg, SCHEMA)


@pytest.mark.workflow
def test_numbers_from_the_command_line_reach_the_jobs(tmp_path: Path, tiny_target: Path):
    write_config(tmp_path, tiny_config(tiny_target))
    proc = snakemake(
        tmp_path,
        "-n",
        "-p",
        "--config",
        'train={"lr": 0.002, "epochs": 3}',
        'envs={"cpu": {"python": "", "gpus": 0}}',
        "--",
        "results/draft",
    )
    out = proc.stdout + proc.stderr
    cfgs = [json.loads(c) for c in re.findall(r"--cfg '(\{[^']*\})'", out)]
    train_cfg = next(c for c in cfgs if "train" in c)
    assert train_cfg["train"]["lr"] == 0.002 and train_cfg["train"]["epochs"] == 3
    bad = snakemake(tmp_path, "-n", "--config", 'train={"lr": "fast"}', check=False)
    assert bad.returncode != 0
    assert "train.lr = 'fast' is not a number" in bad.stdout + bad.stderr


# ---------------------------------------------------------------- one source of defaults


def test_config_yaml_holds_only_schema_defaults():
    """config.yaml adds nothing to the schema's defaults: reading it or not gives one config."""
    shipped = yaml.safe_load((ROOT / "config.yaml").read_text())
    assert with_defaults(shipped) == with_defaults({})


@pytest.mark.workflow
def test_another_directory_with_configfile_gets_what_the_repo_gets(tmp_path: Path):
    """`-s repo/Snakefile --directory proj --configfile my.yaml` skips config.yaml: same jobs."""
    repo_like, proj = tmp_path / "repo_like", tmp_path / "proj"
    repo_like.mkdir()
    shutil.copy(ROOT / "config.yaml", repo_like / "config.yaml")
    (proj / "cfg").mkdir(parents=True)
    (proj / "cfg" / "my.yaml").write_text("bench: {humaneval_size: 8}\n")
    cmds = {}
    for name, workdir, args in (
        ("repo", repo_like, ()),
        ("proj", proj, ("--configfile", str(proj / "cfg" / "my.yaml"))),
    ):
        proc = snakemake(workdir, "-n", "-p", *args)
        cmds[name] = sorted(
            line.strip()
            for line in proc.stdout.splitlines()
            if "-m draftsmith " in line and "--cfg" in line
        )
    assert cmds["repo"] and cmds["repo"] == cmds["proj"]


def test_docs_config_shows_the_defaults_a_run_gets():
    doc = (ROOT / "docs" / "config.md").read_text()
    cfg = with_defaults({})
    for key, value in (("train.ttt_steps", 4), ("train.epochs", 5), ("train.lr", 0.001)):
        section, name = key.split(".")
        assert cfg[section][name] == value
        assert f"| `{key}` | " in doc and f"| `{json.dumps(value)}` |" in doc.split(f"`{key}`")[1]


# ---------------------------------------------------------------- cross-key checks


def test_heldout_size_over_heldout_rows_fails_at_parse_time(tmp_path: Path, tiny_target: Path):
    cfg = with_defaults(tiny_config(tiny_target, bench={"heldout_size": 9}))
    with pytest.raises(ConfigError, match=r"bench.heldout_size = 9 .* data.heldout_rows = 8"):
        check_config(cfg)
    check_config(with_defaults(tiny_config(tiny_target, bench={"heldout_size": 8})))


def test_engine_specific_keys_fail_at_parse_time_elsewhere(tiny_target: Path):
    """regenerate.dtype bfloat16 is the hf engine's; loss_positions all needs the final states."""
    sgl = {"backend": "sglang", "role": "sglang-cpu", "dtype": "bfloat16"}
    with pytest.raises(ConfigError, match=r"regenerate.dtype = bfloat16 .* sglang engine"):
        check_config(with_defaults(tiny_config(tiny_target, regenerate=sgl)))
    check_config(with_defaults(tiny_config(tiny_target, regenerate={"dtype": "bfloat16"})))
    topk = {"storage": {"final": "topk"}}
    with pytest.raises(ConfigError, match=r"loss_positions = all .*storage.final = topk"):
        check_config(
            with_defaults(tiny_config(tiny_target, train={"loss_positions": "all"}, capture=topk))
        )
    check_config(with_defaults(tiny_config(tiny_target, train={"loss_positions": "all"})))


@pytest.mark.workflow
def test_parse_time_errors_name_the_key(tmp_path: Path, tiny_target: Path):
    write_config(tmp_path, tiny_config(tiny_target, bench={"heldout_size": 9}))
    proc = snakemake(tmp_path, "-n", check=False)
    assert proc.returncode != 0 and "bench.heldout_size = 9" in proc.stdout + proc.stderr
    write_config(tmp_path, tiny_config(tiny_target, target={"path": ""}))
    proc = snakemake(tmp_path, "-n", check=False)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0 and "target.path is empty" in out, out[-2000:]
    assert "Missing input files" not in out


def test_target_path_must_be_an_hf_directory_with_a_chat_template(tmp_path: Path, tiny_target):
    """The parse-time target check (source_signature -> check_hf_dir), chat template included."""
    from draftsmith.targets.model import TargetError, source_signature

    with pytest.raises(TargetError, match="does not exist"):
        source_signature(tmp_path / "nope")
    with pytest.raises(TargetError, match="has no config.json"):
        source_signature(tmp_path)
    with pytest.raises(TargetError, match="target.path is empty"):
        source_signature("  ")
    plain = shutil.copytree(tiny_target, tmp_path / "plain")
    (plain / "chat_template.jinja").unlink()
    cfg = json.loads((plain / "tokenizer_config.json").read_text())
    cfg.pop("chat_template", None)
    (plain / "tokenizer_config.json").write_text(json.dumps(cfg))
    with pytest.raises(TargetError, match="has no chat template"):
        source_signature(plain)


# ---------------------------------------------------------------- aux layer ids


@pytest.mark.parametrize("n", range(4, 65))
def test_auto_aux_ids_are_three_distinct_sorted_ids(n):
    ids = aux_layer_ids("auto", n)
    assert len(ids) == 3 and ids == sorted(set(ids)) and 0 <= ids[0] and ids[-1] < n - 1
    if n >= 7:  # SGLang's own default wherever it is valid
        assert ids == [1, n // 2 - 1, n - 4]


def test_aux_ids_small_targets_and_explicit_ids():
    assert aux_layer_ids("auto", 4) == [0, 1, 2]  # SGLang's formula would give [1, 1, 0]
    assert aux_layer_ids("auto", 6) == [0, 2, 4]
    with pytest.raises(ValueError, match="at least 4"):
        aux_layer_ids("auto", 3)
    with pytest.raises(ValueError, match="outside"):
        aux_layer_ids([0, 1, 5], 6)  # the last layer
    with pytest.raises(ValueError, match="distinct"):
        aux_layer_ids([1, 1, 2], 6)
    assert aux_layer_ids([3, 0, 1], 6) == [3, 0, 1]


def test_params_leave_out_neutral_defaults_and_other_modes_storage_keys():
    """A key added with a default that builds what was built before (x-omit-default) and the
    storage keys of another mode stay out of a job's params: adding them stales nothing,
    while a non-default value or a key the mode uses does."""
    from draftsmith.config.checks import neutral_defaults, sections_json

    schema = yaml.safe_load((ROOT / "draftsmith" / "config" / "config.schema.yaml").read_text())
    neutral = neutral_defaults(schema)
    assert neutral["regenerate"] == {"dtype": "auto", "thinking": "template"}
    assert neutral["train"] == {"eval_rows": 0, "loss_positions": "assistant", "segment_rows": 0}
    assert neutral["capture"] == {"keep": True}
    storage = {"aux": "dtype", "final": "states", "scale_block": 0, "topk": 32}
    cfg = {
        "regenerate": {"backend": "hf", "dtype": "auto", "seed": 0},
        "capture": {"dtype": "bfloat16", "storage": {**storage, "topk_vocab": "target"}},
        "data": {"max_length": 512, "overlong": "truncate"},
    }
    out = json.loads(sections_json(cfg, ["regenerate", "capture"], neutral=neutral))
    assert out["regenerate"] == {"backend": "hf", "seed": 0}
    assert out["capture"]["storage"] == {"aux": "dtype", "final": "states"}
    cfg["regenerate"]["dtype"] = "bfloat16"
    cfg["capture"]["storage"] = {**storage, "aux": "float8_e4m3", "final": "topk"}
    out = json.loads(sections_json(cfg, ["regenerate", "capture"], neutral=neutral))
    assert out["regenerate"]["dtype"] == "bfloat16"
    assert out["capture"]["storage"] == {
        "aux": "float8_e4m3",
        "final": "topk",
        "scale_block": 0,
        "topk": 32,
        "topk_vocab": "target",
    }
    only = json.loads(sections_json(cfg, [], only={"data": ("max_length",)}))
    assert only == {"data": {"max_length": 512}}


def test_bench_sampling_keys_at_default_change_no_params(tiny_target: Path):
    """bench.temperature, top_p and seed (x-omit-default): at their defaults the bench job's
    params are those of a config without them (greedy benchmarks stay fresh); set away, they
    are in them."""
    from draftsmith.config.checks import neutral_defaults, sections_json

    schema = yaml.safe_load((ROOT / "draftsmith" / "config" / "config.schema.yaml").read_text())
    neutral = neutral_defaults(schema)
    assert neutral["bench"] == {"temperature": 0, "top_p": 1.0, "seed": 0}
    cfg = with_defaults(tiny_config(tiny_target))
    before = {**cfg, "bench": {k: v for k, v in cfg["bench"].items() if k not in neutral["bench"]}}
    sections = ["bench", "data", "target"]
    assert sections_json(cfg, sections, neutral=neutral) == sections_json(
        before, sections, neutral=neutral
    )
    hot = with_defaults(tiny_config(tiny_target, bench={"temperature": 0.7, "top_p": 0.9}))
    out = json.loads(sections_json(hot, sections, neutral=neutral))["bench"]
    assert out["temperature"] == 0.7 and out["top_p"] == 0.9 and "seed" not in out


def test_bench_sampling_keys_fail_at_parse_time_where_they_cannot_apply(tiny_target: Path):
    check_config(with_defaults(tiny_config(tiny_target, bench={"temperature": 0.7})))
    for backend, role in (("sglang", "sglang-cpu"), ("vllm", "vllm-cpu")):  # server sampling
        hot = {"temperature": 0.7, "backend": backend, "role": role}
        check_config(with_defaults(tiny_config(tiny_target, bench=hot)))
    with pytest.raises(ConfigError, match=r"bench.top_p = 0.9 .*bench.temperature is 0"):
        check_config(with_defaults(tiny_config(tiny_target, bench={"top_p": 0.9})))


def test_bench_concurrency_levels(tiny_target: Path):
    """bench.concurrency: a level (the older scalar) or a list of levels for the server
    engines; the hf engine, one request at a time, is refused a list at parse time."""
    from draftsmith.config.checks import concurrency_levels

    assert concurrency_levels(1) == [1] and concurrency_levels([1, 4, 16]) == [1, 4, 16]
    with pytest.raises(ConfigError, match="distinct levels"):
        concurrency_levels([4, 4])
    server = {"backend": "vllm", "role": "vllm-cpu", "concurrency": [1, 4, 8, 16]}
    check_config(with_defaults(tiny_config(tiny_target, bench=server)))
    check_config(with_defaults(tiny_config(tiny_target, bench={"concurrency": [1]})))
    with pytest.raises(ConfigError, match=r"bench.concurrency = \[1, 4\]: the hf engine"):
        check_config(with_defaults(tiny_config(tiny_target, bench={"concurrency": [1, 4]})))
