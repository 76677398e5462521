"""What this machine computes fast, and the precision that follows from it.

One CPU is not another: on a Xeon with AMX a bf16 matmul at the trainer's shapes ran 1.75x
faster than fp32; on an AMD EPYC with AVX2 only it ran about 70x slower (no bf16 dot-product
instructions: oneDNN falls back to converting element by element), and with AVX512-BF16 but
no AMX 0.57x as fast. `train.precision: auto` is therefore measured (draftsmith.runtime.
precision); the facts below, the ones torch itself uses to pick its kernels, name the CPU kind
in reports and warn where a configured bf16 is emulated:

- `torch.backends.cpu.get_cpu_capability()`: the vector ISA ATen dispatches to (AVX2, AVX512,
  ...; lowered by ATEN_CPU_CAPABILITY);
- `torch.cpu._is_avx512_bf16_supported()` / `torch.cpu._is_amx_tile_supported()`: the bf16
  dot-product instructions oneDNN's bf16 matmuls need (read by cpuinfo, not from the model name);
- ONEDNN_MAX_CPU_ISA, when set, caps what oneDNN may use (AVX2 there means no native bf16 even
  on an AMX machine: the way to emulate an AVX2-only CPU on a newer one, docs/contracts/training.md).

A CUDA device always counts as native bf16 (every GPU draftsmith targets has bf16 tensor cores).
Nothing here is cached: facts are read where they are used, so a test can fake them.
"""

from __future__ import annotations

import os
import platform
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

# ONEDNN_MAX_CPU_ISA values (oneDNN's dnnl_cpu_isa_t names) that include bf16 dot products
_BF16_ISAS = (
    "AVX512_CORE_BF16",
    "AVX10_1_512",
    "AVX512_CORE_FP16",
    "AVX10_1_512_AMX",
    "AVX512_CORE_AMX",
    "AVX10_1_512_AMX_FP16",
    "AVX512_CORE_AMX_FP16",
    "ALL",
    "DEFAULT",
)


@dataclass(frozen=True)
class CpuFacts:
    """The CPU facts that decide kernel paths (all read from torch and the environment)."""

    model: str  # /proc/cpuinfo "model name", for people; never used to decide anything
    capability: str  # torch.backends.cpu.get_cpu_capability()
    avx512_bf16: bool
    amx: bool
    onednn_isa_cap: str  # ONEDNN_MAX_CPU_ISA or ""

    @property
    def native_bf16(self) -> bool:
        """bf16 matmuls run on bf16 dot-product hardware (AVX512-BF16 or AMX), as oneDNN will
        use them: the ATen capability is AVX512 (not lowered to AVX2) and no ISA cap forbids."""
        cap = self.onednn_isa_cap.upper()
        allowed = cap == "" or cap in _BF16_ISAS
        return (self.avx512_bf16 or self.amx) and self.capability.startswith("AVX512") and allowed

    @property
    def kind(self) -> str:
        """A short name of the CPU kind for file names and reports: `AVX512-AMX`,
        `AVX512-BF16`, `AVX512`, `AVX2`, ... (the capability plus what bf16 hardware it has)."""
        if not self.native_bf16:
            return self.capability.replace(" ", "_")
        return f"{self.capability}-{'AMX' if self.amx else 'BF16'}"

    def describe(self) -> str:
        bf16 = "native bf16" if self.native_bf16 else "no native bf16"
        parts = [
            f"torch capability {self.capability}",
            f"AVX512-BF16 {'yes' if self.avx512_bf16 else 'no'}",
            f"AMX {'yes' if self.amx else 'no'}",
        ]
        if self.onednn_isa_cap:
            parts.append(f"ONEDNN_MAX_CPU_ISA={self.onednn_isa_cap}")
        return f"{self.model} ({', '.join(parts)}): {bf16}"

    def as_dict(self) -> dict:
        return {**asdict(self), "native_bf16": self.native_bf16, "kind": self.kind}


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _torch_flag(name: str) -> bool:
    fn = getattr(torch.cpu, name, None)
    try:
        return bool(fn()) if fn is not None else False
    except RuntimeError:
        return False


def cpu_facts() -> CpuFacts:
    return CpuFacts(
        model=cpu_model(),
        capability=torch.backends.cpu.get_cpu_capability(),
        avx512_bf16=_torch_flag("_is_avx512_bf16_supported"),
        amx=_torch_flag("_is_amx_tile_supported"),
        onednn_isa_cap=os.environ.get("ONEDNN_MAX_CPU_ISA", ""),
    )


