"""Bad input named at its source: a target without a chat template, prompts that cannot be text."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest


def _copy_without_template(tiny_target: Path, dst: Path) -> Path:
    shutil.copytree(tiny_target, dst)
    (dst / "chat_template.jinja").unlink(missing_ok=True)
    cfg_file = dst / "tokenizer_config.json"
    cfg = json.loads(cfg_file.read_text())
    cfg.pop("chat_template", None)
    cfg_file.write_text(json.dumps(cfg))
    return dst


def test_target_without_chat_template_fails_in_target_model(tiny_target: Path, tmp_path: Path):
    """`python -m draftsmith target build` (rule target_model) refuses it, naming the fix."""
    from draftsmith.targets.model import has_chat_template, main

    assert has_chat_template(tiny_target)
    plain = _copy_without_template(tiny_target, tmp_path / "base-model")
    assert not has_chat_template(plain)
    cfg = json.dumps({"target": {"source": "path", "path": str(plain)}})
    out = tmp_path / "results" / "target"
    out.parent.mkdir()
    with pytest.raises(SystemExit, match=r"has no chat template .* instruct/chat variant"):
        main(["build", "--cfg", cfg, "--out", str(out)])
    assert not out.exists()
    # a template in chat_template.json (newer transformers) counts
    (plain / "chat_template.json").write_text(json.dumps({"chat_template": "{{ x }}"}))
    assert has_chat_template(plain)
