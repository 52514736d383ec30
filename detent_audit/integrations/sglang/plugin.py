"""The SGLang plugin: entry point `sglang.srt.plugins` -> `register()`, run by SGLang in each of its
processes.

SGLang's `load_plugins()` (srt/plugins/__init__.py) runs in the launcher and first thing in
`run_scheduler_process`; it calls `register()`, then `HookRegistry.apply_hooks()`, which imports each target,
rebinds it and every module global that aliases it. Both swallow exceptions (a failing plugin or hook is only
logged), so `register()` applies its own hooks at once, checks each target was rebound, and records what it
did in `REPORT` (and in `report_dir/<pid>.json`): the engine refuses to serve in detent mode unless the
scheduler's report lists every hook (`detent_audit.integrations.sglang.engine`).

In every mode the plugin installs the stand-in SGLang needs on a CPU (`stand_ins`) and, started by
detent-audit, the scheduler control (`control`: the chunked-prefill size set without a restart). In detent
mode it adds the CPU kernels (`cpu_kernels`), the scheduler's refusal of a request beyond their context
(`guard`), a rescore's draws (`rescore`) and, with a deployment, the CUDA selection points pinned from the
tuple (`cuda_selection`). Stock mode changes no kernel.
"""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path
from typing import Any

from detent_audit.enums import Mode
from detent_audit.integrations.sglang.config import PluginConfig

log = logging.getLogger(__name__)

REPORT: dict[str, Any] = {"loaded": False, "mode": None, "hooks": [], "failed": [], "error": None}


def register() -> None:
    """The entry point. Never raises (SGLang would only log it): failures land in REPORT. In the launcher
    (the process that started SGLang, `PluginConfig.launcher_pid`) it applies no hook: no model runs there,
    and importing the targets and solving the selection would only delay the start."""
    from detent_audit.integrations.sglang.stand_ins import install_stand_ins

    began = time.time()
    # how long the process ran before SGLang loaded its plugins (its imports), for the engine's start profile
    REPORT.update(loaded=True, pid=os.getpid(), began=began,
                  before_plugin_s=round(began - _process_start(), 2))
    config = None
    try:
        config = PluginConfig.from_env()
        REPORT["mode"] = config.mode if config else Mode.STOCK.value
        launcher = config is not None and config.launcher_pid == os.getpid()
        # a real vLLM is shadowed in SGLang's own processes: every one but detent-audit's launcher (SGLang's
        # own server, `launcher_pid` None, runs nothing of the caller's)
        install_stand_ins(shadow_real=config is not None and not launcher)
        if config is not None and not launcher:
            _apply(config)
    except Exception as exc:  # noqa: BLE001 - reported to the engine, which refuses to serve
        REPORT["error"] = f"{type(exc).__name__}: {exc}"
        log.exception("detent's SGLang plugin failed")
    REPORT["plugin_s"] = round(time.time() - began, 2)
    _write_report(config)


def _process_start() -> float:
    """This process's start (wall clock), from the kernel's record of it."""
    import psutil

    return psutil.Process().create_time()


def hooks_for(config: PluginConfig) -> dict[str, tuple[str, Any]]:
    """target -> (hook type, hook): the scheduler control in every mode, the kernels and the context guard in
    detent mode."""
    from detent_audit.integrations.sglang import control

    out = control.hooks()
    if config.mode != Mode.DETENT:
        return out
    from sglang.srt.utils import cpu_has_amx_support

    from detent_audit.integrations.sglang.cpu_kernels import CpuHooks
    from detent_audit.integrations.sglang.guard import ContextGuard
    from detent_audit.integrations.sglang.selection import (
        Limits,
        cpu_kernel_set,
        model_gemm_shapes,
        solved_context,
    )
    from detent_audit.runtime.threads import set_threads

    if cpu_has_amx_support():
        # sgl-kernel's CPU kernels (RMSNorm, RoPE, SiLU through `forward_cpu`) would run where the hooks cover
        # SGLang's torch forms: refused rather than served with kernels nothing here proved
        raise RuntimeError("sgl-kernel's CPU kernels are installed on this AMX CPU: detent's SGLang hooks "
                           "cover SGLang's torch path on a CPU; uninstall sgl-kernel to serve in detent mode")
    set_threads(config.num_threads)
    # the GEMM form proven on every shape of the model here, before the scheduler serves its first request
    kernels = cpu_kernel_set(config)
    out.update(CpuHooks(kernels, config.attention, model_gemm_shapes(config.model_path)).hooks())
    out.update(ContextGuard(solved_context(config.model_path, Limits.of(config))).hooks())
    if config.report_dir:  # a rescore's draws go back to the engine there (`rescore.py`)
        from detent_audit.integrations.sglang.rescore import RescoreDraws

        out.update(RescoreDraws(config.report_dir).hooks())
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
