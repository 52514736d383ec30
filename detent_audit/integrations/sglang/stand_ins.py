"""The one import SGLang makes on a CPU that nothing provides: `vllm._custom_ops.rotary_embedding`.

SGLang's generic device path (neither CUDA nor its CPU engine, `--device cpu`) builds every RotaryEmbedding
with a fallback kernel from vLLM (srt/layers/rotary_embedding/base.py) that it only calls from
`forward_cuda`; on a CPU `forward_native` runs. Without vLLM installed the import fails at model build. The
stand-in is a module whose `rotary_embedding` raises if it is ever called. It is installed where no real vLLM
can be imported, and in SGLang's own child processes also where one can (`shadow_real`): there it spares the
scheduler vLLM's import, and no vLLM kernel can run in SGLang. The launcher is the caller's process, which may
use the real vLLM, so there a real vLLM is never shadowed.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import sys
import types
from collections.abc import Callable
from typing import NoReturn


class _StandIn(types.ModuleType):
    """A module made here in place of vLLM's, marked so that it is told from the real one."""

    __detent_stand_in__ = True
    rotary_embedding: Callable[..., NoReturn]
    _custom_ops: types.ModuleType


def _rotary_embedding(*args: object, **kwargs: object) -> NoReturn:
    raise RuntimeError("vLLM's rotary_embedding kernel is not available here (a stand-in): SGLang on a CPU "
                       "should run RotaryEmbedding.forward_native")


def install_stand_ins(shadow_real: bool = False) -> list[str]:
    """Install what is missing (with `shadow_real`, also over an installed vLLM not yet imported); returns the
    module names installed (idempotent)."""
    if "vllm._custom_ops" in sys.modules or "vllm" in sys.modules:
        return []
    if not shadow_real and importlib.util.find_spec("vllm") is not None:
        return []
    parent = _StandIn("vllm")
    parent.__path__ = []  # a package, so that `vllm._custom_ops` resolves
    parent.__spec__ = importlib.machinery.ModuleSpec("vllm", None, is_package=True)
    ops = _StandIn("vllm._custom_ops")
    ops.__spec__ = importlib.machinery.ModuleSpec("vllm._custom_ops", None)
    ops.rotary_embedding = _rotary_embedding
    parent._custom_ops = ops
    sys.modules["vllm"], sys.modules["vllm._custom_ops"] = parent, ops
    return ["vllm", "vllm._custom_ops"]
