"""Config faults refused or absorbed at parse time, with the real Snakefile on a tiny target:
capture.aux_layer_ids with a repeated id or an id past the target's layers stops even
`snakemake -n` (and so never reaches a job that deletes a finished shard first), naming the key
and the value; train.precision written out as what `auto` resolves to plans the same commands."""

from __future__ import annotations

import pytest
from wf import snakemake, tiny_config, write_config

R0 = "results/hidden/rows_000000-000016.safetensors"


@pytest.mark.parametrize(
    ("ids", "said"),
    [
        ([1, 1, 2], "capture.aux_layer_ids = [1, 1, 2]: the ids must be distinct"),
        ([0, 2, 9], "capture.aux_layer_ids [0, 2, 9]: ids [9] are outside [0, 5)"),
    ],
)
def test_bad_aux_layer_ids_stop_the_dry_run_and_a_targeted_shard_survives(
    tmp_path, tiny_target, ids, said
):
    write_config(tmp_path, tiny_config(tiny_target, capture={"aux_layer_ids": ids}))
    shard = tmp_path / R0
    shard.parent.mkdir(parents=True)
    shard.write_bytes(b"a finished shard")  # what a targeted run must not delete
    for args in (("-n",), ("--cores", "1", R0)):
        proc = snakemake(tmp_path, *args, check=False)
        said_all = proc.stdout + proc.stderr
        assert proc.returncode != 0 and said in said_all, said_all[-3000:]
        assert shard.read_bytes() == b"a finished shard"
    if ids == [0, 2, 9]:
        assert "target.path" in said_all and "config.json" in said_all


def test_ids_past_the_embedded_targets_30_layers_stop_the_dry_run(tmp_path, tiny_target):
    cfg = tiny_config(tiny_target, capture={"aux_layer_ids": [1, 14, 29]})
    cfg["target"] = {"source": "embedded"}
    write_config(tmp_path, cfg)
    proc = snakemake(tmp_path, "-n", check=False)
    said = proc.stdout + proc.stderr
    assert proc.returncode != 0, said[-3000:]
    assert "capture.aux_layer_ids [1, 14, 29]: ids [29] are outside [0, 29)" in said
    assert "the embedded target, 30 layers" in said


def gpu_train(target, precision):
    """A config whose train role has a GPU (`snakemake -n` runs nothing, so none is needed)."""
    cfg = tiny_config(target, train={"role": "sglang", "precision": precision})
    cfg["envs"] = {"sglang": {"python": "", "gpus": 1}}
    return cfg


def test_precision_written_out_as_auto_chose_plans_the_same_train_command(tmp_path, tiny_target):
    """On a GPU `auto` is bf16: `precision: bf16` gives the train job the same params (a built
    project reruns nothing); fp32, another choice, does not."""
    commands = {}
    for precision in ("auto", "bf16", "fp32"):
        work = tmp_path / precision
        write_config(work, gpu_train(tiny_target, precision))
        out = snakemake(work, "-n", "-p", "results/draft").stdout
        lines = [ln.strip() for ln in out.splitlines() if "-m draftsmith train " in ln]
        assert len(lines) == 1, out[-3000:]
        commands[precision] = lines[0]
    assert commands["bf16"] == commands["auto"]
    assert commands["fp32"] != commands["auto"]
    assert '"precision": "fp32"' in commands["fp32"]
