"""CPU compatibility layer for the real SGLang 0.5.23 server (role `sglang-cpu` only).

SGLang's CPU engine (`SGLANG_USE_CPU_ENGINE=1`) expects SGLang's compiled CPU kernels, which the
package registry does not have (the `sgl-kernel` / `sglang-kernel` wheels are CUDA-only, the CPU
kernels a source build). This package bridges exactly four gaps, in pure Python, so the
unmodified server runs on a CPU-only machine:

1. `sgl_kernel` (overlay/sgl_kernel, code in `kernels.py`): stand-ins for the eight helpers SGLang
   imports from it on CPU: assign_req_to_token_pool_cpu, assign_extend_cache_locs_cpu,
   assign_draft_cache_locs_contiguous_cpu, fill_bonus_tokens_cpu, fill_accept_out_cache_loc_cpu,
   build_tree_kernel_efficient_cpu, verify_tree_greedy_cpu, copy_all_layer_kv_cache_cpu.
   Nothing else of sgl_kernel exists, so SGLang's AMX detection stays off and each layer takes its
   plain-torch `forward_native` path.
2. torchvision (`hook.declare_torchvision_ops`): the registry's torchvision is a CUDA build whose
   compiled ops cannot load next to CPU torch; SGLang imports it at start-up, and its Python part
   needs the `torchvision::nms` / `qnms` schemas to exist. They are declared (no kernels).
3. EAGLE / EAGLE3 with the `torch_native` attention backend (`attention.py`): the backend is added
   to the draft backend maps, with a target-verify path (tree mask for topk > 1) and a multi-step
   draft decode backend.
4. MLA targets (DeepSeek-V3, Kimi-K2.5) with `torch_native` (`mla.py`): the backend is added to
   SGLang's DeepSeek attention registry so that every batch takes the absorbed MLA path; the
   MLA draft class shares the target's embedding without its CUDA synchronize.

Everything else (HTTP server, scheduler, model classes, EAGLE worker, draft loading, acceptance
counters) is SGLang's own code. The layer is loaded into every SGLang process through
`overlay/sitecustomize.py` on PYTHONPATH (`server_env`), never by editing site-packages.
GPU runs (role `sglang`) never import this package and never get the overlay on their path.

This module itself imports neither torch nor sglang: the server launcher uses it from any role.
"""

from __future__ import annotations

import os
from pathlib import Path

from draftsmith.config.engines import EngineError

OVERLAY = Path(__file__).resolve().parent / "overlay"
ROLE = "sglang-cpu"

# Server flags the CPU role needs (the launcher adds model, port, speculative flags).
# --disable-cuda-graph: no graphs on CPU; torch_native: the only attention backend without
# compiled kernels; float32 keeps speculative output equal to plain greedy.
LAUNCH_ARGS = (
    "--device",
    "cpu",
    "--attention-backend",
    "torch_native",
    "--disable-cuda-graph",
)


BIND_ENV = "SGLANG_CPU_OMP_THREADS_BIND"

# SGLang's crash diagnostics (a py-spy dump and a CUDA core dump of the schedulers) run whenever a
# scheduler process ends before the launcher, which is how every stop of a server's process group
# looks to it; they begin with a 5-second sleep "to let GPU activity settle". On the CPU role there
# is no CUDA and no py-spy in the venv, so they are the sleep alone, paid at every stop.
NO_CRASH_DIAGNOSTICS = {
    "SGLANG_PYSPY_DUMP_BEFORE_CRASH": "0",
    "SGLANG_CUDA_COREDUMP_BEFORE_CRASH": "0",
}


def cpu_groups(cpus: list[int]) -> str:
    """One SGLANG_CPU_OMP_THREADS_BIND group: "4-7" for consecutive cores, else "1,3,5"."""
    if cpus == list(range(cpus[0], cpus[0] + len(cpus))):
        return f"{cpus[0]}-{cpus[-1]}" if len(cpus) > 1 else str(cpus[0])
    return ",".join(map(str, cpus))


def rank_threads(threads: int, tp_size: int, cpus: list[int] | None = None) -> tuple[int, str]:
    """(OMP threads per rank, SGLANG_CPU_OMP_THREADS_BIND) for `tp_size` CPU ranks that share a
    job's `threads`: each rank gets threads // tp_size threads and its own consecutive share of
    the cores this process may run on (`cpus`, default its affinity). SGLang asserts one NUMA node
    per rank unless the binding names each rank's cores, so a CPU server of more than one rank
    always gets it. EngineError (a ValueError, which every SGLang stage reports as its error)
    when a rank would have no thread or no core of its own."""
    cpus = sorted(os.sched_getaffinity(0) if cpus is None else cpus)
    if tp_size > len(cpus):
        raise EngineError(
            f"config: sglang.tp_size {tp_size} on role {ROLE}: every rank needs a core of its "
            f"own, but this process may run on {len(cpus)} core(s) ({cpu_groups(cpus)}); "
            f"lower sglang.tp_size to at most {len(cpus)}"
        )
    if tp_size > threads:
        raise EngineError(
            f"config: sglang.tp_size {tp_size} on role {ROLE}: the job's {threads} thread(s) "
            f"are shared between the ranks, one at least each; give the job {tp_size} threads "
            "(snakemake --set-threads, or the profile's set-threads) or lower sglang.tp_size"
        )
    share = len(cpus) // tp_size
    groups = [cpu_groups(cpus[r * share : (r + 1) * share]) for r in range(tp_size)]
    return threads // tp_size, "|".join(groups)


def server_env(
    base: dict[str, str] | None = None, threads: int = 1, tp_size: int = 1
) -> dict[str, str]:
    """Environment for an SGLang process of the CPU role: CPU engine on, overlay first on path,
    no crash diagnostics (NO_CRASH_DIAGNOSTICS).

    `threads` sets OMP_NUM_THREADS (1 per server is steadier on shared cores); with `tp_size` > 1
    the threads are split between the ranks and each rank is bound to its share of the cores
    (`rank_threads`), unless `base` already sets SGLANG_CPU_OMP_THREADS_BIND.
    """
    env = dict(os.environ if base is None else base)
    path = [str(OVERLAY), str(OVERLAY.parents[4])]  # the overlay, the repository root
    if env.get("PYTHONPATH"):
        path.append(env["PYTHONPATH"])
    if tp_size > 1:
        threads, bind = rank_threads(threads, tp_size)
        env.setdefault(BIND_ENV, bind)
    for key, value in NO_CRASH_DIAGNOSTICS.items():
        env.setdefault(key, value)  # a caller's own setting stands
    env.update(
        SGLANG_USE_CPU_ENGINE="1",
        PYTHONPATH=os.pathsep.join(path),
        OMP_NUM_THREADS=str(threads),
        OMP_WAIT_POLICY="PASSIVE",
    )
    return env
