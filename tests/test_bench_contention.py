"""benchmarks/bench_contention.py's arithmetic and report, on faked timings (no job is run)."""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import bench_contention as bc  # noqa: E402


def test_policies_set_libgomp_and_the_thread_count_as_a_job_gets_them(monkeypatch):
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")  # the caller's own is never carried over
    monkeypatch.setenv("DRAFTSMITH_OMP_DECISION", "{}")
    env, t = bc.policy_env("spin", 2)
    assert "OMP_WAIT_POLICY" not in env and "GOMP_SPINCOUNT" not in env and t == 2
    assert "DRAFTSMITH_OMP_DECISION" not in env and env["OMP_NUM_THREADS"] == "2"
    env, t = bc.policy_env("spin10000", 2)
    assert env["GOMP_SPINCOUNT"] == "10000" and "OMP_WAIT_POLICY" not in env
    env, t = bc.policy_env("passive@1", 2)
    assert env["OMP_WAIT_POLICY"] == "PASSIVE" and t == 1 and env["OMP_NUM_THREADS"] == "1"
    env, _ = bc.policy_env("auto", 2)
    assert env["DRAFTSMITH_OMP"] == "auto" and "GOMP_SPINCOUNT" not in env
    for bad in ("spinning", "spin-5", "active"):
        with pytest.raises(SystemExit):
            bc.policy_env(bad, 2)


def test_rates_split_at_the_load_arrival():
    # ready at 0; 10 tokens per unit: every 0.5 s before the load arrives at 2.0, every 2 s after
    events = [{"t": 0.0, "n": 0}] + [{"t": 0.5 * i, "n": 10} for i in range(1, 5)]
    events += [{"t": 2.0 + 2 * i, "n": 10} for i in range(1, 4)]
    assert bc.rate(events, 0.0, 2.0) == pytest.approx(20.0)
    assert bc.rate(events, 2.0) == pytest.approx(5.0)
    assert bc.rate(events, 0.0) == pytest.approx(70 / 8)
    # a load arriving during a unit: timed from the end of the unit before
    assert bc.rate(events, 2.5) == pytest.approx(5.0)
    assert bc.rate(events, 9.0) is None  # nothing ended after it


@pytest.mark.parametrize(
    ("cpus", "threads", "load", "share"),
    [(2, 2, 0, 1.0), (2, 2, 2, 0.5), (2, 1, 2, 2 / 3), (2, 1, 1, 1.0), (16, 2, 2, 1.0)],
)
def test_the_fair_share_is_an_even_split_of_the_cores(cpus, threads, load, share):
    assert bc.fair_share(cpus, threads, load) == pytest.approx(share)


def rows():
    def row(policy, scenario, rate, threads=2, before=None, other=0.0):
        load = 0 if scenario == "idle" else 2
        r = {"stage": "decode", "policy": policy, "scenario": scenario, "threads": threads,
             "load": load, "rate": rate, "decision": None, "other_work": other}  # fmt: skip
        return r | ({"before": before} if scenario == "mid" else {})

    out = [
        row("spin", "idle", 100.0),
        row("spin", "mid", 5.0, before=99.0),
        row("spin", "busy", 8.0),
        row("spin10000", "idle", 95.0),
        row("spin10000", "mid", 55.0, before=94.0),
        row("spin10000", "busy", 50.0, other=0.6),
        row("auto", "idle", 95.0),
    ]
    out[-1]["decision"] = {"policy": "spin", "spincount": 10000, "others": 0.0, "why": "free"}
    bc.add_ratios(out, cpus=2)
    return out


def test_each_rate_is_against_the_default_at_load_0_and_the_fair_share():
    r = rows()
    assert [x["of_default"] for x in r[:3]] == [1.0, 0.05, 0.08]
    assert r[4]["fair_share"] == 0.5 and r[4]["of_fair"] == pytest.approx(1.1)
    assert r[1]["of_fair"] == pytest.approx(0.1)


def test_the_report_shows_the_load_arriving_mid_job_and_warns_of_other_work():
    args = SimpleNamespace(argv=["python", "benchmarks/bench_contention.py"], target_note="tiny",
                           new_tokens=32, train_tokens=512, load=2, arrive=4.0, seconds=6.0)  # fmt: skip
    facts = {"kind": "AVX512-X", "model": "a CPU", "capability": "AVX512"}
    text = bc.render(rows(), facts, args)
    assert "# OpenMP wait policies under contention (AVX512-X)" in text
    assert "| decode | spin10000 | mid | 2 | 55.0 | 94.0 | 0.55 | 0.50 | 1.10 | 0.00 |" in text
    assert "| decode | auto (spin 10000) | idle |" in text
    assert "| decode | spin10000 | 0.95 | 1.00 |" in text  # worst loaded: 1.10 mid, 1.00 busy
    assert "| decode | spin | 1.00 | 0.10 |" in text
    assert "Not a quiet machine" in text and "0.60 cores" in text


def test_quick_is_short_and_writes_beside_the_work(tmp_path):
    args = bc.parse(["--quick", "--work", str(tmp_path)])
    assert args.seconds <= 1.0 and args.out == tmp_path and len(args.policies) == 3
    args = bc.parse([])
    assert args.out == ROOT / "benchmarks" / "results"
    assert set(args.scenarios) == {"idle", "mid", "busy"} and set(args.stages) == {
        "decode",
        "train",
    }
    assert "spin" in args.policies and "passive" in args.policies and "auto" in args.policies
