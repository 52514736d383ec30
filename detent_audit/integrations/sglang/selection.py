"""The CPU kernels' selection for an SGLang deployment: the embedded SelIR programs solved for this model
on this CPU and the limits SGLang serves with (`Limits`: its context length, running requests and tokens of
one step), compiled with the committed tuple (the same selectors the embedded engine runs).

The GEMM's form is proven where it runs, as in the embedded engine (`kernels/gemm_probe.py`): on the products
SGLang's model makes (its fused QKV and gate-up projections, `sglang_gemm_shapes`), at the engine's thread
count, in the launcher (which commits the tuple: without one, the pad form at the fewest proven rows) and
again in the scheduler (which requires the committed form on every one of them before it serves); a product of
any other shape is proven before its first call computes it (`cpu_kernels.CpuHooks`)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from detent_audit.enums import Mode
from detent_audit.integrations.hosted import fused_gemm_shapes
from detent_audit.kernels import KernelSet
from detent_audit.manifests.deployment import Deployment
from detent_audit.runtime.kernel_select import Selection, engine_deployment, select_kernels
from detent_audit.runtime.model_config import ModelConfig

PAGE_SIZE = 1  # SGLang's KV pool on a CPU: one token per page
MAX_NUM_BATCHED_TOKENS = 8192  # the fewest tokens of one step the selection is solved for


@dataclass(frozen=True)
class Limits:
    """What SGLang serves with, and so what the selection is solved for: its context length
    (`--context-length`), running requests (`--max-running-requests`) and the tokens of one step (a prefill
    batch holds at most `--chunked-prefill-size` tokens, a decode batch one per running request). The
    selectors assume them (`selection/programs/embedded.py`); a step beyond them raises `SelectionViolation`,
    which would stop SGLang's scheduler, so the scheduler refuses a request beyond the context first
    (`guard.py`)."""

    max_model_len: int = 2048
    max_num_seqs: int = 64
    max_num_batched_tokens: int = MAX_NUM_BATCHED_TOKENS

    @classmethod
    def served(cls, max_model_len: int, max_num_seqs: int, chunked_prefill_size: int) -> Limits:
        """The limits of SGLang started with these settings; the step's tokens at least
        `MAX_NUM_BATCHED_TOKENS`, so that a smaller chunked-prefill size (set while SGLang runs, `control.py`)
        keeps the deployment, and so the receipts' facts, unchanged."""
        tokens = max(MAX_NUM_BATCHED_TOKENS, chunked_prefill_size, max_num_seqs)
        return cls(max_model_len, max_num_seqs, tokens)

    @classmethod
    def of(cls, config: Any) -> Limits:
        """The limits a `PluginConfig` carries."""
        return cls(config.max_model_len, config.max_num_seqs, config.max_num_batched_tokens)


def solved_context(model_path: str | Path, limits: Limits) -> int:
    """The context the selection is solved for: the limits', within the model's own."""
    return min(limits.max_model_len, ModelConfig.from_pretrained(model_path).max_position_embeddings)


def cpu_deployment(model_path: str | Path, num_threads: int, limits: Limits = Limits()) -> Deployment:
    """The deployment the CPU kernels are solved for: the model's shape, fp32, this thread count, the limits
    (the context within the model's own)."""
    config = ModelConfig.from_pretrained(model_path)
    return engine_deployment(config, dtype="float32", num_threads=num_threads, block_size=PAGE_SIZE,
                             max_model_len=solved_context(model_path, limits),
                             max_num_seqs=limits.max_num_seqs,
                             max_num_batched_tokens=limits.max_num_batched_tokens,
                             prefix_caching=True, name="sglang-cpu")


def sglang_gemm_shapes(config: ModelConfig) -> list[tuple[int, int]]:
    """(N, K) of every unquantized product SGLang's decoder runs (`hosted.fused_gemm_shapes`)."""
    return fused_gemm_shapes(config)


def cpu_selection(model_path: str | Path, num_threads: int,
                  committed: Mapping[str, Mapping[str, Any]] | None = None,
                  limits: Limits = Limits()) -> Selection:
    """Solved selectors and the tuple (the committed one, checked legal and its GEMM form proven here, or the
    preferred legal one with the GEMM form the probe proves); its `deployment` carries the probe's facts."""
    from detent_audit.runtime.threads import set_threads

    set_threads(num_threads)  # the probe proves the form at the thread count the engine runs
    shapes = sglang_gemm_shapes(ModelConfig.from_pretrained(model_path))
    deployment = cpu_deployment(model_path, num_threads, limits)
    return select_kernels(Mode.DETENT, deployment, committed, gemm_shapes=shapes)


def cpu_kernel_set(config: Any) -> KernelSet:
    """The kernels a `PluginConfig` names: its tuple, solved for its limits."""
    kernels = cpu_selection(config.model_path, config.num_threads, config.tuple, Limits.of(config)).kernels
    assert isinstance(kernels, KernelSet), "the CPU selection builds the CPU kernel set"
    return kernels


def model_gemm_shapes(model_path: str | Path) -> list[tuple[int, int]]:
    """The shapes `cpu_selection` proves the GEMM form on (SGLang's fused products of the model)."""
    return sglang_gemm_shapes(ModelConfig.from_pretrained(model_path))
