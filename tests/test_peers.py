"""Interop with the peers' own code (role `peers`: speculators 0.9.0, specforge 0.2.0, CPU torch).

- our export, loaded by SpecForge's trainer path and by speculators' `from_pretrained`, gives
  our logits at TTT steps 0 and 1;
- our converters read what the peers' own writers produce, and the peers' own readers accept
  what our converters write.
The peers run in their interpreter (tests/peers/run.py); tensors travel as safetensors files.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from roles import role_python
from safetensors.torch import load_file, save_file

from draftsmith.hidden.shards import manifest_path, open_shard
from draftsmith.interop.common import apply_norm, final_norm
from draftsmith.interop.convert import main

pytestmark = [pytest.mark.slow, pytest.mark.peers]

ROOT = Path(__file__).resolve().parents[1]
RUN = ROOT / "tests" / "peers" / "run.py"
IDS = [1, 2, 4]


def peers(*args, cwd=None, module=False) -> str:
    cmd = [role_python("peers"), *(["-m"] if module else [str(RUN)]), *map(str, args)]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    p = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=900)
    if p.returncode:
        raise AssertionError(f"{' '.join(cmd)} failed:\n{p.stdout[-3000:]}\n{p.stderr[-6000:]}")
    return p.stderr


@pytest.fixture(scope="module")
def project(tiny_target, tmp_path_factory):
    """A project dir: results/target (tiny Llama), results/draft (random trained-like draft)."""
    from test_specdec import random_draft
    from transformers import AutoModelForCausalLM

    from draftsmith.algorithms.export import export_draft, target_embedding, verifier_ref
    from draftsmith.targets.model import write_meta

    root = tmp_path_factory.mktemp("proj")
    target = shutil.copytree(tiny_target, root / "results" / "target")
    write_meta(target, "path", str(tiny_target))
    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    draft = random_draft(model, aux_ids=IDS)
    here = Path.cwd()
    os.chdir(root)
    try:
        verifier = verifier_ref(Path("results/target"))
    finally:
        os.chdir(here)
    assert verifier["name_or_path"] == "results/target"
    export_draft(
        draft,
        root / "results" / "draft",
        {},
        embed=target_embedding(target),
        verifier=verifier,
    )
    return root, target, model


@torch.no_grad()
def test_export_gives_our_logits_through_peer_loaders(project, tmp_path):
    from draftsmith.algorithms.eagle3.model import TTTCache, block_causal_mask
    from draftsmith.algorithms.export import load_export, target_embedding

    root, target, model = project
    draft = load_export(root / "results" / "draft")
    c = draft.config
    t = 128  # speculators' flex-attention block masks come in multiples of 128
    g = torch.Generator().manual_seed(3)
    x = torch.randint(0, c.vocab_size, (t + 2,), generator=g)
    aux = torch.randn(t, c.num_aux * c.target_hidden_size, generator=g)
    save_file({"aux": aux, "ids": x[1 : t + 1].clone()}, str(tmp_path / "in.safetensors"))
    log = peers(
        "logits",
        "--draft",
        "results/draft",
        "--target",
        "results/target",
        "--inputs",
        tmp_path / "in.safetensors",
        "--out",
        tmp_path / "out.safetensors",
        cwd=root,  # speculators resolves the verifier "results/target" from here
    )
    got = load_file(str(tmp_path / "out.safetensors"))

    embed = target_embedding(target).float()
    pos = torch.arange(t)[None]
    cache = TTTCache(block_causal_mask(torch.zeros(1, t, dtype=torch.long)))
    out0 = draft.step(embed[x[1 : t + 1]][None], draft.project(aux[None]), pos, cache)
    out1 = draft.step(embed[x[2 : t + 2]][None], out0, pos + 1, cache)
    ours = [draft.logits(out0)[0], draft.logits(out1)[0]]
    report = {}
    for peer in ("specforge", "speculators"):
        for step in (0, 1):
            n = t if step == 0 else t - 1  # the peers pad the last position's next token
            theirs, want = got[f"{peer}_{step}"][:n], ours[step][:n]
            report[f"{peer}_{step}"] = float((theirs - want).abs().max())
            assert torch.equal(theirs.argmax(-1), want.argmax(-1)), (peer, step)
            torch.testing.assert_close(theirs, want, rtol=1e-5, atol=1e-5)
    print("max |peer - ours| logits:", json.dumps(report), "\n", log[-500:])


@pytest.fixture(scope="module")
def shard(project, tmp_path_factory):
    """A captured bf16 shard of 3 rows (global rows 0..2) from the tiny target."""
    from draftsmith.engines.hf.engine import capture_shard
    from draftsmith.targets.model import fingerprint

    root, target, model = project
    g = torch.Generator().manual_seed(5)
    lengths = [7, 11, 5]
    n = sum(lengths)
    tokens = {
        "input_ids": torch.randint(0, model.config.vocab_size, (n,), generator=g),
        "loss_mask": (torch.rand(n, generator=g) > 0.4).to(torch.uint8),
        "row_offsets": torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()]),
    }
    path = tmp_path_factory.mktemp("hidden") / "rows_000000-000003.safetensors"
    meta = {"row_range": [0, 3], "target_fingerprint": fingerprint(target), "target_layers": 6}
    capture_shard(model, tokens, path, IDS, "bfloat16", 64, meta, progress=False)
    return path


def test_specforge_reader_accepts_to_specforge(project, shard, tmp_path):
    main(["to-specforge", "--shard", str(shard), "--out", str(tmp_path / "sf")])
    peers("read-specforge", "--src", tmp_path / "sf", "--out", tmp_path / "read.safetensors")
    got = load_file(str(tmp_path / "read.safetensors"))
    s = open_shard(shard)
    order = sorted(range(len(s)), key=lambda r: f"rows_0-2000/data_{r}.ckpt")  # reader order
    for i, r in enumerate(order):
        row = s.row(r)
        assert torch.equal(got[f"{i}.input_ids"], row["input_ids"])
        assert torch.equal(got[f"{i}.loss_mask"], row["loss_mask"].long())
        assert torch.equal(got[f"{i}.aux_hidden_state"][0], row["aux_hidden_states"])
        assert torch.equal(got[f"{i}.hidden_state"][0], row["last_hidden_states"])


def test_specforge_writer_output_converts_bit_exact(project, tmp_path):
    root, target, model = project
    h = model.config.hidden_size
    g = torch.Generator().manual_seed(9)
    samples = []
    for n in (6, 9, 4):
        samples.append(
            {
                "input_ids": torch.randint(0, model.config.vocab_size, (n,), generator=g),
                "loss_mask": (torch.rand(n, generator=g) > 0.5).long(),
                "hidden_state": torch.randn(1, n, h, generator=g).bfloat16(),
                "aux_hidden_state": torch.randn(1, n, 3 * h, generator=g).bfloat16(),
            }
        )
    flat = {f"{i}.{k}": v for i, s in enumerate(samples) for k, v in s.items()}
    save_file(flat, str(tmp_path / "samples.safetensors"))
    peers("write-specforge", "--samples", tmp_path / "samples.safetensors", "--out", tmp_path / "d")
    assert sorted(p.name for p in (tmp_path / "d").iterdir())[0] == "sf-000000.ckpt"
    out = tmp_path / "rows_000000-000003.safetensors"
    main(
        ["from-specforge", "--src", str(tmp_path / "d"), "--target", str(target), "--out", str(out)]
        + ["--aux-layer-ids", "1,2,4"]
    )
    s = open_shard(out, verify_sha=True)
    for r, want in enumerate(samples):
        row = s.row(r)
        assert torch.equal(row["input_ids"], want["input_ids"])
        assert torch.equal(row["loss_mask"].long(), want["loss_mask"])
        assert torch.equal(row["aux_hidden_states"], want["aux_hidden_state"][0])
        assert torch.equal(row["last_hidden_states"], want["hidden_state"][0])
    conv = json.loads(manifest_path(out).read_text())["converted_from"]
    assert (
        "sorted path order" in conv["sample_index"]
        and "--aux-layer-ids" in conv["aux_layer_ids_from"]
    )


def test_speculators_reader_accepts_to_speculators(project, shard, tmp_path):
    root, target, _ = project
    sp = tmp_path / "sp"
    peers("draftsmith", "convert", "to-speculators", "--shard", shard, "--target", target,
          "--out", sp, module=True)  # fmt: skip
    peers("read-speculators", "--src", sp, "--out", tmp_path / "read.safetensors")
    got = load_file(str(tmp_path / "read.safetensors"))
    s = open_shard(shard)
    w, eps = final_norm(target)
    for r in range(len(s)):
        row = s.row(r)
        assert torch.equal(got[f"{r}.input_ids"], row["input_ids"])
        assert torch.equal(got[f"{r}.loss_mask"], row["loss_mask"].long())
        assert torch.equal(got[f"{r}.hidden_states"], row["aux_hidden_states"])
        pre = got[f"{r}.verifier_last_hidden_states"]  # speculators applies the norm itself
        torch.testing.assert_close(
            apply_norm(pre, w, eps), row["last_hidden_states"].float(), rtol=1.6e-2, atol=1e-2
        )
    side = json.loads((sp / "draftsmith.json").read_text())
    assert side["vllm_layer_ids"] == [i + 1 for i in IDS] and side["row_range"] == [0, 3]


def test_speculators_writer_output_converts(project, tmp_path):
    root, target, model = project
    h = model.config.hidden_size
    g = torch.Generator().manual_seed(11)
    samples = []
    for n in (5, 8, 6):
        samples.append(
            {
                "input_ids": torch.randint(0, model.config.vocab_size, (n,), generator=g),
                "loss_mask": (torch.rand(n, generator=g) > 0.5).long(),
                "hidden_states": torch.randn(n, 4, h, generator=g).bfloat16(),
            }
        )
    flat = {f"{i}.{k}": v for i, s in enumerate(samples) for k, v in s.items()}
    save_file(flat, str(tmp_path / "samples.safetensors"))
    src = tmp_path / "sp"
    peers("write-speculators", "--samples", tmp_path / "samples.safetensors", "--out", src)
    out = tmp_path / "rows_000000-000003.safetensors"
    peers("draftsmith", "convert", "from-speculators", "--src", src, "--target", target,
          "--out", out, "--aux-layer-ids", "1,2,4", module=True)  # fmt: skip
    s = open_shard(out, verify_sha=True)
    w, eps = final_norm(target)
    for r, want in enumerate(samples):
        row = s.row(r)
        hs = want["hidden_states"]
        assert torch.equal(row["input_ids"], want["input_ids"])
        assert torch.equal(row["loss_mask"].long(), want["loss_mask"])
        assert torch.equal(row["aux_hidden_states"], hs[:, :3].reshape(hs.shape[0], -1))
        assert torch.equal(row["last_hidden_states"], apply_norm(hs[:, 3], w, eps).bfloat16())
    conv = json.loads(manifest_path(out).read_text())["converted_from"]
    assert conv["format"] == "speculators-arrow" and "input-of-layer" in conv["layer_numbering"]
    with pytest.raises(AssertionError, match="speculators' default capture is vLLM ids"):
        peers("draftsmith", "convert", "from-speculators", "--src", src, "--target", target,
              "--out", tmp_path / "x" / out.name, module=True)  # fmt: skip
