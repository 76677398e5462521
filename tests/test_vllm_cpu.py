"""Fast checks of what the vLLM CPU path needs from a Kimi-K2.5-wrapped target, without vLLM:
the tiny wrapper ships what vLLM's Kimi-K2.5 class reads before it serves text
(draftsmith.targets.tinymodel.wrap_target), and the kernel-scan stand-in
(draftsmith.engines.vllm.cpu._rebind_kernels) swaps kernels where vLLM's own scan does while
skipping an object whose `__getattr__` answers `__dict__`, as llvmlite's `ffi.lib` does. The
serving itself: tests/test_served_matrix.py and tests/test_engines_mla.py (vLLM role)."""

from __future__ import annotations

import json
import shutil
import sys
import types

from draftsmith.engines.vllm import cpu as vllm_cpu
from draftsmith.targets.tinymodel import make_tiny_target, wrap_target

# what vLLM 0.32.0's fused Kimi-K2.5 image processor reads from media_proc_cfg
MEDIA_KEYS = {
    "patch_size", "merge_kernel_size", "temporal_merge_kernel_size", "image_mean", "image_std",
    "in_patch_limit", "patch_limit_on_one_side", "fixed_output_tokens",
    "in_patch_limit_each_frame", "in_patch_limit_video",
}  # fmt: skip


def test_the_tiny_kimi_wrapper_ships_what_vllm_reads(tmp_path):
    from transformers import AutoConfig

    plain = make_tiny_target(tmp_path / "plain", "deepseek_v3", num_layers=4)
    kimi = wrap_target(shutil.copytree(plain, tmp_path / "kimi"), "kimi_k25")
    media = json.loads((kimi / "preprocessor_config.json").read_text())["media_proc_cfg"]
    assert MEDIA_KEYS <= set(media) and media["patch_size"] == 14
    config = AutoConfig.from_pretrained(kimi)  # transformers' own Kimi-K2.5 config class
    assert type(config).__name__ == "Kimi_K25Config"
    assert config.tie_word_embeddings is False  # the text model's own head is served
    assert config.text_config.kv_lora_rank == AutoConfig.from_pretrained(plain).kv_lora_rank
    assert vllm_cpu.is_wrapped(kimi) and not vllm_cpu.is_wrapped(plain)
    assert not (plain / "preprocessor_config.json").exists()


class _Proxy:
    """Like llvmlite's `ffi.lib`: no instance dict, any attribute answered by __getattr__."""

    __slots__ = ("handle",)

    def __getattr__(self, name):
        return lambda *a: None


def test_kernel_scan_swaps_kernels_and_skips_proxies():
    kernel, wrapper = object(), object()

    class Owner:  # a JIT warm-up owner: the kernel as an instance attribute
        def __init__(self):
            self.kernel, self._kernel_arg_names = kernel, ("a",)

    Host = type("Host", (), {"kernel": kernel})  # a class holding the kernel
    proxy, owner = _Proxy(), Owner()
    assert hasattr(proxy, "__dict__") and not isinstance(vars(proxy), dict)  # vLLM's scan fails
    module = types.ModuleType("_draftsmith_kernel_scan_probe")
    module.copy, module.proxy, module.owner, module.Host = kernel, proxy, owner, Host
    sys.modules[module.__name__] = module
    try:
        vllm_cpu._rebind_kernels([(kernel, wrapper)])
    finally:
        del sys.modules[module.__name__]
    assert module.copy is wrapper and module.proxy is proxy
    assert owner.kernel is wrapper and "_kernel_arg_names" not in vars(owner)
    assert Host.kernel is wrapper
