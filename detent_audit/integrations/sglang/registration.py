"""SGLang in the registry (`detent_audit.runtime.registry`): built from a command's options (SGLang's CPU
path, fp32, as the Makefile installs it), and rebuilt from a receipt's facts, or not comparable.

The settings come from the receipt's facts (mode, threads, chunked-prefill size, radix cache, limits) and its
tuple; the checkpoint is local (`--model`, or the model the receipt names). Everything that can be refused
without SGLang running is refused before it starts (a start takes minutes on a CPU): a stock receipt (SGLang's
kernels read the batch), another SGLang version or thread count, other checkpoint files, signed limits out of
range. Then the local engine's facts are compared with the receipt's, field by field. Importing this module
imports nothing of SGLang.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

from detent_audit.errors import BadInput
from detent_audit.integrations import sglang as package
from detent_audit.runtime.rebuild import (
    EngineUnavailable,
    NotComparable,
    RebuildRequest,
    batch_invariant_mode,
    bounded,
    built_or_refused,
    check_checkpoint_files,
    check_comparable,
    fact,
    local_model,
    section,
    served_thread_count,
)
from detent_audit.runtime.registry import EngineEntry, EngineOptions, register

if TYPE_CHECKING:
    from detent_audit.runtime.contract import Engine

FACTS_NAME = "sglang"


def missing() -> EngineUnavailable | None:
    if package.sglang_version() is not None:  # read from the package at each call (a test may stand in)
        return None
    return EngineUnavailable("SGLang is not installed here", remedy=package.INSTALL_REMEDY)


def build(options: EngineOptions) -> Engine:
    if options.device != "cpu" or options.attention_streaming:
        raise BadInput("--engine sglang runs SGLang's CPU path here",
                       remedy="drop --device/--attention-streaming")
    if options.dtype != "float32":
        raise BadInput("--engine sglang runs float32 here", remedy="drop --dtype")
    from detent_audit.integrations.sglang.engine import SglangConfig, SglangEngine

    return SglangEngine(SglangConfig(model=options.model or "", mode=options.mode.value,
                                     num_threads=options.threads,
                                     tuple=dict(options.tuple) if options.tuple else None,
                                     cache_dir=options.cache_dir,
                                     max_model_len=options.max_model_len))


def _plugin_attention(facts: Mapping[str, object]) -> object:
    """The attention form the receipt's plugin ran (none named: the torch form; the facts are compared whole
    once SGLang runs)."""
    plugin = section(facts, "engine").get("plugin") or {}
    if not isinstance(plugin, Mapping):
        raise BadInput(f"the receipt's engine.plugin is {plugin!r}, not an object")
    return plugin.get("attention")


def rebuild(request: RebuildRequest) -> Engine:
    """The local `SglangEngine` for a receipt; raises `NotComparable` (exit 3) or `BadInput` (exit 2)."""
    from detent_audit.integrations.sglang.engine import SglangConfig, SglangEngine, attention_of_facts
    from detent_audit.runtime.facts import checkpoint_hashes

    # first: what the receipt's facts alone refuse
    facts = request.facts
    mode = batch_invariant_mode(request, "SGLang")
    served, local = fact(facts, "engine", "version"), package.sglang_version()
    if served != local:
        raise NotComparable(["engine.version"], f"the receipt was served by SGLang {served}; this verifier "
                                                f"has SGLang {local}")
    served_threads = served_thread_count(facts, request.threads)
    # signed facts that size the engine, bounded before SGLang starts (no receipt sizes the verifier's memory)
    max_len = bounded(facts, 1 << 20, "scheduler", "max_model_len")
    seqs = bounded(facts, 1024, "scheduler", "max_num_seqs")
    chunk = bounded(facts, 1 << 16, "scheduler", "chunked_prefill_size")
    prefix_caching = section(facts, "scheduler").get("prefix_caching")
    if not isinstance(prefix_caching, bool):
        raise BadInput(f"the receipt's scheduler.prefix_caching is {prefix_caching!r}, not a boolean")

    # then: the checkpoint's files are hashed, not loaded, before SGLang starts
    config = SglangConfig(model=local_model(request) or "", mode=mode.value, num_threads=served_threads,
                          max_model_len=max_len, max_num_seqs=seqs, chunked_prefill_size=chunk,
                          prefix_caching=prefix_caching, tuple=request.families(),
                          attention=attention_of_facts(_plugin_attention(facts)))
    resolved = config.resolved_model
    check_checkpoint_files(facts, checkpoint_hashes(resolved.path), resolved.name)

    # last: SGLang started with the plugin and the receipt's tuple, its facts compared field by field
    engine = built_or_refused(lambda: SglangEngine(config), request)  # the CPU selection refuses a tuple
    try:
        check_comparable(dict(facts), engine.facts())
    except NotComparable as exc:
        engine.shutdown()
        raise NotComparable(exc.fields) from None
    return engine


register(EngineEntry("sglang", FACTS_NAME, build, rebuild, missing))
