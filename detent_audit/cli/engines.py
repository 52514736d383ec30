"""The engine a command runs on, built from its options: the one `--engine` names in the registry
(`detent_audit.runtime.registry`: embedded, the default; vllm; sglang)."""

from __future__ import annotations

from pathlib import Path

from detent_audit.enums import Mode
from detent_audit.errors import BadInput
from detent_audit.runtime import registry
from detent_audit.runtime.contract import Engine


def open_engine(model: str | None, mode: str, dtype: str, threads: int, tuple_file: Path | None = None,
                cache_dir: Path | None = None, *, engine: str = "embedded", device: str = "cpu",
                attention_streaming: bool = False, max_model_len: int | None = None,
                tensor_parallel_size: int = 1) -> Engine:
    """The engine `engine` names, built from a command's options (its committed tuple read from
    `tuple_file`)."""
    if mode not in {m.value for m in Mode}:
        raise BadInput(f"mode must be detent, stock or det, got {mode!r}")
    committed = None
    if tuple_file is not None:
        from detent_audit.runtime.tuples import load_tuple

        committed = load_tuple(tuple_file)
    if engine not in ("embedded", "vllm") and tensor_parallel_size > 1:
        raise BadInput(f"--tensor-parallel-size runs on the embedded engine and vLLM here, not {engine}",
                       remedy="drop --tensor-parallel-size, or use --engine embedded|vllm")
    options = registry.EngineOptions(model=str(model) if model else None, mode=Mode(mode), dtype=dtype,
                                     threads=threads, tuple=committed,
                                     cache_dir=str(cache_dir) if cache_dir else None, device=device,
                                     attention_streaming=attention_streaming, max_model_len=max_model_len,
                                     tensor_parallel_size=tensor_parallel_size)
    return registry.build(engine, options)
