"""Prove, inside the sglang-cpu interpreter, that SGLang imports with the compatibility layer on.

Run with `draftsmith.engines.sglang.cpu.server_env()` (validate_env does so):

    python -m draftsmith sglang-selfcheck

Prints one JSON object; `problems` lists what is wrong (empty when the layer is active): the
CPU engine flag, `sgl_kernel` resolving to our overlay, SGLang's AMX path staying off, torchvision
importing, the MLA registration, the MLA draft's patch and the EAGLE patches applied to the modules SGLang loads
for speculative decoding.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def selfcheck() -> dict:
    from draftsmith.engines.sglang.cpu import OVERLAY

    out: dict = {"problems": []}
    problems = out["problems"]
    try:
        import sgl_kernel
        import sglang
        import torchvision
        from sglang.srt.layers.attention import torch_native_backend
        from sglang.srt.models import kimi_k25_eagle3
        from sglang.srt.models.deepseek_common import attention_backend_handler
        from sglang.srt.speculative import draft_utils
        from sglang.srt.utils import common
    except Exception as e:  # the message is the result
        problems.append(f"import failed: {type(e).__name__}: {e}")
        return out
    from draftsmith.engines.sglang.cpu import mla
    from draftsmith.engines.sglang.cpu.attention import MARK

    out["sglang"] = sglang.__version__
    out["torchvision"] = torchvision.__version__
    out["sgl_kernel"] = sgl_kernel.__file__
    out["is_cpu"] = bool(common.is_cpu())
    out["amx"] = bool(common.cpu_has_amx_support())
    out["patched"] = {
        "TorchNativeAttnBackend": getattr(torch_native_backend.TorchNativeAttnBackend, MARK, False),
        "DraftBackendFactory": getattr(draft_utils.DraftBackendFactory, MARK, False),
        "AttentionBackendRegistry": mla.BACKEND
        in attention_backend_handler.AttentionBackendRegistry._handlers,
        mla.DRAFT_CLASS: getattr(getattr(kimi_k25_eagle3, mla.DRAFT_CLASS), mla.MARK, False),
    }
    if not out["is_cpu"]:
        problems.append("sglang is_cpu() is false: SGLANG_USE_CPU_ENGINE=1 is not set")
    if Path(sgl_kernel.__file__).resolve().parent.parent != OVERLAY:
        problems.append(f"sgl_kernel comes from {sgl_kernel.__file__}, not from {OVERLAY}")
    if out["amx"]:
        problems.append("SGLang took its AMX kernel path, which needs compiled kernels")
    problems += [f"{k} is not patched" for k, ok in out["patched"].items() if not ok]
    return out


def main(argv: list[str] | None = None) -> None:
    argparse.ArgumentParser(
        prog="python -m draftsmith sglang-selfcheck",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    ).parse_args(argv)
    result = selfcheck()
    print(json.dumps(result))
    sys.exit(1 if result["problems"] else 0)
