"""A disk that fills while training runs: the per-step metrics append ends the job naming the
file, and the rerun resumes from the last checkpoint to the same curve; a checkpoint whose
safetensors write runs out of space (a real SafetensorError, on a tiny tmpfs) ends with the
path and the space, and leaves the last complete checkpoint the only one there."""

from __future__ import annotations

import builtins
import errno
import json
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from test_train import cfg_json, make_inputs, read_metrics, run_train

from draftsmith.train import checkpoint as ck

ROOT = Path(__file__).resolve().parents[1]


class FillsAt:
    """`open` whose metrics appends fail with ENOSPC from step `step` on, after half the line
    reached the file (a torn line, as a real full disk leaves it)."""

    def __init__(self, step: int):
        self.step, self.real = step, builtins.open

    def __call__(self, file, mode="r", *a, **kw):
        f = self.real(file, mode, *a, **kw)
        if not (str(file).endswith("metrics.jsonl") and "a" in mode):
            return f
        step, real_write = self.step, f.write

        def write(text):
            if json.loads(text)["step"] >= step:
                real_write(text[: len(text) // 2])
                f.flush()
                raise OSError(errno.ENOSPC, "No space left on device")
            return real_write(text)

        f.write = write
        return f


def test_a_full_disk_at_the_metrics_append_names_the_file_and_the_rerun_resumes(
    tmp_path, monkeypatch
):
    inputs = make_inputs(tmp_path / "in", rows=6)
    cfg = cfg_json(epochs=4, checkpoint_every=3)
    baseline = run_train(inputs, tmp_path / "whole", cfg)
    assert baseline[-1]["step"] > 7
    out = tmp_path / "full"
    monkeypatch.setattr(builtins, "open", FillsAt(7))
    with pytest.raises(SystemExit) as e:  # not a raw OSError
        run_train(inputs, out, cfg)
    monkeypatch.undo()
    (run_dir,) = [d for d in (out / "state").iterdir() if d.name != "verified"]
    msg = str(e.value)
    assert f"to {run_dir / 'metrics.jsonl'}" in msg and "step 7's metrics" in msg
    assert "free space on that file system" in msg and "step-000006" in msg
    # the torn half line was cut off: the log ends at the last whole step
    assert [r["step"] for r in read_metrics(run_dir / "metrics.jsonl")] == list(range(1, 7))
    assert ck.latest_checkpoint(run_dir, run_dir.name).name == "step-000006"
    resumed = run_train(inputs, out, cfg)
    assert [r["step"] for r in resumed] == [r["step"] for r in baseline]
    assert [r["loss"] for r in resumed] == [r["loss"] for r in baseline]
    assert (out / "draft" / "model.safetensors").read_bytes() == (
        tmp_path / "whole" / "draft" / "model.safetensors"
    ).read_bytes()


CHILD = textwrap.dedent(
    """
    import json, sys, torch
    sys.path.insert(0, {root!r})
    from draftsmith.train import checkpoint as ck
    from test_checkpoint_space import draft_and_opt
    from pathlib import Path
    run = Path({run!r})
    draft, opt = draft_and_opt()
    ck.save_checkpoint(run, 1, draft, opt, {{"key": "k"}})
    out = {{}}
    try:
        ck.save_checkpoint(run, 2, draft, opt, {{"key": "k"}})
    except ck.CheckpointSpaceError as e:
        out = {{"message": str(e), "cause": type(e.__context__).__name__,
               "cause_text": str(e.__context__)}}
    out["left"] = sorted(p.name for p in run.iterdir())
    out["latest"] = ck.latest_checkpoint(run, "k").name
    ck.load_checkpoint(run / out["latest"], draft, opt)  # the kept one loads
    print(json.dumps(out))
    """
)


def test_a_real_safetensors_disk_full_keeps_the_last_checkpoint(tmp_path):
    """A tmpfs with room for one checkpoint (mounted in a user and mount namespace: no root)."""
    from test_checkpoint_space import draft_and_opt

    if shutil.which("unshare") is None:
        pytest.skip("no unshare(1) to mount a small tmpfs")
    run = tmp_path / "run"
    run.mkdir()
    size = ck.checkpoint_bytes(draft_and_opt()[0]) - (1 << 20)  # the margin left out
    kib = (size * 3 // 2) // 1024 + 8
    child = CHILD.format(root=str(ROOT), run=str(run))
    script = f'mount -t tmpfs -o size={kib}k tmpfs {run} && exec {sys.executable} -c "$0"'
    proc = subprocess.run(
        ["unshare", "-rm", "sh", "-c", script, child],
        capture_output=True,
        text=True,
        cwd=ROOT / "tests",
        timeout=120,
    )
    if proc.returncode != 0 and "mount" in proc.stderr and "Traceback" not in proc.stderr:
        pytest.skip(f"cannot mount a tmpfs here: {proc.stderr.strip()[-300:]}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["cause"] == "SafetensorError" and "No space left on device" in got["cause_text"]
    assert f"MiB under {run}" in got["message"] and "(no space left on device)" in got["message"]
    assert "the rerun resumes from it" in got["message"]
    assert got["left"] == ["step-000001"] and got["latest"] == "step-000001"


def test_a_flipped_byte_with_its_mtime_put_back_is_refused_and_only_its_range_deleted(tmp_path):
    """Size and mtime prove nothing: training checks the bytes it reads (crc32 in the manifest),
    refuses the shard by name and deletes it with its manifest, so the rerun rebuilds that range
    only; the other shard stays."""
    import os

    from wf import flip_byte

    inputs = make_inputs(tmp_path / "in", rows=4)
    run_train(inputs, tmp_path / "out", cfg_json(max_steps=1))
    good, bad = inputs["shards"]
    st = bad.stat()
    flip_byte(bad)
    os.utime(bad, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert bad.stat().st_mtime_ns == st.st_mtime_ns and bad.stat().st_size == st.st_size
    with pytest.raises(SystemExit, match=f"{bad}: checksum mismatch") as e:
        run_train(inputs, tmp_path / "out", cfg_json(max_steps=1))
    assert f"deleted the refused shard(s) {bad.name}" in str(e.value)
    assert not bad.exists() and not bad.with_suffix(".json").exists()
    assert good.exists() and good.with_suffix(".json").exists()


def test_the_run_key_holds_the_resolved_precision_not_its_spelling(tmp_path):
    """train.precision bf16 written out resumes the run `auto` resolved to bf16; another
    resolved precision is another run."""
    from draftsmith.train.loop import run_key

    inputs = make_inputs(tmp_path / "in", rows=4)
    args = (inputs["shards"], inputs["vocab"], inputs["target"])
    auto, bf16 = json.loads(cfg_json(precision="auto")), json.loads(cfg_json(precision="bf16"))
    assert run_key(bf16, *args, "bf16") == run_key(auto, *args, "bf16")
    assert run_key(auto, *args, "fp32") != run_key(auto, *args, "bf16")
