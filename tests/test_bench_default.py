"""benchmarks/bench_default.py on a synthetic finished run: benchmark files, counts, rates."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import bench_default as bd  # noqa: E402

# the header and a row exactly as Snakemake 9 writes a benchmark: file
HEADER = "s\th:m:s\tmax_rss\tmax_vms\tmax_uss\tmax_pss\tio_in\tio_out\tmean_load\tcpu_time\n"


def write_tsv(path: Path, seconds: float, cpu: float, rss: float) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    row = f"{seconds}\t0:00:0{int(seconds)}\t{rss}\t1314.42\t295.84\t337.68\t0.20\t0.02\t74.58"
    row += f"\t{cpu}\n"
    path.write_text(HEADER + row)


def save(path: Path, tensors: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path))


def write_json(path: Path, obj) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(obj))


def fake_run(run: Path) -> None:
    """Benchmark files of 7 jobs, and the result files whose counts the rates use."""
    jobs = run / "benchmarks" / "jobs"
    write_tsv(jobs / "regenerate" / "rows_000000-000016.tsv", 4.0, 3.5, 400.0)
    write_tsv(jobs / "regenerate" / "rows_000016-000032.tsv", 6.0, 5.5, 420.0)
    write_tsv(jobs / "capture" / "rows_000000-000016.tsv", 2.0, 1.8, 300.0)
    write_tsv(jobs / "validate_env" / "cpu.tsv", 1.0, 0.9, 200.0)
    write_tsv(jobs / "train" / "train.tsv", 5.0, 4.0, 700.0)
    write_tsv(jobs / "bench" / "bench.tsv", 3.0, 2.9, 500.0)
    write_tsv(jobs / "mystery" / "x.tsv", 0.5, 0.5, 10.0)
    res = run / "results"
    # target: body 2 x (8 x 4) = 64 params, tied embedding / lm_head 16 x 4 = 64 params
    save(
        res / "target" / "model.safetensors",
        {
            "model.embed_tokens.weight": torch.zeros(16, 4),
            "model.layers.0.mlp.weight": torch.zeros(8, 4),
            "model.layers.1.mlp.weight": torch.zeros(8, 4),
        },
    )
    report = {"enabled": True, "new_tokens": 10, "prompt_tokens": 30, "decode_steps": 5}
    write_json(res / "data" / "rows_000000-000016.report.json", report)
    write_json(res / "data" / "rows_000016-000032.report.json", {**report, "decode_steps": 3})
    write_json(
        res / "hidden" / "rows_000000-000016.json", {"tokens": 100, "forward_dtype": "float32"}
    )
    write_json(res / "hidden" / "rows_000016-000032.json", {"tokens": 50})
    save(
        res / "draft" / "model.safetensors",
        {"fc.weight": torch.zeros(5, 2), "d2t": torch.zeros(3, dtype=torch.int64)},
    )
    write_json(
        res / "draft" / "draftsmith_draft.json",
        {
            "config": {"train": {"ttt_steps": 2, "precision": "bf16"}},
            "draft_config": {"hidden_size": 4, "draft_vocab_size": 3},
        },
    )
    (res / "train").mkdir()
    (res / "train" / "metrics.jsonl").write_text('{"tokens": 7}\n{"tokens": 13}\n')
    sets = {
        "heldout": {"verify_passes": 10, "baseline_tokens": 12, "prompts": 2, "tau": 1.5},
        "humaneval": {"verify_passes": 4, "baseline_tokens": 6, "prompts": 1, "tau": None},
    }
    bench = {
        "config": {"target": {"dtype": "float32"}, "bench": {"num_steps": 2}},
        "sets": sets,
        "method": "chain",
        "training": {"steps": 2, "final_loss": 1.0, "final_acc_per_pos": [0.5, None]},
    }
    write_json(res / "bench" / "report.json", bench)


def test_stage_split_sums_per_rule_and_the_remainder_is_overhead(tmp_path: Path):
    fake_run(tmp_path)
    split = bd.stage_split(tmp_path, total_s=25.0)
    st = split["stages"]
    # pipeline order, unknown rules last
    assert list(st) == ["validate_env", "regenerate", "capture", "train", "bench", "mystery"]
    assert st["regenerate"] == {"jobs": 2, "wall_s": 10.0, "cpu_s": 9.0, "max_rss_mb": 420.0}
    assert split["jobs_s"] == pytest.approx(21.5)
    assert split["overhead_s"] == pytest.approx(3.5)
    assert sum(s["wall_s"] for s in st.values()) + split["overhead_s"] == pytest.approx(25.0)
    # without the run's own wall time the total is the jobs' sum
    unmeasured = bd.stage_split(tmp_path, None)
    assert unmeasured["overhead_s"] == 0.0 and not unmeasured["total_measured"]


LOG = """\
[Sat Dec  5 20:51:00 2026]
localrule regenerate:
    jobid: 6
    wildcards: rows=rows_000000-000064
Shell command: python -m draftsmith regenerate --threads 1

[Sat Dec  5 20:51:00 2026]
localrule regenerate:
    jobid: 7
    wildcards: rows=rows_000064-000128
[Sat Dec  5 20:51:04 2026]
Finished jobid: 6 (Rule: regenerate)
[Sat Dec  5 20:51:06 2026]
Finished jobid: 7 (Rule: regenerate)
[Sat Dec  5 20:51:10 2026]
localrule train:
    jobid: 9
    threads: 2
