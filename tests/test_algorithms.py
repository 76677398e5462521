"""draft.algorithm and the algorithm seam (draftsmith.algorithms): the schema's values, the
default's params unchanged, and what each algorithm adds to the draft and its export."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
import yaml

from draftsmith import algorithms

ROOT = Path(__file__).resolve().parents[1]
SCHEMA = yaml.safe_load((ROOT / "draftsmith" / "config" / "config.schema.yaml").read_text())


def test_schema_values_are_the_registry():
    prop = SCHEMA["properties"]["draft"]["properties"]["algorithm"]
    assert prop["enum"] == algorithms.names()
    assert prop["default"] == algorithms.DEFAULT == "eagle3"
    assert prop["x-omit-default"] is True
    for name in algorithms.names():
        assert algorithms.get(name).name == name
    with pytest.raises(algorithms.AlgorithmError, match="draft.algorithm 'medusa'"):
        algorithms.get("medusa")


def test_the_default_algorithm_stales_nothing():
    """draft.algorithm at its default is left out of the train job's params (the draft built
    before the key existed is the one built now); eagle3.1 is in them."""
    from draftsmith.config.checks import neutral_defaults, sections_json

    neutral = neutral_defaults(SCHEMA)
    assert neutral["draft"]["algorithm"] == "eagle3"
    draft = {"vocab_size": 4096, "init_from_target": True, "serve_check": "warn"}
    before = sections_json({"draft": draft}, ["draft"], neutral=neutral)
    now = sections_json({"draft": {**draft, "algorithm": "eagle3"}}, ["draft"], neutral=neutral)
    assert now == before
    other = {"draft": {**draft, "algorithm": "eagle3.1"}}
    assert json.loads(sections_json(other, ["draft"], neutral=neutral))["draft"]["algorithm"] == (
        "eagle3.1"
    )
    assert algorithms.of_config({"draft": draft}).name == "eagle3"
    assert algorithms.of_config(other).name == "eagle3.1"


# ---------------------------------------------------------------------------------------------
# The draft model: fc_norm and norm_output


def tiny(algorithm: str, seed: int = 0):
    """test_model's random tiny draft, of `algorithm`."""
    from test_model import tiny_draft

    return tiny_draft(seed, algorithm)


def test_eagle3_draft_is_unchanged_and_eagle31_adds_fc_norm():
    from draftsmith.algorithms.eagle3.model import DraftConfig, Eagle3Draft

    plain, new = tiny("eagle3"), tiny("eagle3.1")
    extra = set(new.state_dict()) - set(plain.state_dict())
    assert extra == {"fc_norm.0.weight", "fc_norm.1.weight", "fc_norm.2.weight"}
    assert "algorithm" not in plain.config.to_dict()  # the default's provenance as before
    assert new.config.to_dict()["algorithm"] == "eagle3.1"
    assert DraftConfig.from_dict(new.config.to_dict()) == new.config
    torch.manual_seed(0)
    fresh = Eagle3Draft(new.config)
    assert all(torch.equal(n.weight, torch.ones(64)) for n in fresh.fc_norm)  # ones at start
    # the switches are the config's own fields, set once from the spec (never looked up)
    assert new.config.fc_norm and new.config.norm_output and not plain.config.fc_norm
    assert "fc_norm" not in plain.config.to_dict() and new.config.to_dict()["fc_norm"] is True
    with pytest.raises(algorithms.AlgorithmError):
        algorithms.get("eagle4")
    # same seed, same parameters: eagle3's draw order is not disturbed by the new module
    torch.manual_seed(0)
    a = Eagle3Draft(plain.config)
    torch.manual_seed(0)
    b = Eagle3Draft(DraftConfig.from_dict(plain.config.to_dict()))
    assert all(torch.equal(a.state_dict()[k], b.state_dict()[k]) for k in a.state_dict())


