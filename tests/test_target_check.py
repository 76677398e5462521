"""The target is checked where it enters (rule target_model): a NaN in a weight and a corrupt
tokenizer file are refused there, naming the file and the tensor, before any job uses them."""

from __future__ import annotations

import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from draftsmith.runtime import finite
from draftsmith.targets import check
from draftsmith.targets.model import TargetError, link_path_target


def copy_target(src, dst):
    shutil.copytree(src, dst)
    return dst


def test_a_nan_weight_is_refused_naming_file_and_tensor(tiny_target, tmp_path, monkeypatch):
    model = copy_target(tiny_target, tmp_path / "model")
    (weights,) = model.glob("*.safetensors")
    state = load_file(str(weights))
    name = next(k for k in state if k.endswith("mlp.down_proj.weight"))
    state[name][0, 0] = float("nan")
    save_file(state, str(weights), metadata={"format": "pt"})
    (tmp_path / "results").mkdir()
    with pytest.raises(TargetError) as e:
        link_path_target(model, tmp_path / "results" / "target")
    msg = str(e.value)
    assert f"{weights.name}: {name}: 1 NaN, 0 inf of" in msg and "non-finite weights" in msg
    assert not (tmp_path / "results" / "target").exists()  # nothing half-built left
    # read in slices: the same count when every slice holds a few rows only
    monkeypatch.setattr(finite, "SLICE_ELEMENTS", 64)
    assert check.nonfinite_weights([weights]) == [f"{weights.name}: {name}: 1 NaN, 0 inf of "
                                                  f"{state[name].numel()}"]  # fmt: skip


def test_a_corrupt_tokenizer_is_refused_naming_the_file(tiny_target, tmp_path):
    model = copy_target(tiny_target, tmp_path / "model")
    with open(model / "tokenizer.json", "ab") as f:
        f.write(b"\x00garbage" * 512)
    (tmp_path / "results").mkdir()
    with pytest.raises(TargetError, match=r"the tokenizer \(tokenizer\.json.*\) does not load"):
        link_path_target(model, tmp_path / "results" / "target")


def test_a_good_target_passes_and_a_broken_template_is_named(tiny_target, tmp_path):
    assert check.target_problems(tiny_target, sorted(tiny_target.glob("*.safetensors"))) == []
    model = copy_target(tiny_target, tmp_path / "model")
    cfg = model / "tokenizer_config.json"
    text = cfg.read_text()
    import json

    data = json.loads(text)
    data["chat_template"] = "{% for m in messages %}{{ m.content | no_such_filter }}{% endfor %}"
    cfg.write_text(json.dumps(data))
    (model / "chat_template.jinja").unlink(missing_ok=True)
    problems = check.tokenizer_problems(model)
    assert problems and "chat template does not render" in problems[0], problems


def test_integer_and_float8_tensors_are_read(tmp_path):
    path = tmp_path / "w.safetensors"
    f8 = torch.zeros(4, 4).to(torch.float8_e4m3fn)
    save_file({"ids": torch.arange(4), "f8": f8}, str(path))
    assert check.nonfinite_weights([path]) == []
