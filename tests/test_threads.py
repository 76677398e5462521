"""The OpenMP wait policy a job takes at start (draftsmith.runtime.threads), with faked load."""

from __future__ import annotations

import json
import subprocess
import sys
from types import SimpleNamespace

import pytest

import draftsmith.runtime.threads as threads
from draftsmith.runtime.threads import SPINCOUNT, choose, policy_note, prepare, settings


@pytest.fixture
def probe(monkeypatch):
    """prepare() as before torch loads, with the probe reporting `load.cores` of other work."""
    load = SimpleNamespace(cores=0.0, calls=0)

    def fake(seconds=threads.PROBE_S):
        load.calls += 1
        return load.cores

    monkeypatch.setattr(threads, "other_cores", fake)
    monkeypatch.setattr(threads, "sys", SimpleNamespace(modules={}))
    monkeypatch.setattr(threads.os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    return load


def job(**extra) -> dict:
    return {"DRAFTSMITH_OMP": "auto", "OMP_NUM_THREADS": "2", **extra}


def test_free_cores_get_a_bounded_spin_that_holds_when_load_arrives_later(probe):
    """libgomp reads its settings once: a job on free cores must already wait in a way that
    gives cores back when other processes arrive mid-job, so it never keeps the unbounded
    default spin."""
    env = job()
    decision = prepare(env)
    assert decision["policy"] == "spin" and decision["spincount"] == SPINCOUNT
    assert env["GOMP_SPINCOUNT"] == str(SPINCOUNT) and "OMP_WAIT_POLICY" not in env
    assert 0 <= SPINCOUNT < 300000  # bounded, and below libgomp's own default
    assert json.loads(env[threads.DECISION]) == decision
    assert threads.ENV not in env  # children inherit the decision instead of probing again


def test_busy_cores_wait_passively_and_never_change_the_thread_count(probe):
    """The thread count changes the rounding of CPU reductions (a draft trained on 1 thread is
    not the bits of one trained on 2), so the load a job starts under may change how its threads
    wait, never how many there are: the build's bits do not depend on what runs beside it."""
    probe.cores = 2.0  # both cores busy
    env = job()
    decision = prepare(env)
    assert decision["policy"] == "passive" and decision["spincount"] == 0
    assert env["OMP_WAIT_POLICY"] == "PASSIVE" and "GOMP_SPINCOUNT" not in env
    assert env["OMP_NUM_THREADS"] == "2"
    probe.cores = 0.0
    env = job()
    prepare(env)
    assert env["OMP_NUM_THREADS"] == "2"


@pytest.mark.parametrize(
    ("cpus", "others", "threads_", "policy"),
    [
        (2, 0.05, 2, "spin"),
        (2, 2.0, 2, "passive"),
        (2, 1.0, 1, "spin"),  # one thread, one free core
        (2, 1.0, 2, "passive"),
        (64, 40.0, 16, "spin"),  # other jobs on other cores
        (64, 56.0, 16, "passive"),
        (2, None, 2, "spin"),  # not measurable: the bounded spin holds either way
    ],
)
def test_the_policy_follows_the_load_at_start(cpus, others, threads_, policy):
    assert choose(cpus, others, threads_)["policy"] == policy


def test_the_decision_says_why():
    assert choose(64, 56.0, 16) == {
        "policy": "passive",
        "spincount": 0,
        "others": 56.0,
        "why": "56.00 of 64 cores busy with other work",
    }
    assert choose(2, 0.5, 1, spins=300) == {
        "policy": "spin",
        "spincount": 300,
        "others": 0.5,
        "why": "1.50 of 2 cores free for 1 threads",
    }
    assert settings(choose(2, 0.0, 2, spins=42)) == {"GOMP_SPINCOUNT": "42"}
    assert settings(choose(2, 2.0, 2)) == {"OMP_WAIT_POLICY": "PASSIVE"}


def test_our_spin_count_variable_replaces_the_constant(probe):
    env = job(DRAFTSMITH_SPINCOUNT="2500")
    assert prepare(env)["spincount"] == 2500 and env["GOMP_SPINCOUNT"] == "2500"
    env = job(DRAFTSMITH_SPINCOUNT="0")  # sleep at once on free cores too
    assert prepare(env)["spincount"] == 0 and env["GOMP_SPINCOUNT"] == "0"
    probe.cores = 2.0  # busy cores: passive whatever the spin count
    env = job(DRAFTSMITH_SPINCOUNT="2500")
    assert prepare(env)["policy"] == "passive" and "GOMP_SPINCOUNT" not in env
    for bad in ("lots", "-5", "1e4"):
        with pytest.raises(ValueError, match="DRAFTSMITH_SPINCOUNT"):
            prepare(job(DRAFTSMITH_SPINCOUNT=bad))


def test_the_user_and_the_outside_of_a_job_keep_libgomp_as_it_is(probe):
    for env in (
        {},
        {"DRAFTSMITH_OMP": "off"},
        job(OMP_WAIT_POLICY="ACTIVE"),
        job(GOMP_SPINCOUNT="300000"),
    ):
        before = dict(env)
        assert prepare(env) is None and env == before
    assert probe.calls == 0  # nothing probed


def test_too_late_once_torch_is_loaded(monkeypatch, probe):
    monkeypatch.setattr(threads, "sys", SimpleNamespace(modules={"torch": object()}))
    env = job()
    assert prepare(env) is None and "GOMP_SPINCOUNT" not in env


def test_the_log_line_names_the_policy():
    spin = json.dumps(choose(2, 0.0, 2, spins=10000))
    note = policy_note({threads.DECISION: spin})
    assert note.startswith("OpenMP spin 10000 then sleep (GOMP_SPINCOUNT), thread count kept")
    busy = {threads.DECISION: '{"policy": "passive", "why": "busy"}'}
    assert policy_note(busy) == "OpenMP PASSIVE, thread count kept: busy"
    assert policy_note({}) == ""


def test_a_job_process_exports_the_decision_before_torch_loads():
    """End to end in a fresh interpreter: importing draftsmith in a job sets libgomp's
    environment before torch is imported (the probe is real here; either outcome is right)."""
    code = (
        "import os, json, draftsmith; "
        "print(json.dumps({k: os.environ.get(k) for k in "
        "('OMP_WAIT_POLICY', 'GOMP_SPINCOUNT', 'DRAFTSMITH_OMP_DECISION', 'OMP_NUM_THREADS')}))"
    )
    env = {"PATH": "/usr/bin:/bin", "DRAFTSMITH_OMP": "auto", "OMP_NUM_THREADS": "2"}
    env["PYTHONPATH"] = str(threads.__file__).rsplit("/draftsmith/", 1)[0]
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    got = json.loads(out.stdout)
    decision = json.loads(got["DRAFTSMITH_OMP_DECISION"])
    assert got["OMP_NUM_THREADS"] == "2"
    if decision["policy"] == "spin":
        assert got["GOMP_SPINCOUNT"] == str(decision["spincount"])
        assert got["OMP_WAIT_POLICY"] is None
    else:
        assert got["OMP_WAIT_POLICY"] == "PASSIVE" and got["GOMP_SPINCOUNT"] is None
