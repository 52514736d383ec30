"""detent-audit in SGLang: the `Engine` over `sglang.Engine`, and the plugin SGLang loads in every process.

Importing this package does not import SGLang: `sglang_version()` says whether it is installed here.
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

# SGLang has no installable extra: its wheel's declared dependencies are CUDA builds, so it goes in --no-deps
INSTALL_REMEDY = ("install SGLang's CPU path as `make .venv/.installed` does: pip install --no-deps "
                  "sglang==0.5.21 torchvision==0.28.0, the modules it imports on a CPU (the Makefile's "
                  "SGLANG_DEPS), then "
                  "python -m detent_audit.integrations.sglang.torchvision_cpu")


def sglang_version() -> str | None:
    """The installed SGLang's version, or None."""
    try:
        return version("sglang")
    except PackageNotFoundError:
        return None
