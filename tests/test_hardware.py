"""CPU facts -> precision (train.precision auto), with the capability faked; the load verdict."""

from __future__ import annotations

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
    "cpu, kind",
    [
        (XEON_AMX, "AVX512-AMX"),
        (COOPER, "AVX512-BF16"),
        (SKYLAKE, "AVX512"),
        (EPYC_AVX2, "AVX2"),
        # bf16 hardware, but ATen lowered to AVX2 (ATEN_CPU_CAPABILITY=avx2)
        (facts(capability="AVX2", avx512_bf16=True, amx=True), "AVX2"),
        # bf16 hardware, but oneDNN capped below bf16 (ONEDNN_MAX_CPU_ISA=AVX2)
        (facts(avx512_bf16=True, amx=True, cap="AVX2"), "AVX512"),
        (facts(avx512_bf16=True, amx=True, cap="avx512_core_amx"), "AVX512-AMX"),
        (facts(capability="DEFAULT"), "DEFAULT"),
    ],
)
def test_the_cpu_kind_names_the_capability_and_the_bf16_hardware(cpu, kind):
    assert cpu.kind == kind


@pytest.mark.parametrize(
    "fp32_ms, bf16_ms, want",
    [(10.0, 5.7, "bf16"), (10.0, 17.5, "fp32"), (10.0, 9.8, "fp32"), (10.0, 270.0, "fp32")],
)
def test_auto_takes_what_the_probe_measured_not_the_flags(fp32_ms, bf16_ms, want):
    """AMX-like (bf16 1.75x faster), AVX512-BF16-like (0.57x), a tie (the exact precision
    stays), AVX2-like (27x slower): the same flags give whatever the measurement says."""
    from draftsmith.runtime.precision import decide

    chosen = decide(fp32_ms, bf16_ms)
    probe = {"chosen": chosen, "fp32_ms": fp32_ms, "bf16_ms": bf16_ms, "cached": False}
    got, why = resolve_precision("auto", "cpu", COOPER, lambda: probe)
    assert got == want == chosen
    assert why.startswith("auto on CPU AVX512-BF16") and f"fp32 {fp32_ms:.1f} ms" in why
    with pytest.raises(ValueError, match="needs the precision probe"):
        resolve_precision("auto", "cpu", COOPER)


def test_the_probe_gives_up_on_a_slow_bf16_and_is_cached_per_machine(tmp_path):
    from draftsmith.runtime.precision import GIVE_UP, cached_probe, trainer_shapes

    shapes = trainer_shapes({"hidden_size": 64, "intermediate_size": 128}, 3, 32, 4096)
    assert shapes["tokens"] == 1024 and shapes["linears"][0] == [192, 64]
    calls = []

    def timer(precision, shapes, limit_s=float("inf")):
        calls.append((precision, limit_s))
        return 0.010 if precision == "fp32" else 0.5  # an emulated bf16

    first = cached_probe(shapes, "test cpu", root=tmp_path, timer=timer)
    assert first["chosen"] == "fp32" and first["cached"] is False
    assert calls == [("fp32", float("inf")), ("bf16", GIVE_UP * 0.010)]
    again = cached_probe(shapes, "test cpu", root=tmp_path, timer=timer)
    assert again["cached"] is True and again["chosen"] == "fp32" and len(calls) == 2
    other = cached_probe(shapes, "another cpu", root=tmp_path, timer=timer)
    assert other["cached"] is False and len(calls) == 4  # another machine measures anew


def test_the_real_probe_is_short():
    from draftsmith.runtime.precision import BUDGET_S, measure, trainer_shapes

    shapes = trainer_shapes({"hidden_size": 576, "intermediate_size": 1536}, 3, 2048, 512)
    import time

    t0 = time.perf_counter()
    found = measure(shapes)
    assert found["chosen"] in ("fp32", "bf16") and found["fp32_ms"] > 0
    assert time.perf_counter() - t0 < 5 * BUDGET_S  # a loaded CI machine gets some slack


