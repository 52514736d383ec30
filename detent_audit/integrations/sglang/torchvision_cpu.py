"""PyPI's torchvision beside the CPU build of torch: make its pure-Python parts importable.

SGLang imports `torchvision.transforms` whatever the model (`srt/configs/__init__.py` -> the InternVL
helpers), in every process. PyPI's torchvision 0.28.0 (the release for torch 2.13.0) is a CUDA build: its
`_C.so` links `libtorch_cuda.so`, so beside the CPU torch it does not load. torchvision tolerates that
(`extension._has_ops()` is then False and every meta registration is skipped) except for two:
`_meta_registrations.py` registers fake kernels for `torchvision::nms` and `torchvision::qnms`
unconditionally, and torch refuses a fake kernel for an operator nobody defined ("operator torchvision::nms
does not exist"), so `import torchvision` fails.

The fix: before torchvision's first import in a process, define those two operator schemas (with a CPU
kernel that raises a clear error: nothing on the text path calls them). It runs from an import hook a `.pth`
file installs (`install()`), so it is in place in SGLang's spawned scheduler processes too, and costs nothing
at start-up: torch is imported only when torchvision is.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import site
import sys
from pathlib import Path

PTH_NAME = "detent_torchvision_cpu.pth"
_OPS = {
    "nms": "nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
    "qnms": "qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
}
_LIBRARY = None  # the torch.library.Library that owns the definitions (kept alive)


def _unavailable(*args, **kwargs):
    raise RuntimeError("torchvision's C++ ops are unavailable beside the CPU build of torch "
                       "(PyPI's torchvision is a CUDA build); detent-audit serves text models only")


def define_missing_ops() -> list[str]:
    """Define `torchvision::nms` and `qnms` if torchvision's own extension did not; the names defined."""
    global _LIBRARY
    import torch

    missing = [name for name in _OPS if not torch._C._dispatch_has_kernel(f"torchvision::{name}")
               and not _defined(f"torchvision::{name}")]
    if not missing:
        return []
    _LIBRARY = torch.library.Library("torchvision", "FRAGMENT")
    for name in missing:
        _LIBRARY.define(_OPS[name])
        _LIBRARY.impl(name, _unavailable, "CPU")
    return missing


def _defined(qualname: str) -> bool:
    import torch

    try:
        torch._C._dispatch_find_schema_or_throw(qualname, "")
    except RuntimeError:
        return False
    return True


class _Finder(importlib.abc.MetaPathFinder):
    """Runs `define_missing_ops` once, just before the first `import torchvision`."""

    def find_spec(self, fullname, path, target=None):
        if fullname != "torchvision":
            return None
        sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is not None and not _has_cuda_torch():
            define_missing_ops()
        return spec


def _has_cuda_torch() -> bool:
    import torch

    return torch.version.cuda is not None


def activate() -> None:
    """Install the import hook in this process (what the .pth line calls)."""
    if "torchvision" not in sys.modules and not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())


def install(site_packages: Path | None = None) -> Path:
    """Write the .pth file that activates the hook at every interpreter start of this environment."""
    folder = site_packages or Path(site.getsitepackages()[0])
    target = folder / PTH_NAME
    target.write_text("import detent_audit.integrations.sglang.torchvision_cpu as _t; _t.activate()\n")
    return target


if __name__ == "__main__":
    print(install())
