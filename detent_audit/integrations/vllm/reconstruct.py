"""(3)-(4) of verification for a vLLM receipt: the vLLM engine its facts describe, or not comparable.

The settings come from the receipt's facts (mode, threads, page size, chunking budget, prefix caching, limits)
and its tuple; the checkpoint is local (`--model`). The local engine's facts are then compared field by field
with the receipt's: a different vLLM version, plugin source, thread count, torch or CPU makes it not comparable,
every differing field named. Stock receipts are not comparable (vLLM's kernels read the batch).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from detent_audit.errors import BadInput


def reconstruct_vllm(facts: Mapping[str, Any], tuple_values: Mapping[str, Any], model: str | Path | None,
                     threads: int | None = None, tuple_override: Mapping[str, Any] | None = None, *,
                     kv_tokens: int = 0) -> Any:
    from detent_audit.verifier.reconstruct import NotComparable, _get, differing_fields

    mode = _get(tuple_values, "mode", "name")
    if mode == "stock":
        raise NotComparable(["tuple.mode.name"], "stock vLLM is not batch-invariant: its bits depend on the batch "
                                                 "the request was served in, which no verifier can rebuild")
    if tuple_override is not None and mode != "detent":
        raise BadInput(f"--tuple applies to detent receipts only; this receipt was served in {mode} mode")
    if model is None:
        raise BadInput("a vLLM receipt is re-executed on a local checkpoint", remedy="pass --model PATH")
    import vllm

    served = _get(facts, "engine", "version")
    if served != vllm.__version__:  # refused before an engine is built: a build takes most of a minute
        raise NotComparable(["engine.version"], f"the receipt was served by vLLM {served}; this verifier has "
                                                f"vLLM {vllm.__version__}")
    served_threads = _get(facts, "runtime", "num_threads")
    if threads is not None and threads != served_threads:
        raise NotComparable(["runtime.num_threads"], f"the receipt was served with {served_threads} threads; "
                                                     f"--threads {threads} changes the bits")
    from detent_audit.integrations.vllm.engine import VllmConfig, VllmEngine

    dep, sched = _get(facts, "deployment", "engine"), _get(facts, "scheduler")
    families = {k: dict(v) for k, v in (tuple_override or tuple_values).items() if k != "mode"}
    config = VllmConfig(model=str(model), mode=mode, num_threads=served_threads,
                        dtype=_get(facts, "runtime", "dtype"), block_size=sched["block_size"],
                        max_model_len=dep["max_model_len"], max_num_seqs=sched["max_num_seqs"],
                        max_num_batched_tokens=sched["max_num_batched_tokens"],
                        prefix_caching=sched["prefix_caching"], tuple=families if mode == "detent" else None,
                        gemm=(_get(facts, "engine", "plugin").get("gemm") or "onednn") if mode == "detent"
                        else "onednn")
    engine = VllmEngine(config)
    fields = differing_fields(dict(facts), engine.facts())
    if fields:
        raise NotComparable(fields)
    return engine
