"""CPU facts -> precision (train.precision auto), with the capability faked; the load verdict."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from draftsmith.runtime.hardware import CpuFacts, bf16_warning, cpu_facts, resolve_precision
from draftsmith.runtime.load import LoadMeter, verdict


def facts(capability="AVX512", avx512_bf16=False, amx=False, cap=""):
    return CpuFacts("test cpu", capability, avx512_bf16, amx, cap)


XEON_AMX = facts(avx512_bf16=True, amx=True)
EPYC_AVX2 = facts(capability="AVX2")
SKYLAKE = facts()  # AVX512 without bf16 dot products
COOPER = facts(avx512_bf16=True)


@pytest.mark.parametrize(
    "cpu, want, kind",
    [
        (XEON_AMX, "bf16", "AVX512-AMX"),
        (COOPER, "bf16", "AVX512-BF16"),
        (SKYLAKE, "fp32", "AVX512"),
        (EPYC_AVX2, "fp32", "AVX2"),
        # bf16 hardware, but ATen lowered to AVX2 (ATEN_CPU_CAPABILITY=avx2)
        (facts(capability="AVX2", avx512_bf16=True, amx=True), "fp32", "AVX2"),
        # bf16 hardware, but oneDNN capped below bf16 (ONEDNN_MAX_CPU_ISA=AVX2)
        (facts(avx512_bf16=True, amx=True, cap="AVX2"), "fp32", "AVX512"),
        (facts(avx512_bf16=True, amx=True, cap="avx512_core_amx"), "bf16", "AVX512-AMX"),
        (facts(capability="DEFAULT"), "fp32", "DEFAULT"),
    ],
)
def test_auto_resolves_from_the_capability(cpu, want, kind):
    got, why = resolve_precision("auto", "cpu", cpu)
    assert got == want and cpu.kind == kind
    assert why.startswith("auto on CPU " + kind)


def test_explicit_precision_is_kept_with_a_warning_where_bf16_is_emulated():
    assert resolve_precision("fp32", "cpu", XEON_AMX)[0] == "fp32"
    got, why = resolve_precision("bf16", "cpu", EPYC_AVX2)
    assert got == "bf16" and "WARNING" in why and "emulated" in why
    got, why = resolve_precision("bf16", "cpu", XEON_AMX)
    assert got == "bf16" and "WARNING" not in why


def test_gpu_is_bf16_unless_fp32_is_asked():
    assert resolve_precision("auto", "cuda", EPYC_AVX2)[0] == "bf16"
    assert resolve_precision("fp32", "cuda", EPYC_AVX2)[0] == "fp32"
    with pytest.raises(ValueError, match="train.precision 'fp16'"):
        resolve_precision("fp16", "cpu", XEON_AMX)


def test_bf16_copy_warning_names_the_key():
    assert bf16_warning("float32", EPYC_AVX2, "regenerate.dtype") is None
    assert bf16_warning("bfloat16", XEON_AMX, "regenerate.dtype") is None
    msg = bf16_warning("bfloat16", EPYC_AVX2, "regenerate.dtype")
    assert "regenerate.dtype" in msg and "AVX2" in msg


def test_this_machine_reads_consistently(monkeypatch):
    """The real facts: ATEN_CPU_CAPABILITY is what torch reads; ONEDNN_MAX_CPU_ISA is read
    per call, so a capped oneDNN never counts as native bf16."""
    real = cpu_facts()
    assert real.capability and real.model
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
    assert cpu_facts().native_bf16 is False
    assert set(real.as_dict()) >= {"kind", "native_bf16", "capability", "amx", "avx512_bf16"}


def test_load_verdict():
    same = {"measured": True, "cpus": 2, "other_work_cores": {"spec": 0.05, "base": 0.1}}
    assert verdict(same, "spec", "base", 2) == {
        "comparable": True,
        "loaded": False,
        "why": "other work 0.05 cores during spec, 0.10 during base (2 threads used)",
    }
    changed = {"measured": True, "cpus": 2, "other_work_cores": {"spec": 1.2, "base": 0.1}}
    v = verdict(changed, "spec", "base", 2)
    assert v["comparable"] is False and "load changed" in v["why"]
    busy = {"measured": True, "cpus": 2, "other_work_cores": {"spec": 1.9, "base": 1.8}}
    assert verdict(busy, "spec", "base", 2)["loaded"] is True
    assert verdict({"measured": False}, "spec", "base", 2)["comparable"] is None


def test_load_meter_sees_other_work():
    """A busy child process is this process's descendant: its CPU time is ours, not other
    work; the meter's other-work figure stays below the cores of the machine."""
    import subprocess
    import sys

    meter = LoadMeter()
    with meter.phase("x"):
        subprocess.run([sys.executable, "-c", "sum(range(3_000_000))"], check=True)
    s = meter.summary()
    if not s["measured"]:
        pytest.skip("no /proc/stat")
    assert 0.0 <= s["other_work_cores"]["x"] <= s["cpus"]


def test_thread_policy_follows_the_load_at_start():
    from draftsmith.runtime.threads import choose, policy_note, prepare

    assert choose(2, 0.05, 2)["policy"] == "spin"
    assert choose(2, 2.0, 2)["policy"] == "passive"
    assert choose(2, 1.0, 1)["policy"] == "spin"  # one thread, one free core
    assert choose(64, 40.0, 16)["policy"] == "spin"  # other jobs on other cores
    assert choose(64, 56.0, 16) == {
        "policy": "passive",
        "others": 56.0,
        "why": "56.00 of 64 cores busy with other work",
    }
    assert choose(2, None, 2)["policy"] == "spin"
    # only in a job (DRAFTSMITH_OMP=auto), never over the user's own settings
    assert prepare({}) is None
    assert prepare({"DRAFTSMITH_OMP": "auto", "OMP_WAIT_POLICY": "ACTIVE"}) is None
    env = {"DRAFTSMITH_OMP_DECISION": '{"policy": "passive", "why": "busy"}'}
    assert policy_note(env) == "OpenMP PASSIVE, thread count kept: busy"
    assert policy_note({}) == ""


def test_busy_cores_change_the_wait_policy_never_the_thread_count(monkeypatch):
    """The thread count changes the rounding of CPU reductions (a draft trained on 1 thread is
    not the bits of one trained on 2), so the load a job starts under may change how its threads
    wait, never how many there are: the build's bits do not depend on what runs beside it."""
    import draftsmith.runtime.threads as threads

    monkeypatch.setattr(threads, "other_cores", lambda seconds=0.3: 2.0)  # both cores busy
    monkeypatch.setattr(threads, "sys", SimpleNamespace(modules={}))  # as before torch loads
    env = {"DRAFTSMITH_OMP": "auto", "OMP_NUM_THREADS": "2"}
    decision = threads.prepare(env)
    assert decision["policy"] == "passive"
    assert env["OMP_WAIT_POLICY"] == "PASSIVE" and env["OMP_NUM_THREADS"] == "2"
