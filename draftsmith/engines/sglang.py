"""The `sglang` engine: the pinned SGLang server, one launch per job.

capture: `draftsmith.engines.sglang_capture` (the patched server dumps each row's states).
"""

from draftsmith.engines.sglang_capture import capture_range  # noqa: F401