def resolve_precision(
    requested: str, device_type: str, facts: CpuFacts, probe: Callable[[], dict] | None = None
) -> tuple[str, str]:
    """`train.precision` -> ("bf16" | "fp32", why). `auto`: bf16 autocast on a GPU; on a CPU
    the faster of the two at the trainer's shapes, as `probe()` measured it (the cached result
    of draftsmith.runtime.precision.cached_probe), its figures in `why`. An explicit value is
    kept, with a warning in `why` when it asks for bf16 where bf16 is emulated."""
    if requested not in ("auto", "bf16", "fp32"):
        raise ValueError(f"train.precision {requested!r} is not one of auto, bf16, fp32")
    if device_type == "cuda":
        return ("fp32" if requested == "fp32" else "bf16"), f"{requested} on a GPU"
    where = f"CPU {facts.kind} ({facts.describe()})"
    if requested == "auto":
        if probe is None:
            raise ValueError("train.precision auto on a CPU needs the precision probe")
        found = probe()
        how = "cached probe" if found.get("cached") else "probe"
        return found["chosen"], (
            f"auto on {where}; {how} of the trainer's shapes: fp32 {found['fp32_ms']:.1f} ms, "
            f"bf16 {found['bf16_ms']:.1f} ms per step"
        )
    if requested == "bf16" and not facts.native_bf16:
        return "bf16", (
            f"bf16 as configured on {where}; WARNING: bf16 is emulated on this CPU and runs far "
            "slower than fp32 (train.precision auto would pick fp32)"
        )
    return requested, f"{requested} as configured on {where}"


def resolve_regen_dtype(
    requested: str, target_dtype: str, device_type: str, probe: Callable[[], dict] | None = None
) -> tuple[str, str]:
    """`regenerate.dtype` -> (torch dtype name, why). `auto` on a CPU: bfloat16 when `probe()`
    (draftsmith.runtime.precision.cached_probe at the decode shapes) measured a bf16 decode
    step faster than a float32 one, else target.dtype; on a GPU, or when the target is already
    bfloat16, target.dtype. An explicit value is kept."""
    if requested != "auto":
        return requested, f"{requested} as configured"
    if device_type != "cpu" or target_dtype == "bfloat16" or probe is None:
        return target_dtype, f"auto: target.dtype {target_dtype} on {device_type}"
    found = probe()
    how = "cached probe" if found.get("cached") else "probe"
    chosen = "bfloat16" if found["chosen"] == "bf16" else target_dtype
    return chosen, (
        f"auto; {how} of a decode step at {found['shapes']['decode_rows']} rows: float32 "
        f"{found['fp32_ms']:.1f} ms, bfloat16 {found['bf16_ms']:.1f} ms"
    )


def bf16_warning(dtype: str, facts: CpuFacts, key: str) -> str | None:
    """A warning when a configured bf16 copy (e.g. regenerate.dtype) runs on a CPU without
    native bf16; None when the choice is fine."""
    if dtype != "bfloat16" or facts.native_bf16:
        return None
    return (
        f"{key} bfloat16 on CPU {facts.kind}: bf16 is emulated here and decodes far slower than "
        f"float32 ({facts.describe()}); set {key}: float32"
    )


def announce(log, what: str, dtype: str, key: str, device: str = "cpu") -> dict:
    """Log the dtype a stage computes in and the CPU facts behind it (a warning for an emulated
    bf16); returns the facts for the stage's report."""
    if device != "cpu":
        log.info("%s: %s on %s", what, dtype, device)
        return {"device": device}
    facts = cpu_facts()
    log.info("%s: %s on CPU %s", what, dtype, facts.describe())
    warning = bf16_warning(dtype, facts, key)
    if warning:
        log.warning("%s", warning)
    return facts.as_dict()


def free_memory_bytes() -> int | None:
    """Bytes this process's processes can still take: the kernel's MemAvailable, lowered to
    what the cgroup (a SLURM or container limit, cgroup v2) leaves; None where neither is read."""
    found = []
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                found.append(int(line.split()[1]) * 1024)
    except (OSError, ValueError, IndexError):
        pass
    cgroup = Path("/sys/fs/cgroup")
    try:
        limit = (cgroup / "memory.max").read_text().strip()
        if limit != "max":
            found.append(int(limit) - int((cgroup / "memory.current").read_text()))
    except (OSError, ValueError):
        pass
    return max(0, min(found)) if found else None
