"""The pure parts of benchmarks/bench_algorithms.py: per-run figures, the summary over seeds,
ratios against EAGLE-3, the run configs and the markdown (no training, no workflow)."""

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "benchmarks")]

import bench_algorithms as ba  # noqa: E402


def run(algo, seed, tau, speed=1.0, tps=100.0, acc=(0.5, 0.2)):
    sets = {"heldout": {"tau": tau, "accept_rate_by_pos": list(acc)}}
    fig = {f: None for f in ba.FIGURES}
    fig.update(heldout_tau=tau, heldout_speedup=speed, train_tokens_per_s=tps, final_loss=9.0)
    return {"algorithm": algo, "seed": seed, "figures": fig, "sets": sets}


def test_figures_of_reads_the_report_and_the_training_rate():
    report = {"sets": {"heldout": {"tau": 1.3, "speedup": 0.9}}}
    metrics = [
        {"tokens": 100, "tokens_per_s": 50.0, "loss": 12.0},
        {"tokens": 300, "tokens_per_s": 100.0, "loss": 10.0},
    ]
    fig = ba.figures_of(report, metrics)
    assert fig["train_tokens_per_s"] == pytest.approx(400 / 5.0)  # 2 s + 3 s of steps
    assert fig["final_loss"] == 10.0
    assert (fig["heldout_tau"], fig["heldout_speedup"]) == (1.3, 0.9)
    assert fig["humaneval_tau"] is None and fig["humaneval_speedup"] is None


def test_summary_means_spreads_and_ratios_against_eagle3():
    runs = [
        run("eagle3", 0, 1.2, acc=(0.4, 0.2)),
        run("eagle3", 1, 1.4, acc=(0.6, 0.4)),
        run("dflash", 0, 1.5, tps=50.0, acc=(0.7, 0.1, 0.0)),
    ]
    s = ba.summarize(runs)
    e = s["eagle3"]["figures"]["heldout_tau"]
    assert e["mean"] == pytest.approx(1.3) and e["sd"] == pytest.approx(0.1414213, rel=1e-5)
    assert (e["min"], e["max"], e["n"]) == (1.2, 1.4, 2)
    d = s["dflash"]
    assert d["figures"]["heldout_tau"]["sd"] is None  # one seed: no spread
    assert d["ratio_to_eagle3"]["heldout_tau"] == pytest.approx(1.5 / 1.3)
    assert d["ratio_to_eagle3"]["train_tokens_per_s"] == pytest.approx(0.5)
    assert d["ratio_to_eagle3"]["humaneval_tau"] is None  # not measured: no ratio
    assert s["eagle3"]["ratio_to_eagle3"]["heldout_tau"] == pytest.approx(1.0)
    assert s["eagle3"]["accept_by_pos"]["heldout"] == pytest.approx([0.5, 0.3])
    assert s["eagle3"]["accept_by_pos"]["humaneval"] is None
    assert s["eagle3"]["seeds"] == [0, 1]


def test_no_ratio_without_an_eagle3_run():
    s = ba.summarize([run("eagle3.1", 0, 1.3)])
    assert s["eagle3.1"]["ratio_to_eagle3"]["heldout_tau"] is None


def test_runs_differ_only_in_algorithm_and_seed():
    args = ba.parse_args(["--max-steps", "60", "--heldout", "8", "--seeds", "0", "1"])
    a, b = ba.run_config(args, "eagle3", 0), ba.run_config(args, "dflash", 1)
    parsed = [dict(kv.split("=", 1) for kv in c) for c in (a, b)]
    pa, pb = ({k: json.loads(v) for k, v in p.items()} for p in parsed)
    assert pa["draft"] == {"algorithm": "eagle3"} and pb["draft"] == {"algorithm": "dflash"}
    assert pa["train"] == {"seed": 0, "max_steps": 60} and pb["train"]["seed"] == 1
    assert pa["bench"] == pb["bench"] and pa["bench"]["heldout_size"] == 8
    # acceptance is compared at one K, not at the workflow's default (1 caps tau at 2)
    assert pa["bench"]["num_steps"] == ba.BENCH_K == 2
    k3 = ba.run_config(ba.parse_args(["--num-steps", "3"]), "eagle3", 0)
    assert json.loads(dict(kv.split("=", 1) for kv in k3)["bench"])["num_steps"] == 3


