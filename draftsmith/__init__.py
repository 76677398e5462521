"""draftsmith: a make-style build system for EAGLE-3 draft models."""

__version__ = "0.1.0"

# A job's processes end with the Snakemake process that runs the job (draftsmith/runtime/lifeline.py);
# outside a job (no DRAFTSMITH_JOB_PARENT) this does nothing.
from draftsmith.runtime.lifeline import follow_from_environment as _follow  # noqa: E402

_follow()

# A job's OpenMP wait policy (bounded spin, or PASSIVE on busy cores), set before torch is
# imported (draftsmith/runtime/threads.py); outside a job (no DRAFTSMITH_OMP=auto) this does nothing.
from draftsmith.runtime.threads import prepare as _prepare_threads  # noqa: E402

_prepare_threads()
