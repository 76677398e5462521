"""A non-finite number is an error where it first appears (the config file,
the training step, the exported weights, the metrics), never an all-NaN draft that passes checks.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from test_train import cfg_json, make_inputs, run_train
from wf import snakemake, tiny_config, write_config

from draftsmith.algorithms.export import main as export_main
from draftsmith.config.checks import ConfigError, check_config
from draftsmith.runtime.finite import check_step, metrics_problem, nonfinite_keys


def test_nonfinite_keys_names_each_bad_number():
    cfg = {"train": {"lr": math.inf, "epochs": 2}, "bench": {"files": [{"x": math.nan}]}}
    assert nonfinite_keys(cfg) == ["config.train.lr = inf", "config.bench.files[0].x = nan"]
    assert nonfinite_keys({"train": {"lr": 0.001}}) == []


@pytest.mark.workflow
@pytest.mark.parametrize("value", [math.inf, math.nan, -math.inf])
def test_nonfinite_number_in_a_config_file_stops_the_plan(tmp_path, tiny_target, value):
    """YAML's .inf / .nan pass JSON-schema bounds (exclusiveMinimum 0); the workflow refuses them."""
    cfg = tiny_config(tiny_target, train={"lr": value})
    path = write_config(tmp_path, cfg)
    assert ".inf" in path.read_text() or ".nan" in path.read_text()
    proc = snakemake(tmp_path, "-n", check=False)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert "config.train.lr = " in out and "not a finite number" in out, out[-2000:]


def test_check_config_refuses_nonfinite(tiny_target):
    from test_config import with_defaults

    with pytest.raises(ConfigError, match=r"config.train.noise_std = nan"):
        check_config(with_defaults(tiny_config(tiny_target, train={"noise_std": math.nan})))


def test_check_step_names_the_step_and_the_kept_checkpoint(tmp_path):
    check_step(3, torch.tensor(1.5), torch.tensor(0.2), tmp_path)  # finite: nothing
    (tmp_path / "step-000004").mkdir()
    (tmp_path / "step-000004" / "meta.json").write_text("{}")
    (tmp_path / "step-000008").mkdir()  # no meta.json: incomplete, not a good checkpoint
    with pytest.raises(SystemExit, match=r"step 9: gradient norm nan.*step-000004 is kept"):
        check_step(9, torch.tensor(2.0), torch.tensor(math.nan), tmp_path)
    with pytest.raises(SystemExit, match=r"step 1: loss inf .*no checkpoint was written yet"):
        check_step(1, torch.tensor(math.inf), torch.tensor(1.0), tmp_path / "none")


def test_training_stops_on_a_nonfinite_loss_and_keeps_the_last_good_checkpoint(tmp_path):
    """A learning rate past any sense (finite, so the schema lets it through) blows the weights
    up after step 1: step 2's loss is not finite. The job stops there, exports nothing, and the
    checkpoint of step 1 (finite weights) is what a rerun resumes from."""
    inputs = make_inputs(tmp_path / "in", rows=4)
    out = tmp_path / "out"
    with pytest.raises(SystemExit, match=r"training step 2: .*not finite.*step-000001 is kept"):
        run_train(inputs, out, cfg_json(lr=1e30, checkpoint_every=1, warmup_ratio=0.0))
    assert not (out / "draft").exists() and not (out / "metrics.jsonl").exists()
    (run_dir,) = [d for d in (out / "state").iterdir() if d.name != "verified"]
    assert sorted(d.name for d in run_dir.glob("step-*")) == ["step-000001"]
    weights = load_file(str(run_dir / "step-000001" / "model.safetensors"))
    assert all(bool(torch.isfinite(t).all()) for t in weights.values() if t.is_floating_point())


@pytest.fixture(scope="module")
def exported(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("exported")
    inputs = make_inputs(root / "in", rows=4)
    run_train(inputs, root / "results", cfg_json(max_steps=2))
    # the workflow's layout: results/draft beside results/train/metrics.jsonl
    (root / "results" / "train").mkdir()
    shutil.move(root / "results" / "metrics.jsonl", root / "results" / "train" / "metrics.jsonl")
    return root / "results"


def test_export_check_refuses_nonfinite_weights(exported, tmp_path, capsys):
    draft = shutil.copytree(exported / "draft", tmp_path / "draft")
    export_main(["check", str(draft)])  # a good draft passes
    assert "OK" in capsys.readouterr().out
    weights = load_file(str(draft / "model.safetensors"))
    name = sorted(k for k, v in weights.items() if v.is_floating_point())[0]
    weights[name].view(-1)[:3] = math.nan
    save_file(weights, str(draft / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(SystemExit, match=rf"model.safetensors: {name}: 3 NaN, 0 inf"):
        export_main(["check", str(draft)])


def test_export_check_refuses_a_draft_whose_metrics_end_nonfinite(exported, tmp_path):
    results = shutil.copytree(exported, tmp_path / "results")
    metrics = results / "train" / "metrics.jsonl"
    export_main(["check", str(results / "draft")])
    records = [json.loads(ln) for ln in metrics.read_text().splitlines()]
    records[-1]["loss"] = math.nan
    metrics.write_text("".join(json.dumps(r) + "\n" for r in records))
    assert "loss = nan" in metrics_problem(metrics)
    with pytest.raises(SystemExit, match=r"training ended non-finite at step 2: loss = nan"):
        export_main(["check", str(results / "draft")])
    with pytest.raises(SystemExit, match="training ended non-finite"):
        export_main(["check", str(results / "draft"), "--metrics", str(metrics)])
