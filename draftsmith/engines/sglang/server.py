"""The SGLang server of one job, for the `sglang` engine's stages (regenerate, bench) and its
capture engine alike (`draftsmith.engines.sglang.engine`, `draftsmith.engines.sglang.capture`).

`server_spec` describes the launch: `python -m sglang.launch_server` in the job's own (the
role's) interpreter, `sglang.tp_size`, `sglang.port`, `sglang.extra_args`, the target's
`trust_remote_code`; `draftsmith.engines.server.Supervisor` runs it. `SGLangSettings` is the `sglang`
section as the engine gets it (`job.engine`, draftsmith.config.settings: every key filled, the run
settings among them from DRAFTSMITH_RUN, else at the schema's defaults).

Role `sglang-cpu` (`CPU_ROLE`, which is `draftsmith.engines.sglang.cpu.ROLE`: the one fact that switches
the CPU compatibility layer on, here and in `validate_env`'s self-check): the launcher adds the
layer's environment (`draftsmith.engines.sglang.cpu.server_env`: SGLANG_USE_CPU_ENGINE=1, its overlay
first on PYTHONPATH) and launch flags, and serves in `target.dtype` (float32 by default, as the hf
engine computes on CPU). Any other role launches stock SGLang: the overlay is never put on its
path (`draftsmith.engines.sglang.cpu` itself is constants and path helpers; it imports neither torch nor
sglang).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from draftsmith.config.settings import SGLangSettings
from draftsmith.engines.server import ServerSpec
from draftsmith.engines.sglang import cpu as sglang_cpu
from draftsmith.runtime import slurmstep
from draftsmith.runtime.lifeline import ENV as RUN_ENV
from draftsmith.runtime.serverhosts import ROOT as SERVERS

CPU_ROLE = sglang_cpu.ROLE


def server_spec(
    job,
    stage: str,
    *,
    target,
    threads: int,
    extra_args=(),
    env: dict | None = None,
    pythonpath=(),
) -> ServerSpec:
    """The SGLang server of a `stage` job (`job`: its JobSettings, draftsmith.config.settings): the
    role's interpreter (this one), `sglang.tp_size`, the port (free by default),
    `sglang.extra_args` then `extra_args`; `env` merged in and `pythonpath` entries first on the
    server's PYTHONPATH."""
    s: SGLangSettings = job.engine
    role = getattr(job, stage).role
    args = ["--tp-size", str(s.tp_size)]
    if job.target.trust_remote_code:
        args.append("--trust-remote-code")
    server_env: dict[str, str] = {}
    if role == CPU_ROLE:
        server_env = sglang_cpu.server_env(
            threads=max(1, int(threads or 1)), tp_size=int(s.tp_size)
        )
        args += [*sglang_cpu.LAUNCH_ARGS, "--dtype", job.target.dtype]
    server_env.update(env or {})
    path = [*map(str, pythonpath)]
    if path:
        rest = server_env.get("PYTHONPATH", os.environ.get("PYTHONPATH", ""))
        server_env["PYTHONPATH"] = os.pathsep.join(path + ([rest] if rest else []))
    model = str(Path(target).resolve())
    tail = [*args, *map(str, s.extra_args), *map(str, extra_args)]

    def command(port: int) -> list[str]:
        return [
            sys.executable,
            "-m",
            "sglang.launch_server",
            "--model-path",
            model,
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            *tail,
        ]

    return ServerSpec(
        name="sglang",
        command=command,
        env=server_env,
        port=int(s.port),
        startup_timeout=float(s.startup_timeout),
        port_key="sglang.port",
    )


def role_gpus(job, stage: str) -> int:
    """The GPUs a `stage` job's SGLang server holds: none on the CPU role, tp_size otherwise."""
    return 0 if getattr(job, stage).role == CPU_ROLE else int(job.engine.tp_size)


def shared_server(job) -> dict | None:
    """Where and how a range job leases its stage's shared server (draftsmith.engines.sharedserver),
    or None for a server of the job's own: `sglang.shared_server` is `run` (the rules resolve
    `auto`; a job without DRAFTSMITH_RUN has the schema's `auto`, so its own) and the job runs
    under a Snakemake process (DRAFTSMITH_JOB_PARENT: no run to share with otherwise). Segment
    mode's captures name the directory and whether they are the last (`capture_server` in the
    job's --cfg, set by draftsmith.stages.segcapture). Inside a SLURM allocation's step the
    allocation owns the server instead (draftsmith.runtime.slurmstep): the range jobs of one group
    submission share it."""
    owner = os.environ.get(RUN_ENV, "")
    if job.engine.shared_server != "run" or not owner.isdigit():
        return None
    asked = job.given.get("capture_server") or {}
    return {"dir": asked.get("dir", str(SERVERS)), "last": asked.get("last", False),
            "owner": slurmstep.allocation() or int(owner)}  # fmt: skip


def job_server(job, stage: str, spec: ServerSpec, stack, *, share: bool = True, scratch=""):
    """The server a `stage` job sends its requests to, entered on `stack`: its stage's shared
    server (`shared_server`) or one of its own (`share` False: the bench's two servers)."""
    from draftsmith.engines.sharedserver import serve

    s: SGLangSettings = job.engine
    return serve(
        spec,
        stack,
        share=shared_server(job) if share else None,
        retries=int(s.retries),
        idle_timeout=float(s.idle_timeout),
        gpus=role_gpus(job, stage),
        scratch_root=scratch,
    )
