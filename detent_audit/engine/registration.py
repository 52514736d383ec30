"""The embedded engine in the registry (`detent_audit.runtime.registry`): built from a command's options, and
rebuilt from a receipt's facts and tuple (step (7) of verification) or refused with a typed verdict.

The settings come from the receipt's facts (dtype, thread count, page size, limits, mode) and its tuple; the
checkpoint is the verifier's own. Before anything is built, the facts known without building (engine
sources, checkpoint file hashes, runtime) are compared; after, the local engine's facts are compared with the
receipt's, field by field: any difference (weights, kernel sources, torch version, CPU capability, ...) makes
the receipt not comparable here, and every differing field is named.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

from detent_audit.enums import Mode
from detent_audit.runtime.contract import EMBEDDED
from detent_audit.runtime.rebuild import (
    NotComparable,
    RebuildRequest,
    built_or_refused,
    check_comparable,
    check_sizes,
    fact,
    named_model,
    section,
    served_mode,
    served_tensor_parallel,
    served_thread_count,
)
from detent_audit.runtime.registry import EngineEntry, EngineOptions, register

if TYPE_CHECKING:  # the engine's modules (torch, the model) load when it is built, not when it registers
    from detent_audit.engine.llm import LLM, EngineConfig

DEFAULT_KV_BLOCKS = 1024  # KV pages the engine allocates unless a request needs more
# The KV pool a verifier builds is its own choice (not a bit-relevant fact: the kernels' bits do not depend on
# where a block lives or on preemption): POOL_TOKENS whatever the page size, more only to hold one receipt.
POOL_TOKENS = DEFAULT_KV_BLOCKS * 16


def build(options: EngineOptions) -> LLM:
    from detent_audit.engine.llm import LLM, EngineConfig

    extra = dict(options.extra)
    if options.tensor_parallel_size > 1:
        extra["tensor_parallel_size"] = options.tensor_parallel_size
    return LLM(EngineConfig(model=options.model, mode=options.mode.value, dtype=options.dtype,
                            num_threads=options.threads, tuple=dict(options.tuple) if options.tuple else None,
                            cache_dir=options.cache_dir, device=options.device,
                            attention_streaming=options.attention_streaming,
                            max_model_len=options.max_model_len, **extra))  # type: ignore[arg-type]


def engine_config(request: RebuildRequest) -> EngineConfig:
    """The EngineConfig a receipt's facts and tuple describe, on the local checkpoint; the verifier's
    `threads` and `tuple_override` replace the receipt's. The KV pool (not a bit-relevant fact: the kernels'
    bits do not depend on where a block lives or on preemption) holds at least one request of `kv_tokens`
    tokens."""
    from detent_audit.engine.llm import EngineConfig

    facts = request.facts
    dep, sched = section(facts, "deployment", "engine"), section(facts, "scheduler")
    runtime = section(facts, "runtime")
    check_sizes(facts)  # signed facts size the engine: bounded by the verifier's own limits first
    served_threads = served_thread_count(facts, None)
    mode = served_mode(request)
    section(facts, "checkpoint")
    tp_size, tp_ranks = served_tensor_parallel(facts, request.tensor_parallel)
    block_size = sched["block_size"]
    return EngineConfig(
        tensor_parallel_size=tp_size, tensor_parallel_ranks=tp_ranks,
        num_kv_blocks=max(2, -(-POOL_TOKENS // block_size)),  # type: ignore[operator]
        # the verifier's --model, else the named model or random:<shape> the receipt names (its size bounded
        # by the facts' limits, checked above), else the default model
        model=request.model if request.model is not None else named_model(facts),
        mode=mode.value, dtype=runtime["dtype"],  # type: ignore[arg-type]
        device="cpu" if fact(facts, "runtime", "device") == "cpu" else "cuda",
        num_threads=request.threads or served_threads,
        block_size=sched["block_size"], max_model_len=dep["max_model_len"],  # type: ignore[arg-type]
        max_num_seqs=dep["max_num_seqs"], max_num_batched_tokens=sched["max_num_batched_tokens"],  # type: ignore[arg-type]
        prefix_caching=sched["prefix_caching"],  # type: ignore[arg-type]
        tuple=request.families() if mode == Mode.DETENT else None, cache_dir=request.cache_dir,
        kv_pool_tokens=request.kv_tokens,
        attention_streaming=dep.get("attention_backend") == "detent-streaming")


def rebuild(request: RebuildRequest) -> LLM:
    """The local embedded engine for a receipt; raises `NotComparable` or `BadInput`."""
    from detent_audit.engine.deployment_facts import static_facts
    from detent_audit.engine.llm import LLM

    facts = request.facts
    config = engine_config(request)
    if config.mode == Mode.STOCK:
        raise NotComparable(["tuple.mode.name"], "stock mode is not batch-invariant: its bits depend on the "
                                                 "batch the request was served in, which no verifier can "
                                                 "rebuild")
    if config.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            served_on = fact(facts, "runtime", "device")
            raise NotComparable(["runtime.device"], f"the receipt was served on {served_on!r}; this machine "
                                                    "has no CUDA device")
    # first: what is known before building (the checkpoint is the verifier's: hashed, not loaded)
    expected = {k: dict(v) if isinstance(v := facts.get(k), Mapping) else v
                for k in ("engine", "checkpoint", "runtime", "parallel") if k in facts}
    checkpoint = expected["checkpoint"]
    if isinstance(checkpoint, dict):
        checkpoint.pop("eos_token_ids", None)
    check_comparable(expected, static_facts(config))
    llm = built_or_refused(lambda: LLM(config), request)  # select_kernels refuses a tuple not legal here
    check_comparable(dict(facts), llm.facts())
    return llm


register(EngineEntry("embedded", EMBEDDED, build, rebuild, kv_pool_blocks=DEFAULT_KV_BLOCKS))
