"""A Triton kernel module of kernels/ loaded by its path (each imports only torch and triton), so the GPU
benchmark scripts run on a device where the package is not installed."""

from __future__ import annotations

import importlib.util
import os
import sys
from types import ModuleType


def load_kernel(name: str) -> ModuleType:
    """kernels/<name>.py as the module `name`."""
    here = os.path.dirname(os.path.abspath(__file__))
    return load_kernel_file(os.path.join(here, "..", "kernels", f"{name}.py"), name)


def load_kernel_file(path: str, name: str) -> ModuleType:
    """The kernel module at `path` as the module `name` (registered in sys.modules: dataclasses resolve their
    annotations through it), e.g. another version of a kernel to time beside this one."""
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module