@torch.no_grad()
def test_fc_norm_and_norm_output_are_where_the_engines_put_them():
    """project = fc(cat(fc_norm_i(chunk_i))); the state fed back is norm(out) for eagle3.1,
    out for eagle3 (the engines' llama_eagle3.py: `aux = to_logits if norm_output else to_aux`)."""
    draft = tiny("eagle3.1")
    c = draft.config
    g = torch.Generator().manual_seed(1)
    aux = torch.randn(2, 5, c.num_aux * c.target_hidden_size, generator=g)
    parts = aux.chunk(3, dim=-1)

    def rms(x, w):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + c.rms_norm_eps) * w

    normed = torch.cat([rms(x, n.weight) for x, n in zip(parts, draft.fc_norm, strict=True)], -1)
    torch.testing.assert_close(draft.project(aux), normed @ draft.fc.weight.T)
    out = torch.randn(2, 5, c.hidden_size, generator=g)
    torch.testing.assert_close(draft.feedback(out), rms(out, draft.norm.weight))
    assert torch.equal(tiny("eagle3").feedback(out), out)


@pytest.mark.parametrize("algorithm", ["eagle3", "eagle3.1"])
@torch.no_grad()
def test_ttt_steps_equal_the_decoders_chain(algorithm):
    """Train what is served: the TTT unroll (TTTCache, step j fed `feedback` of step j-1) at the
    last position equals the in-process decoder's chain (KVCache: extend, then one token per
    step), step by step, for both algorithms."""
    from draftsmith.algorithms.eagle3.model import KVCache, TTTCache, block_causal_mask

    draft = tiny(algorithm, seed=2)
    c = draft.config
    g = torch.Generator().manual_seed(3)
    t, steps = 7, 3
    aux = torch.randn(1, t, c.num_aux * c.target_hidden_size, generator=g)
    emb = torch.randn(1, t + steps, c.hidden_size, generator=g)  # embeds of tokens 1..t+steps
    cache = TTTCache(block_causal_mask(torch.zeros(1, t, dtype=torch.long)))
    hidden, ttt = draft.project(aux), []
    for j in range(steps):
        out = draft.step(emb[:, j : j + t], hidden, torch.arange(j, j + t)[None], cache)
        ttt.append(draft.logits(out[:, -1]))
        hidden = draft.feedback(out)
    kv = KVCache()
    out = draft.step(emb[:, :t], draft.project(aux), torch.arange(t)[None], kv)[:, -1:]
    chain = [draft.logits(out[:, -1])]
    for j in range(1, steps):
        pos = torch.tensor([[t - 1 + j]])
        out = draft.step(emb[:, t - 1 + j : t + j], draft.feedback(out), pos, kv)
        chain.append(draft.logits(out[:, -1]))
    for j in range(steps):
        torch.testing.assert_close(ttt[j], chain[j], rtol=1e-5, atol=1e-5)
    if algorithm == "eagle3.1":  # and the pre-norm chain would differ past step 0
        out = draft.step(emb[:, :t], draft.project(aux), torch.arange(t)[None])
        wrong = draft.step(emb[:, 1 : t + 1], out, torch.arange(1, t + 1)[None])
        assert not torch.allclose(draft.logits(wrong[:, -1]), chain[1], atol=1e-3)


