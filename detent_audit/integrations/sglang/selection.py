"""The CPU kernels' selection for an SGLang deployment: the embedded SelIR programs solved for this model
on this CPU, compiled with the committed tuple (the same selectors the embedded engine runs).

The GEMM's form is proven where it runs, as in the embedded engine (`kernels/gemm_probe.py`): on the products
SGLang's model makes (its fused QKV and gate-up projections, `sglang_gemm_shapes`), at the engine's thread
count, in the launcher (which commits the tuple: without one, the pad form at the fewest proven rows) and again
in the scheduler (which requires the committed form on every one of them before it serves); a product of any
other shape is proven before its first call computes it (`cpu_kernels.CpuHooks`)."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from detent_audit.enums import Mode
from detent_audit.integrations.hosted import fused_gemm_shapes
from detent_audit.kernels import KernelSet
from detent_audit.manifests.deployment import Deployment
from detent_audit.runtime.kernel_select import Selection, engine_deployment, select_kernels
from detent_audit.runtime.model_config import ModelConfig

# SGLang's KV pool on a CPU: one token per page; the limits the selection is solved for
PAGE_SIZE = 1
MAX_MODEL_LEN = 2048
MAX_NUM_SEQS = 64
MAX_NUM_BATCHED_TOKENS = 8192


def cpu_deployment(model_path: str | Path, num_threads: int) -> Deployment:
    """The deployment the CPU kernels are solved for: the model's shape, fp32, this thread count."""
    config = ModelConfig.from_pretrained(model_path)
    return engine_deployment(config, dtype="float32", num_threads=num_threads, block_size=PAGE_SIZE,
                             max_model_len=min(MAX_MODEL_LEN, config.max_position_embeddings),
                             max_num_seqs=MAX_NUM_SEQS, max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS,
                             prefix_caching=True, name="sglang-cpu")


def sglang_gemm_shapes(config: ModelConfig) -> list[tuple[int, int]]:
    """(N, K) of every unquantized product SGLang's decoder runs (`hosted.fused_gemm_shapes`)."""
    return fused_gemm_shapes(config)


def cpu_selection(model_path: str | Path, num_threads: int,
                  committed: Mapping[str, Mapping[str, Any]] | None = None) -> Selection:
    """Solved selectors and the tuple (the committed one, checked legal and its GEMM form proven here, or the
    preferred legal one with the GEMM form the probe proves); its `deployment` carries the probe's facts."""
    from detent_audit.runtime.threads import set_threads

    set_threads(num_threads)  # the probe proves the form at the thread count the engine runs
    shapes = sglang_gemm_shapes(ModelConfig.from_pretrained(model_path))
    return select_kernels(Mode.DETENT, cpu_deployment(model_path, num_threads), committed, gemm_shapes=shapes)


def cpu_kernel_set(config: Any) -> KernelSet:
    kernels = cpu_selection(config.model_path, config.num_threads, config.tuple).kernels
    assert isinstance(kernels, KernelSet), "the CPU selection builds the CPU kernel set"
    return kernels


def model_gemm_shapes(model_path: str | Path) -> list[tuple[int, int]]:
    """The shapes `cpu_selection` proves the GEMM form on (SGLang's fused products of the model)."""
    return sglang_gemm_shapes(ModelConfig.from_pretrained(model_path))
