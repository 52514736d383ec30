"""The SGLang plugin: entry point `sglang.srt.plugins` -> `register()`, run by SGLang in each of its processes.

SGLang's `load_plugins()` (srt/plugins/__init__.py) runs in the launcher and first thing in
`run_scheduler_process`; it calls `register()`, then `HookRegistry.apply_hooks()`, which imports each target,
rebinds it and every module global that aliases it. Both swallow exceptions (a failing plugin or hook is only
logged), so `register()` applies its own hooks at once, checks each target was rebound, and records what it
did in `REPORT` (and in `report_dir/<pid>.json`): the engine refuses to serve in detent mode unless the
scheduler's report lists every hook (`detent_audit.integrations.sglang.engine`).

In every mode the plugin installs the stand-in SGLang needs on a CPU (`stand_ins`). In detent mode it adds
the CPU kernels (`cpu_kernels`) and, with a deployment, the CUDA selection points pinned from the tuple
(`cuda_selection`). Stock mode changes no kernel.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

from detent_audit.integrations.sglang.config import PluginConfig

log = logging.getLogger(__name__)

REPORT: dict[str, Any] = {"loaded": False, "mode": None, "hooks": [], "failed": [], "error": None}


def register() -> None:
    """The entry point. Never raises (SGLang would only log it): failures land in REPORT."""
    from detent_audit.integrations.sglang.stand_ins import install_stand_ins

    install_stand_ins()
    REPORT.update(loaded=True, pid=os.getpid())
    config = None
    try:
        config = PluginConfig.from_env()
        REPORT["mode"] = config.mode if config else "stock"
        if config is not None and config.mode == "detent":
            _apply(config)
    except Exception as exc:  # noqa: BLE001 - reported to the engine, which refuses to serve
        REPORT["error"] = f"{type(exc).__name__}: {exc}"
        log.exception("detent's SGLang plugin failed")
    _write_report(config)


def hooks_for(config: PluginConfig) -> dict[str, tuple[str, Any]]:
    """target -> (hook type, hook) for a detent-mode configuration."""
    import torch

    from detent_audit.integrations.sglang.cpu_kernels import CpuHooks
    from detent_audit.integrations.sglang.selection import cpu_kernel_set

    torch.set_num_threads(config.num_threads)
    out = CpuHooks(cpu_kernel_set(config)).hooks()
    if config.deployment:
        from detent_audit.integrations.sglang.cuda_selection import CudaHooks

        out.update(CudaHooks.from_config(config).hooks())
    return out


def _apply(config: PluginConfig) -> None:
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    wanted = hooks_for(config)
    for target, (kind, hook) in wanted.items():
        HookRegistry.register(target, hook, HookType[kind])
    HookRegistry.apply_hooks()
    REPORT["hooks"] = sorted(t for t in wanted if t in HookRegistry._patched)
    REPORT["failed"] = sorted(t for t in wanted if t not in HookRegistry._patched)


def _write_report(config: PluginConfig | None) -> None:
    if config is None or not config.report_dir:
        return
    folder = Path(config.report_dir)
    try:
        folder.mkdir(parents=True, exist_ok=True)
        (folder / f"{os.getpid()}.json").write_text(json.dumps(REPORT, sort_keys=True))
    except OSError:
        log.exception("detent's SGLang plugin could not write its report")