@torch.no_grad()
def test_the_decoders_proposals_follow_the_algorithms_feedback():
    """draftsmith.bench.specdec.DraftRunner (the hf engine's draft side) proposes, for eagle3.1, the
    argmax chain fed the post-norm state, recomputed here without a KV cache from the whole
    sequence at every step; the pre-norm reading gives other proposals."""
    from draftsmith.algorithms.eagle3.decode import DraftRunner

    draft = tiny("eagle3.1", seed=8)
    c = draft.config
    embed = torch.nn.Embedding(c.vocab_size, c.hidden_size)
    g = torch.Generator().manual_seed(9)
    t, k = 6, 5
    aux = torch.randn(t, c.num_aux * c.target_hidden_size, generator=g) * 3
    tokens = torch.randint(0, c.vocab_size, (t,), generator=g).tolist()
    runner = DraftRunner(draft, embed, [1, 2, 3])
    runner.extend(tokens, aux)
    props = runner.propose(k)

    def chain(feed) -> list[int]:
        """Each step recomputed from scratch: the states of every earlier step are the keys."""
        ids, first, outs, out = list(tokens), draft.project(aux[None]), [], []
        for j in range(k):
            # positions < t are fed fc(aux); position t - 1 + i + 1 the previous output, fed back
            hidden = torch.cat([first, *[feed(h) for h in outs]], 1)
            full = draft.step(embed(torch.tensor([ids])), hidden, torch.arange(t + j)[None])
            outs = [full[:, t - 1 + i : t + i] for i in range(j + 1)]
            tok = int(draft.draft_to_target(draft.logits(full[0, -1]).argmax()))
            out.append(tok)
            ids.append(tok)
        return out

    assert props == chain(draft.feedback)
    assert props != chain(lambda h: h)


# ---------------------------------------------------------------------------------------------
# Export and its contract check


VERIFIER = {"name_or_path": "results/target", "architectures": ["LlamaForCausalLM"]}


def export(draft, out: Path) -> Path:
    from draftsmith.algorithms.export import export_draft

    c = draft.config
    embed = torch.randn(c.vocab_size, c.target_hidden_size)
    export_draft(draft, out, {}, embed=embed, verifier=VERIFIER)
    return out


@torch.no_grad()
def test_eagle31_export_round_trip(tmp_path):
    from safetensors.torch import load_file

    from draftsmith.algorithms.export import check_export, load_export

    draft = tiny("eagle3.1", seed=4)
    out = export(draft, tmp_path / "draft")
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["fc_norm"] is True and cfg["norm_output"] is True
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"]
    assert cfg["norm_before_residual"] is False
    names = set(load_file(str(out / "model.safetensors")))
    assert {f"fc_norm.{i}.weight" for i in range(3)} <= names
    assert not (out / "speculators").exists()  # its format would drop fc_norm / norm_output
    check_export(out)
    back = load_export(out)
    assert back.config.algorithm == "eagle3.1"
    for k, v in draft.state_dict().items():
        assert torch.equal(back.state_dict()[k], v), k
    prov = json.loads((out / "draftsmith_draft.json").read_text())
    assert prov["draft_config"]["algorithm"] == "eagle3.1"


def test_export_check_per_algorithm(tmp_path):
    """eagle3.1's fc_norm tensors pass; eagle3 still refuses them (and every unknown tensor);
    a half-switched config, a foreign switch, a missing norm or a speculators copy are refused."""
    from safetensors.torch import load_file, save_file

    from draftsmith.algorithms.export import ExportError, check_export, main

    new = export(tiny("eagle3.1", seed=5), tmp_path / "new")
    plain = export(tiny("eagle3", seed=5), tmp_path / "plain")
    main(["check", str(new)])
    w31 = load_file(str(new / "model.safetensors"))
    c31 = json.loads((new / "config.json").read_text())
    w3 = load_file(str(plain / "model.safetensors"))
    c3 = json.loads((plain / "config.json").read_text())

    def variant(name, tensors, cfg):
        d = tmp_path / name
        d.mkdir()
        save_file(tensors, str(d / "model.safetensors"))
        (d / "config.json").write_text(json.dumps(cfg))
        return d

    with pytest.raises(ExportError, match=r"fc_norm.0.weight \[64\]: SGLang's loader would skip"):
        check_export(variant("eagle3_with_fc_norm", w31, c3))
    with pytest.raises(ExportError, match="model.fc_norm.1.weight is not"):
        check_export(variant("no_norms", w3, c31))
    half = {k: v for k, v in c31.items() if k != "norm_output"}
    with pytest.raises(ExportError, match="norm_output is None: an EAGLE-3.1 draft needs"):
        check_export(variant("half", w31, half))
    with pytest.raises(ExportError, match="norm_before_fc"):
        check_export(variant("foreign", w31, {**c31, "norm_before_fc": True}))
    with pytest.raises(ExportError, match="use_aux_norm"):
        check_export(variant("legacy", w31, {**c31, "use_aux_norm": True}))
    shaped = {**w31, "fc_norm.2.weight": torch.ones(63)}
    with pytest.raises(ExportError, match=r"fc_norm.2.weight is \[63\]"):
        check_export(variant("shaped", shaped, c31))
    spec = variant("with_spec", w31, c31)
    (spec / "speculators").mkdir()
    with pytest.raises(ExportError, match="has no speculators copy"):
        check_export(spec)