@pytest.mark.parametrize(
    "fp32_ms, bf16_ms, want",
    [(27.0, 8.0, "bfloat16"), (10.0, 17.5, "float32"), (10.0, 9.8, "float32")],
)
def test_regenerate_dtype_auto_takes_what_the_decode_probe_measured(fp32_ms, bf16_ms, want):
    """regenerate.dtype auto: a bf16 copy where a decode step measured faster in bf16 (this
    CPU's kind at 32 rows: 27 vs 8 ms), the target's dtype where it did not or on a tie."""
    from draftsmith.runtime.hardware import resolve_regen_dtype
    from draftsmith.runtime.precision import decide, decode_shapes

    shapes = decode_shapes({"hidden_size": 64, "vocab_size": 100, "num_attention_heads": 4}, 32)
    probe = {"chosen": decide(fp32_ms, bf16_ms), "fp32_ms": fp32_ms, "bf16_ms": bf16_ms,
             "shapes": shapes, "cached": True}  # fmt: skip
    got, why = resolve_regen_dtype("auto", "float32", "cpu", lambda: probe)
    assert got == want and "cached probe of a decode step at 32 rows" in why
    assert f"float32 {fp32_ms:.1f} ms, bfloat16 {bf16_ms:.1f} ms" in why

    def no_probe():
        raise AssertionError("an explicit value, a GPU or a bf16 target measures nothing")

    assert resolve_regen_dtype("float32", "float32", "cpu", no_probe)[0] == "float32"
    assert resolve_regen_dtype("bfloat16", "float32", "cpu", no_probe)[0] == "bfloat16"
    assert resolve_regen_dtype("auto", "float32", "cuda", no_probe)[0] == "float32"
    assert resolve_regen_dtype("auto", "bfloat16", "cpu", no_probe)[0] == "bfloat16"


def test_the_regenerate_stage_probes_its_target(tmp_path, monkeypatch):
    """The hf engine's regenerate.dtype auto, unfaked, on a small target config: measured
    once, then read from the cache (DRAFTSMITH_CACHE)."""
    import json
    from types import SimpleNamespace

    from draftsmith.engines.hf.engine import regen_dtype

    monkeypatch.setenv("DRAFTSMITH_CACHE", str(tmp_path / "cache"))
    cfg = {"hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
           "vocab_size": 500}  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    job = SimpleNamespace(
        regenerate=SimpleNamespace(dtype="auto", batch_size=8),
        target=SimpleNamespace(dtype="float32"),
    )
    first, why = regen_dtype(job, tmp_path)
    assert first in ("float32", "bfloat16") and why.startswith("auto; probe of a decode step")
    again, why = regen_dtype(job, tmp_path)
    assert again == first and why.startswith("auto; cached probe of a decode step at 8 rows")


def test_the_real_decode_probe_is_short():
    import time

    from draftsmith.runtime.precision import BUDGET_S, decode_seconds, decode_shapes, measure

    cfg = {"hidden_size": 576, "intermediate_size": 1536, "num_attention_heads": 9,
           "num_key_value_heads": 3, "vocab_size": 49152}  # fmt: skip
    shapes = decode_shapes(cfg, 32)
    assert shapes["linears"][1] == [576, 384] and shapes["linears"][-1] == [576, 49152]
    t0 = time.perf_counter()
    found = measure(shapes, decode_seconds)
    assert found["chosen"] in ("fp32", "bf16") and found["bf16_ms"] > 0
    assert time.perf_counter() - t0 < 5 * BUDGET_S


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


def test_a_job_meter_keeps_the_seconds_of_a_worker_that_ended():
    """A meter over a job's process tree (what each bench worker uses) counts a worker that
    burnt CPU and ended (and was waited for) as the job's own, so its seconds do not turn into
    other work; before, they vanished from the tree with the process."""
    import os
    import subprocess
    import sys

    from draftsmith.runtime.load import tree_cpu_seconds

    if tree_cpu_seconds(os.getpid()) is None:
        pytest.skip("no /proc")
    before = tree_cpu_seconds(os.getpid())
    # the child reports its CPU seconds as /proc counts them, in whole clock ticks (os.times):
    # time.process_time() is finer, and read against ticks it can exceed them by a tick
    child = subprocess.run(
        [sys.executable, "-c", "import os; sum(range(30_000_000)); print(sum(os.times()[:2]))"],
        check=True, capture_output=True, text=True,
    )  # fmt: skip
    burnt = tree_cpu_seconds(os.getpid()) - before
    # the child's seconds are in the tree after it ended (they were lost with it): the figure
    # the meter subtracts from the machine's, so they are not other work (whatever else runs)
    assert burnt >= float(child.stdout) > 0.1, (burnt, child.stdout)
