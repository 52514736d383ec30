"""(3)-(4) of verification for an SGLang receipt: the SGLang engine its facts describe, or not comparable.

The settings come from the receipt's facts (mode, threads, chunked-prefill size, radix cache, limits) and its
tuple; the checkpoint is local (`--model`). A different SGLang version is refused before an engine starts (a
start takes minutes on a CPU); then the local engine's facts are compared field by field with the receipt's.
Stock receipts are not comparable (SGLang's kernels read the batch).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from detent_audit.errors import BadInput


def reconstruct_sglang(facts: Mapping[str, Any], tuple_values: Mapping[str, Any], model: str | Path | None,
                       threads: int | None = None, tuple_override: Mapping[str, Any] | None = None) -> Any:
    from detent_audit.engine.named_models import resolve_model
    from detent_audit.integrations.sglang.engine import SglangConfig, SglangEngine, sglang_version
    from detent_audit.verifier.reconstruct import NotComparable, _get, differing_fields

    mode = _get(tuple_values, "mode", "name")
    if mode == "stock":
        raise NotComparable(["tuple.mode.name"], "stock SGLang is not batch-invariant: its bits depend on the "
                                                 "batch the request was served in, which no verifier can rebuild")
    if tuple_override is not None and mode != "detent":
        raise BadInput(f"--tuple applies to detent receipts only; this receipt was served in {mode} mode")
    served, local = _get(facts, "engine", "version"), sglang_version()
    if served != local:
        raise NotComparable(["engine.version"], f"the receipt was served by SGLang {served}; this verifier has "
                                                f"SGLang {local}")
    served_threads = _get(facts, "runtime", "num_threads")
    if threads is not None and threads != served_threads:
        raise NotComparable(["runtime.num_threads"], f"the receipt was served with {served_threads} threads; "
                                                     f"--threads {threads} changes the bits")
    sched = _get(facts, "scheduler")
    families = {k: dict(v) for k, v in (tuple_override or tuple_values).items() if k != "mode"}
    engine = SglangEngine(SglangConfig(
        model=str(resolve_model(model).path), mode=mode, num_threads=served_threads,
        max_model_len=sched["max_model_len"], max_num_seqs=sched["max_num_seqs"],
        chunked_prefill_size=sched["chunked_prefill_size"], prefix_caching=sched["prefix_caching"],
        tuple=families))
    fields = differing_fields(dict(facts), engine.facts())
    if fields:
        engine.shutdown()
        raise NotComparable(fields)
    return engine