def test_training_an_eagle31_draft(tmp_path):
    """The train CLI with draft.algorithm eagle3.1 trains the per-aux norms and exports a draft
    the contract check accepts as eagle3.1."""
    from safetensors.torch import load_file
    from test_train import TRAIN, make_inputs, read_metrics, train_args

    from draftsmith.algorithms.export import check_export
    from draftsmith.stages.train import main

    inputs = make_inputs(tmp_path / "in", n_shards=1, rows=8)
    cfg = {
        "train": {**TRAIN, "max_steps": 4, "epochs": 1, "checkpoint_every": 0},
        "draft": {"vocab_size": 48, "init_from_target": True, "algorithm": "eagle3.1"},
        "capture": {"aux_layer_ids": "auto"},
    }
    torch.set_num_threads(1)
    main(train_args(inputs, tmp_path / "run", json.dumps(cfg)))
    draft = tmp_path / "run" / "draft"
    check_export(draft)
    config = json.loads((draft / "config.json").read_text())
    assert config["fc_norm"] is True and config["norm_output"] is True
    weights = load_file(str(draft / "model.safetensors"))
    for i in range(3):  # trained away from their initial ones
        assert not torch.equal(weights[f"fc_norm.{i}.weight"], torch.ones(32)), i
    metrics = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert metrics and all(math.isfinite(m["loss"]) for m in metrics)
    assert not (draft / "speculators").exists()


# ---------------------------------------------------------------------------------------------
# The workflow


def train_command(*config: str) -> str:
    """The train job's shell command in `snakemake -n -p` of the embedded default (plus
    `--config` overrides)."""
    import subprocess
    import sys
    import tempfile

    with tempfile.TemporaryDirectory() as work:
        cmd = [sys.executable, "-m", "snakemake", "-n", "-p", "-s", str(ROOT / "Snakefile")]
        cmd += ["--directory", work, "--configfile", str(ROOT / "config.yaml")]
        proc = subprocess.run(
            [*cmd, *(("--config", *config) if config else ()), "--", "results/draft"],
            capture_output=True,
            text=True,
            cwd=ROOT,
            timeout=300,
        )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    lines = [ln for ln in out.splitlines() if "-m draftsmith train" in ln]
    assert len(lines) == 1, out[-3000:]
    return lines[0]


@pytest.mark.workflow
def test_workflow_plans_eagle31_and_the_default_value_changes_no_command():
    default = train_command()
    assert "algorithm" not in default
    assert train_command('draft={"algorithm": "eagle3"}') == default
    new = train_command('draft={"algorithm": "eagle3.1"}')
    assert '"algorithm": "eagle3.1"' in new and new != default


@pytest.mark.workflow
def test_workflow_refuses_an_unknown_algorithm(tmp_path):
    import subprocess
    import sys

    proc = subprocess.run(
        [sys.executable, "-m", "snakemake", "-n", "-s", str(ROOT / "Snakefile")]
        + ["--directory", str(tmp_path), "--configfile", str(ROOT / "config.yaml")]
        + ["--config", 'draft={"algorithm": "eagle4"}'],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert f"'eagle4' is not one of {algorithms.names()}" in out, out[-2000:]