def test_a_variant_adds_its_draft_and_train_keys_but_never_its_own_seed():
    """bench_training_choices' variants set keys of both sections; the run's seed and step
    budget are the benchmark's, whatever the variant says."""
    args = ba.parse_args(["--max-steps", "60"])
    c = ba.run_config(args, "eagle3", 2, {"init_layer_from_target": True},
                      {"noise_std": 0.05, "seed": 9, "max_steps": 1})  # fmt: skip
    parsed = {k: json.loads(v) for k, v in (kv.split("=", 1) for kv in c)}
    assert parsed["draft"] == {"algorithm": "eagle3", "init_layer_from_target": True}
    assert parsed["train"] == {"noise_std": 0.05, "seed": 2, "max_steps": 60}


def test_markdown_states_budget_load_and_every_run():
    runs = [run("eagle3", 0, 1.25), run("eagle3.1", 0, 1.3)]
    for r in runs:
        r.update(wall_s=300.0, loadavg_1min_before=2.0, loadavg_1min_after=3.5, train_steps=60)
        r["method"] = "chain"
    r = {
        "machine": {
            "cpu": "Xeon",
            "cpu_facts": {"kind": "AVX512-AMX"},
            "cores": 2,
            "torch": "2",
            "git_commit": "abc",
            "git_dirty": False,
        },
        "data_note": "built.",
        "budget": {
            "max_steps": 60,
            "default_steps": 370,
            "heldout": 8,
            "humaneval": 4,
            "max_new_tokens": 32,
            "seeds": [0],
            "planned": 3,
        },
        "runs": runs,
        "summary": ba.summarize(runs),
        "load_range": (2.0, 3.5),
    }
    md = ba.render_md(r)
    assert "train.max_steps 60" in md and "2 of 3 planned" in md and "2.0 to 3.5" in md
    assert "| eagle3.1 | 1 | 1.300 |" in md and "| 1.040 |" in md  # tau and its ratio


def test_thread_choices_reads_each_jobs_first_thread_line(tmp_path):
    (tmp_path / "logs" / "bench").mkdir(parents=True)
    (tmp_path / "logs" / "train.log").write_text(
        "draftsmith train: python -m draftsmith train-rank --threads 2\n"
        "2026-12-02 10:47:12,067 draftsmith INFO threads: OpenMP PASSIVE, threads capped at 1\n"
        "2026-12-02 10:49:12,067 draftsmith INFO threads: later line\n"
    )
    got = ba.thread_choices(tmp_path)
    assert got == {"train": "OpenMP PASSIVE, threads capped at 1", "bench": None}


def test_merge_adds_missing_runs_of_the_same_budget_only():
    budget = {"max_steps": 60, "heldout": 8, "humaneval": 0, "max_new_tokens": 32}
    r = {"budget": {**budget, "seeds": [0], "planned": 3}, "data": {}, "runs": []}
    r["runs"] = [run("eagle3", 0, 1.2), run("dflash", 0, 1.1)]
    o = {"budget": {**budget, "seeds": [1], "planned": 1}, "data": {"x": 1}}
    o["runs"] = [run("dflash", 1, 1.0), run("dflash", 0, 9.9)]  # dflash 0: r's is kept
    ba.merge(r, [o])
    assert [(x["algorithm"], x["seed"]) for x in r["runs"]] == [
        ("eagle3", 0),
        ("dflash", 0),
        ("dflash", 1),
    ]
    assert r["runs"][1]["figures"]["heldout_tau"] == 1.1
    assert r["budget"]["seeds"] == [0, 1] and r["budget"]["planned"] == 6
    o["budget"]["max_steps"] = 120
    with pytest.raises(SystemExit, match="another budget"):
        ba.merge(r, [o])
    # a file without num_steps ran at BENCH_K: it merges with K = 2, not with K = 1
    o["budget"] = {**budget, "seeds": [2], "planned": 1, "num_steps": 2}
    ba.merge(r, [o])
    o["budget"]["num_steps"] = 1
    with pytest.raises(SystemExit, match="another budget"):
        ba.merge(r, [o])