[Sat Dec  5 20:51:20 2026]
Finished jobid: 9 (Rule: train)
"""


def test_job_timeline_gives_spans_of_jobs_side_by_side_and_their_core_seconds(tmp_path: Path):
    fake_run(tmp_path)
    (tmp_path / "snakemake.log").write_text(LOG)
    jobs = bd.job_timeline(tmp_path / "snakemake.log")
    assert {k: (j["rule"], j["end"] - j["start"], j["threads"]) for k, j in jobs.items()} == {
        6: ("regenerate", 4.0, 1), 7: ("regenerate", 6.0, 1), 9: ("train", 10.0, 2)}  # fmt: skip
    split = bd.stage_split(tmp_path, total_s=25.0)
    st = split["stages"]
    # two regenerate jobs side by side: a span of 6 s, though their job seconds sum to 10
    assert (st["regenerate"]["span_s"], st["regenerate"]["threads"]) == (6.0, 1)
    assert st["regenerate"]["core_s"] == 10.0
    assert st["train"]["core_s"] == 2 * st["train"]["wall_s"]
    assert "span_s" not in st["capture"]  # not in the log: no timeline for it
    assert split["idle_s"] == pytest.approx(25.0 - 6.0 - 10.0)
    # the rate is over the core-seconds held, in seconds of the peaks' thread count
    peaks = {"threads": 2, "gflop_s": {"fp32": 100.0, "bf16": 400.0}, "copy_gb_s": 10.0}
    rates = bd.stage_rates(split, bd.stage_work(tmp_path), peaks)
    assert rates["regenerate"]["seconds"] == pytest.approx(10.0 / 2)
    assert rates["train"]["seconds"] == pytest.approx(st["train"]["wall_s"])
    assert "| regenerate | 2 | 1 | 10.0 | 6.0 |" in bd.render_md(
        {"split": split, "machine": bd.machine(bd.git_info(tmp_path)), "peaks": peaks,
         "headline": {}, "rates": rates, "run_dir": "x", "load_before": 0, "load_after": 0})  # fmt: skip


def test_missing_benchmark_files_is_an_error_naming_the_directory(tmp_path: Path):
    with pytest.raises(SystemExit, match=str(tmp_path / "benchmarks" / "jobs")):
        bd.stage_split(tmp_path, 10.0)


def test_a_file_that_is_not_a_benchmark_file_is_named(tmp_path: Path):
    bad = tmp_path / "benchmarks" / "jobs" / "train" / "train.tsv"
    bad.parent.mkdir(parents=True)
    bad.write_text("seconds\n1.0\n")
    with pytest.raises(SystemExit, match="train.tsv: not a Snakemake benchmark file"):
        bd.stage_split(tmp_path, 10.0)


def test_work_counts_and_rates_follow_the_formulas(tmp_path: Path):
    fake_run(tmp_path)
    assert bd.target_params(tmp_path) == {"body": 64, "head": 64, "read": 128}
    work = bd.stage_work(tmp_path)
    # regenerate: 2 x body x (prompt + new) + 2 x head x new; bytes: read params x 4 B x steps
    assert work["regenerate"]["flops"] == 2 * 64 * 80 + 2 * 64 * 20
    assert work["regenerate"]["bytes"] == 128 * 4 * 8
    assert work["capture"] == {
        "dtype": "float32",
        "flops": 2 * 64 * 150,
        "formula": work["capture"]["formula"],
    }
    # train: 6 x 10 draft float params (the int d2t is not a parameter) x 20 tokens x 2 steps,
    # teacher 2 x H x K_draft x 20, teacher argmax once 2 x head x 150 shard tokens
    assert work["train"]["dtype"] == "bfloat16"
    assert work["train"]["flops"] == 6 * 10 * 20 * 2 + 2 * 4 * 3 * 20 + 2 * 64 * 150
    draft_bytes = (tmp_path / "results" / "draft" / "model.safetensors").stat().st_size
    assert work["bench"]["bytes"] == 128 * 4 * (22 + 10) + draft_bytes * 2 * 14
    split = bd.stage_split(tmp_path, 25.0)
    peaks = {"threads": 2, "gflop_s": {"fp32": 1e-6, "bf16": 1e-5}, "copy_gb_s": 1e-6}
    rates = bd.stage_rates(split, work, peaks)
    r = rates["regenerate"]
    assert r["gflop_s"] == pytest.approx(work["regenerate"]["flops"] / 10.0 / 1e9)
    assert r["compute_frac"] == pytest.approx(r["gflop_s"] / 1e-6)
    assert r["bound"] == ("compute" if r["compute_frac"] > r["bandwidth_frac"] else "bandwidth")
    assert rates["train"]["compute_frac"] == pytest.approx(rates["train"]["gflop_s"] / 1e-5)
    assert rates["bench"]["bound"] == "bandwidth" and "gflop_s" not in rates["bench"]


def test_from_run_writes_json_markdown_and_plot(tmp_path: Path, monkeypatch):
    run, out = tmp_path / "run", tmp_path / "out"
    fake_run(run)
    write_json(run / "bench_default_run.json", {"wall_s": 30.0, "load_before": 1.0})
    peaks = {"threads": 2, "gflop_s": {"fp32": 100.0, "bf16": 400.0}, "copy_gb_s": 10.0}
    monkeypatch.setattr(bd, "measure_peaks", lambda threads, min_time: peaks)
    bd.main(["--from-run", str(run), "--out", str(out), "--name", "t"])
    result = json.loads((out / "t.json").read_text())
    assert result["split"]["total_s"] == 30.0
    assert result["headline"]["sets"]["heldout"]["tau"] == 1.5
    md = (out / "t.md").read_text()
    assert "| scheduling / overhead | | 8.5 | 28.3% | - | - |" in md
    assert "| humaneval | 1 | n/a |" in md
    assert (out / "t.png").stat().st_size > 0
