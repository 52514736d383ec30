"""The instruction set torch and the BLAS dispatch to, pinned as a deployment setting (`--isa`).

The CPU's vector extensions choose kernels: torch's vectorized ops (`ATEN_CPU_CAPABILITY`), MKL's fp32 GEMM
(`MKL_ENABLE_INSTRUCTIONS`) and oneDNN's JIT kernels (`ONEDNN_MAX_CPU_ISA`) each take the widest the CPU has,
so the same engine reduces in other orders on an AVX-512 CPU than on an AVX2 one. Each library reads its cap
once, when it initialises, so the cap is set before torch is imported (`pin`, from the CLI's entry point) and
every process the engine starts (vLLM's and SGLang's workers, tensor-parallel ranks) inherits it.

- `portable`: every library capped at AVX2 (x86-64-v3: AVX2 and FMA), the widest that every
  x86 CPU the project serves on has. What each cap promises, in its library's own documentation:
  ATen dispatches to the kernels built for the named capability (`avx2`), or the CPU's own where that is
  lower; MKL dispatches to no code path above AVX2; oneDNN JIT-generates no kernel above AVX2. None promises
  bits across CPUs (MKL's reproducibility mode, MKL_CBWR, promises them on Intel CPUs only): the GEMM form is
  still proven at start (kernels/gemm_probe.py), and under the cap the default tuple keeps the chunk form
  (invariant by construction) rather than the pad form a probe of this CPU would allow, so that the tuple
  does not depend on the CPU either.
- `native` (the default): nothing capped; the facts then name the CPU's capability, and a receipt served on
  another class of CPU is not comparable.

The facts name the cap (`runtime.isa: "x86-64-v3"`) only where it took effect: the variables set as `pin`
sets them and torch reporting AVX2. Otherwise they name torch's `cpu_capability`.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping, Sequence
from typing import Any

from detent_audit.errors import BadInput

ENV = "DETENT_AUDIT_ISA"       # portable | native (the CLI's --isa wins)
CHOICES = ("portable", "native")
DEFAULT = "native"             # the cap cost 23% of detent's tok/s on an AVX-512 Xeon (docs/isa.md)
PORTABLE_ISA = "x86-64-v3"     # the psABI level of AVX2 + FMA: what the portable cap lets every library use
# the variable of each library and its AVX2 value (read at the library's initialisation)
PORTABLE_ENV = {"ATEN_CPU_CAPABILITY": "avx2", "MKL_ENABLE_INSTRUCTIONS": "AVX2",
                "ONEDNN_MAX_CPU_ISA": "AVX2"}
_REEXEC = "DETENT_AUDIT_ISA_REEXEC"  # set in a re-executed process: never re-execute twice


def requested(argv: Sequence[str], environ: Mapping[str, str] = os.environ) -> str:
    """The ISA asked for: `--isa X` (or `--isa=X`) before the command's name, else `$DETENT_AUDIT_ISA`, else
    portable. `BadInput` for any other value."""
    choice = environ.get(ENV) or DEFAULT
    i = 0
    while i < len(argv) and argv[i].startswith("-"):
        if argv[i] == "--isa" and i + 1 < len(argv):
            choice = argv[i + 1]
            i += 1
        elif argv[i].startswith("--isa="):
            choice = argv[i].removeprefix("--isa=")
        i += 1
    if choice not in CHOICES:
        raise BadInput(f"--isa {choice!r} (or {ENV}) is not an ISA setting", remedy=f"use one of {CHOICES}")
    return choice


def environment(choice: str, environ: Mapping[str, str] = os.environ) -> dict[str, str | None]:
    """The variables `choice` sets (None: removed). Native removes only the values the portable cap sets (a
    cap inherited from a portable parent), never a user's own setting of a library's variable."""
    if choice == "portable":
        return {ENV: choice, **PORTABLE_ENV}
    return {ENV: choice, **{k: None for k, v in PORTABLE_ENV.items() if environ.get(k) == v}}


def pin(choice: str) -> None:
    """Set `choice`'s variables in this process's environment (its children inherit them). Where torch was
    imported before under other values, the libraries have read theirs already: the process re-executes
    itself (`python -m detent_audit.cli` with the same arguments) so that they read the pinned ones."""
    wanted = environment(choice)
    reexecuted = os.environ.pop(_REEXEC, None)  # not inherited by this process's children
    changed = any(os.environ.get(k) != v for k, v in wanted.items() if k != ENV)
    for key, value in wanted.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
    if changed and "torch" in sys.modules and not reexecuted:
        os.environ[_REEXEC] = "1"
        sys.stdout.flush()
        sys.stderr.flush()
        os.execv(sys.executable, [sys.executable, "-m", "detent_audit.cli", *sys.argv[1:]])


def capped() -> bool:
    """Whether this process runs under the portable cap: every variable as `pin` sets it, and torch's
    dispatch at AVX2 (a CPU without AVX2 keeps its own, lower, capability: not the cap)."""
    if not all(os.environ.get(k) == v for k, v in PORTABLE_ENV.items()):
        return False
    import torch

    return torch.backends.cpu.get_cpu_capability() == "AVX2"


def runtime_facts() -> dict[str, Any]:
    """The ISA fact of the runtime: `{"isa": "x86-64-v3"}` under the portable cap, else the capability torch
    dispatches to on this CPU (`{"cpu_capability": "AVX512"}`, say)."""
    import torch

    return {"isa": PORTABLE_ISA} if capped() else {"cpu_capability": torch.backends.cpu.get_cpu_capability()}


def blas_cpu() -> dict[str, str]:
    """Under the cap, the CPU model (`{"cpu_model": ...}`) for an engine whose products are still MKL's or
    oneDNN's (stock or det mode, bfloat16, a MoE's experts, vLLM's oneDNN GEMM): those libraries choose code
    by the CPU whatever the cap (docs/isa.md), so such a receipt is checked on the same model; natively
    nothing. An engine on the fixed-order kernels names those instead (`kernel_select.order_facts`)."""
    if not capped():
        return {}
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            names = [line.split(":", 1)[1].strip() for line in f if line.startswith("model name")]
    except OSError:
        names = []
    import platform

    return {"cpu_model": names[0] if names else platform.processor() or platform.machine()}


def hint(served: Any, here: Any) -> str | None:
    """Why two runtimes' facts (`runtime` of a receipt's and of this engine's) differ in their ISA and what to
    do, or None where they agree."""
    if not isinstance(served, Mapping) or not isinstance(here, Mapping):
        return None
    served_isa = served.get("isa") or served.get("cpu_capability")
    here_isa = here.get("isa") or here.get("cpu_capability")
    if served_isa == here_isa:
        if served.get("cpu_model") != here.get("cpu_model") and served.get("cpu_model"):
            return ("the receipt was served by an engine whose products are the BLAS's, on a "
                    f"{served.get('cpu_model')}: the BLAS chooses code by the CPU whatever the ISA cap, so "
                    "it is checked on that CPU model, by an engine whose products are the BLAS's too; "
                    "receipts served with --isa portable in detent mode in float32 (the fixed-order "
                    "kernels) verify on any")
        return None
    if served.get("isa") == PORTABLE_ISA:
        return (f"the receipt was served under the portable ISA cap ({PORTABLE_ISA}); this verifier runs "
                f"{here_isa}: verify with --isa portable")
    return (f"the receipt was served on the CPU's native instruction set ({served_isa}), this verifier runs "
            f"{here_isa}: a receipt served natively is checked only on a CPU of its class; serve with "
            "--isa portable for receipts that verify on any x86-64 CPU with AVX2 and FMA")
