"""Step (7) of verification for an SGLang receipt: the SGLang engine its facts describe, or not comparable.

The settings come from the receipt's facts (mode, threads, chunked-prefill size, radix cache, limits) and its
tuple; the checkpoint is local (`--model`, or the model the receipt names). Everything that can be refused
without SGLang running is refused before it starts (a start takes minutes on a CPU): a stock receipt (SGLang's
kernels read the batch), another SGLang version or thread count, other checkpoint files, signed limits out of
range. Then the local engine's facts are compared with the receipt's, field by field.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from detent_audit.errors import BadInput
from detent_audit.verifier.reconstruct import (
    DESCRIPTIVE_FIELDS,
    NotComparable,
    _get,
    _hosted_mode,
    differing_fields,
    served_from,
    served_thread_count,
)

# signed facts that size the engine, bounded before SGLang is started (no receipt sizes the verifier's memory)
_LIMITS = (("scheduler.max_model_len", 1 << 20), ("scheduler.max_num_seqs", 1024),
           ("scheduler.chunked_prefill_size", 1 << 16))


def _plugin_attention(facts: Mapping[str, Any]) -> Any:
    """The attention form the receipt's plugin ran (none named: the torch form; the facts are compared whole
    once SGLang runs)."""
    plugin = _get(facts, "engine").get("plugin") or {}
    if not isinstance(plugin, Mapping):
        raise BadInput(f"the receipt's engine.plugin is {plugin!r}, not an object")
    return plugin.get("attention")


def reconstruct_sglang(facts: Mapping[str, Any], tuple_values: Mapping[str, Any], model: str | Path | None,
                       threads: int | None = None, tuple_override: Mapping[str, Any] | None = None) -> Any:
    """The local `SglangEngine` for these facts; raises `NotComparable` (exit 3) or `BadInput` (exit 2)."""
    from detent_audit.integrations.sglang.engine import (
        SglangConfig,
        SglangEngine,
        attention_of_facts,
        sglang_version,
    )
    from detent_audit.kernels.gemm_probe import GemmFormNotInvariant
    from detent_audit.runtime.facts import checkpoint_hashes

    # (7), first: what the receipt's facts alone refuse
    mode = _hosted_mode(tuple_values, tuple_override, "SGLang")
    served, local = _get(facts, "engine", "version"), sglang_version()
    if served != local:
        raise NotComparable(["engine.version"], f"the receipt was served by SGLang {served}; this verifier has "
                                                f"SGLang {local}")
    served_threads = served_thread_count(facts, threads)
    sched = _get(facts, "scheduler")
    for what, top in _LIMITS:
        value = sched.get(what.split(".")[1])
        if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= top:
            raise BadInput(f"the receipt's {what} is {value!r}, not in 1..{top}")
    if not isinstance(sched.get("prefix_caching"), bool):
        raise BadInput(f"the receipt's scheduler.prefix_caching is {sched.get('prefix_caching')!r}, not a boolean")

    # (7), then: the checkpoint's files are hashed, not loaded, before SGLang starts
    if model is None:
        model = _get(facts, "checkpoint").get("name")  # a named model (the wheel's) is found by its name
    families = {k: dict(v) for k, v in (tuple_override or tuple_values).items() if k != "mode"}
    config = SglangConfig(model=str(model) if model else "", mode=mode, num_threads=served_threads,
                          max_model_len=sched["max_model_len"], max_num_seqs=sched["max_num_seqs"],
                          chunked_prefill_size=sched["chunked_prefill_size"], prefix_caching=sched["prefix_caching"],
                          tuple=families, attention=attention_of_facts(_plugin_attention(facts)))
    resolved = config.resolved_model
    expected = {k: v for k, v in dict(_get(facts, "checkpoint")).items() if k in ("config", "tokenizer", "weights")}
    fields = [f"checkpoint.{f}" for f in differing_fields(expected, checkpoint_hashes(resolved.path))]
    if fields:
        raise NotComparable(fields, f"deployment differs in {len(fields)} field(s): {', '.join(fields)}; "
                                    + served_from(facts, {"checkpoint": {"name": resolved.name}}))

    # (7), last: SGLang started with the plugin and the receipt's tuple, its facts compared field by field
    whose = "the --tuple given" if tuple_override is not None else "the receipt's tuple"
    try:
        engine = SglangEngine(config)  # the CPU selection refuses a tuple not legal for the solved pins
    except BadInput as exc:
        if "is not legal" in exc.message or "does not run" in exc.message:
            raise NotComparable(["tuple"], f"{whose} is not legal here: {exc.message}") from None
        raise
    except GemmFormNotInvariant as exc:  # its GEMM form is not proven on this machine: these bits cannot be had
        raise NotComparable(["tuple"], f"{whose} cannot run here: {exc.message}") from None
    fields = [f for f in differing_fields(dict(facts), engine.facts()) if f not in DESCRIPTIVE_FIELDS]
    if fields:
        engine.shutdown()
        raise NotComparable(fields)
    return engine
