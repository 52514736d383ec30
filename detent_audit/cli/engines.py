"""The engine a command runs on, built from its options: the embedded one (default), vLLM (`--engine vllm`) or
SGLang (`--engine sglang`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from detent_audit.errors import BadInput

ENGINES = ("embedded", "vllm", "sglang")


def open_engine(model: str | None, mode: str, dtype: str, threads: int, tuple_file: Path | None = None,
                cache_dir: Path | None = None, *, engine: str = "embedded", **extra: Any) -> Any:
    """An `LLM` (the embedded engine, `extra`: more `EngineConfig` fields), a `VllmEngine` (the [vllm]
    extra; vLLM's CPU build, so no `--device`/`--attention-streaming`) or an `SglangEngine` (SGLang's CPU path,
    fp32, as the Makefile installs it)."""
    from detent_audit.engine.llm import LLM, EngineConfig

    if engine not in ENGINES:
        raise BadInput(f"--engine must be one of {', '.join(ENGINES)}, got {engine!r}")
    committed = None
    if tuple_file is not None:
        from detent_audit.runtime.tuples import load_tuple

        committed = load_tuple(tuple_file)
    if engine == "sglang":
        if extra.get("device", "cpu") != "cpu" or extra.get("attention_streaming"):
            raise BadInput("--engine sglang runs SGLang's CPU path here", remedy="drop --device/--attention-streaming")
        if dtype != "float32":
            raise BadInput("--engine sglang runs float32 here", remedy="drop --dtype")
        from detent_audit.integrations.sglang.engine import SglangConfig, SglangEngine

        limits = {"max_model_len": extra["max_model_len"]} if extra.get("max_model_len") else {}
        return SglangEngine(SglangConfig(model=str(model) if model else "", mode=mode, num_threads=threads,
                                         tuple=committed, cache_dir=str(cache_dir) if cache_dir else None,
                                         **limits))
    if engine == "vllm":
        from detent_audit.integrations.vllm import vllm_available

        if extra.get("device", "cpu") != "cpu" or extra.get("attention_streaming"):
            raise BadInput("--engine vllm runs vLLM's CPU build here", remedy="drop --device/--attention-streaming")
        if not vllm_available():
            raise BadInput("vLLM is not installed", remedy="pip install 'detent-audit[vllm]'")
        from detent_audit.integrations.vllm.engine import VllmConfig, VllmEngine

        limits = {"max_model_len": extra["max_model_len"]} if extra.get("max_model_len") else {}
        return VllmEngine(VllmConfig(model=str(model) if model else "", mode=mode, dtype=dtype, num_threads=threads,
                                     tuple=committed, cache_dir=str(cache_dir) if cache_dir else None, **limits))
    config = EngineConfig(model=str(model) if model else None, mode=mode, dtype=dtype, num_threads=threads,
                          tuple=committed, cache_dir=str(cache_dir) if cache_dir else None, **extra)
    return LLM(config)
