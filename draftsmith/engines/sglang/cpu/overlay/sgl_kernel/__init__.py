"""`sgl_kernel` for SGLang on CPU: draftsmith's pure-PyTorch stand-ins (not SGLang's kernels).

SGLang imports these eight functions from `sgl_kernel` when SGLANG_USE_CPU_ENGINE=1; the real
package has no CPU build on the registry. See draftsmith/engines/sglang/cpu/kernels.py. There is
deliberately no `convert_weight_packed` and no `torch.ops.sgl_kernel` library, so SGLang's AMX
detection stays off and every layer takes its plain-torch path.
"""

from draftsmith.engines.sglang.cpu.kernels import *  # noqa: F403
from draftsmith.engines.sglang.cpu.kernels import __all__  # noqa: F401

DRAFTSMITH_STAND_IN = True
