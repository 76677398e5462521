"""Activation of the compatibility layer inside an SGLang process (run by the overlay).

`activate()` is called by `overlay/sitecustomize.py` at interpreter start-up, so it runs in the
server's main process and in every worker SGLang spawns (scheduler, detokenizer: same
PYTHONPATH). It does two things and imports nothing from sglang itself:

1. declares the `torchvision::nms` / `torchvision::qnms` operator schemas, which the registry's
   torchvision wheel (a CUDA build whose compiled ops cannot load next to CPU torch) would
   otherwise miss when its Python part registers fake kernels for them at import;
2. installs a post-import hook: when SGLang's `torch_native_backend` or `draft_utils` module has
   been executed, `draftsmith.engines.sglang.cpu.attention.install` patches it (EAGLE support); when
   its DeepSeek attention registry has, `draftsmith.engines.sglang.cpu.mla.register` adds
   `torch_native` to it (MLA targets); when its MLA draft's model file has,
   `draftsmith.engines.sglang.cpu.mla.install_draft` drops the draft's CUDA synchronize (MLA drafts).
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys

TORCHVISION_SCHEMAS = {
    "torchvision::nms": "(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
    "torchvision::qnms": "(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
}
MLA_REGISTRY = "sglang.srt.models.deepseek_common.attention_backend_handler"
MLA_DRAFT = "sglang.srt.models.kimi_k25_eagle3"
PATCHED_MODULES = (
    "sglang.srt.layers.attention.torch_native_backend",
    "sglang.srt.speculative.draft_utils",
    MLA_REGISTRY,
    MLA_DRAFT,
)


def declare_torchvision_ops() -> list[str]:
    """Define the schemas that are not defined yet; returns the ones defined here."""
    import torch

    defined = []
    for name, schema in TORCHVISION_SCHEMAS.items():
        if _has_schema(name):
            continue
        torch.library.define(name, schema)  # torch.library keeps the registration alive
        defined.append(name)
    return defined


def _has_schema(name: str) -> bool:
    import torch

    try:
        torch._C._dispatch_find_schema_or_throw(name, "")
    except RuntimeError:
        return False
    return True


def _patch(name: str, module) -> None:
    if name == MLA_REGISTRY:
        importlib.import_module("draftsmith.engines.sglang.cpu.mla").register(module)
        return
    if name == MLA_DRAFT:
        importlib.import_module("draftsmith.engines.sglang.cpu.mla").install_draft(module)
        return
    attention = importlib.import_module("draftsmith.engines.sglang.cpu.attention")
    if not hasattr(attention, "install"):
        return  # attention itself is importing torch_native_backend; it installs when done
    attention.install(module if name.endswith("draft_utils") else None)


class _Loader(importlib.abc.Loader):
    """Runs the real loader, then patches the fresh module."""

    def __init__(self, name: str, loader):
        self.name, self.loader = name, loader

    def __getattr__(self, name):  # get_source, get_code, is_package, ...: the real loader's
        return getattr(self.loader, name)

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module):
        self.loader.exec_module(module)
        _patch(self.name, module)


class PostImportFinder(importlib.abc.MetaPathFinder):
    """Finds `PATCHED_MODULES` through the other finders and wraps their loaders."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname not in PATCHED_MODULES:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None and spec.loader is not None:
                spec.loader = _Loader(fullname, spec.loader)
                return spec
        return None


def activate() -> None:
    """Idempotent: one finder per process; modules already imported are patched now."""
    declare_torchvision_ops()
    if not any(isinstance(f, PostImportFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, PostImportFinder())
    for name in PATCHED_MODULES:
        if name in sys.modules:
            _patch(name, sys.modules[name])