def test_add_replaces_a_run_of_the_same_variant_and_seed_and_refuses_another_budget(
    tmp_path, monkeypatch
):
    import bench_training_choices as tc

    budget = {"max_steps": 0, "heldout": 16, "humaneval": 8, "max_new_tokens": 64}
    old = [{"variant": "baseline", "seed": s, "old": True} for s in (0, 1)]
    r = {"budget": {**budget, "seeds": [0, 1], "planned": 2}, "runs": old}
    (tmp_path / "n.json").write_text(json.dumps(r))
    monkeypatch.setattr(tc, "measure", lambda a, b, v, s: {"variant": v, "seed": s})
    saved = []
    monkeypatch.setattr(tc, "write", lambda r, out, name: saved.append(json.loads(json.dumps(r))))
    args = tc.parse_args(["--add", "--variants", "baseline", "--seeds", "1", "2"])
    tc.add_runs(args, tmp_path, "n")
    runs = saved[-1]["runs"]
    assert sorted((x["variant"], x["seed"], "old" in x) for x in runs) == [
        ("baseline", 0, True), ("baseline", 1, False), ("baseline", 2, False)
    ]  # fmt: skip
    assert saved[-1]["budget"]["seeds"] == [0, 1, 2] and saved[-1]["budget"]["planned"] == 3
    with pytest.raises(SystemExit, match="budget"):
        tc.add_runs(tc.parse_args(["--add", "--heldout", "4"]), tmp_path, "n")
    # the file has no num_steps: its runs were at K = 2, so K = 1 runs do not join them
    with pytest.raises(SystemExit, match="budget"):
        tc.add_runs(tc.parse_args(["--add", "--num-steps", "1"]), tmp_path, "n")


def test_the_larger_run_reads_sharegpt_rows_and_says_so(tmp_path):
    """--sharegpt: the base's config sections (the file's rows, max_length, epochs), refused
    naming a missing file; the results file's words name the rows the base was built from."""
    import bench_training_choices as tc

    assert tc.larger_config(tc.parse_args([])) is None
    missing = tmp_path / "none.json"
    with pytest.raises(SystemExit, match=str(missing)):
        tc.larger_config(tc.parse_args(["--sharegpt", str(missing)]))
    src = tmp_path / "sg.json"
    src.write_text("[]")
    args = tc.parse_args(["--sharegpt", str(src), "--rows", "100", "--epochs", "2"])
    cfg = tc.larger_config(args)
    assert cfg == {
        "data": {
            "sources": [{"format": "sharegpt", "path": str(src), "max_rows": 100}],
            "max_length": 256,
        },
        "train": {"epochs": 2},
    }
    words = tc.data_words({"config": cfg})
    assert "first 100 valid rows of sg.json" in words and "train.epochs 2" in words
    assert "bundled" in tc.data_words({})


def test_the_results_name_each_runs_nice_level():
    import bench_training_choices as tc

    r = {"runs": [{"variant": "baseline", "nice": 19}, {"variant": "a", "nice": 19}]}
    assert tc.nice_words(r) == "the runs at nice 19"
    r["runs"].append({"variant": "b", "nice": 0})
    assert tc.nice_words(r) == "the runs at nice 19 (baseline, a), 0 (b)"
