"""The KernelSet on a CUDA device: the model's calls routed to Triton kernels, per mode.

- `stock`: cuBLAS GEMMs; attention split as FlashAttention-3's heuristic splits it, read from the batch (its
  SelIR program unpinned: runtime/kernel_select.py `stock_attention_selector`); MoE config by M as vLLM's
  default rule picks it. Selection follows the batch, so bits do.
- `det`: one conservative setting per family (one attention split, fixed tiles).
- `detent`: the compiled SelIR selectors with the committed tuple's pins, called at every launch with the
  launch's runtime inputs (with pins they return constants).
All modes share the row-local kernels (kernels/triton_rowlocal.py: one launch each, invariant by
construction), so the modes differ only where selection does.

Measured on an H200 (benchmarks/gpu_gemm.py, gpu_attention.py): the GEMM tile does not change a row's bits,
so its tile follows the shape for speed; the attention's BLOCK_N and split stride do, so they come from the
selection, and its BLOCK_M stays 64 (16 changes the matrix instruction, and the bits).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from detent_audit.enums import Mode
from detent_audit.kernels import rowlocal
from detent_audit.kernels.attention_metadata import AttentionMetadata
from detent_audit.kernels.params import AttentionParams
from detent_audit.kernels.rowlocal import RopeCache

NO_SPLIT = 1 << 30


def gemm_tile(m: int, n: int = 0, k: int = 0):
    """The GEMM tile for an [m, k] x [k, n] call: harmless for the bits (every tile gives a row the same bits,
    tests/kernels/test_gpu_gemm.py), so it follows the shape. Fastest measured on the H200 for Llama-3.1-8B's
    projections (`benchmarks/gpu_gemm.py --decode`): 0.9-1.05x cuBLAS up to 32 rows."""
    from detent_audit.kernels.triton_gemm import TritonGemmConfig

    wide = n > 8192  # gate_up, the LM head
    if m <= 16:  # decode: memory-bound; one program per narrow tile so every SM streams weights
        return TritonGemmConfig(16, 128, 128, 8, 4, 4) if wide else TritonGemmConfig(16, 32, 256, 8, 4, 4)
    if m <= 32:
        return TritonGemmConfig(64, 128, 64, 8, 4, 4) if wide else TritonGemmConfig(16, 32, 256, 8, 4, 4)
    if m <= 64:
        return TritonGemmConfig(64, 128, 64, 8, 4, 4) if wide else TritonGemmConfig(32, 64, 256, 8, 4, 3)
    if m <= 256:
        return TritonGemmConfig(64, 128, 64, 8, 4, 4)
    return TritonGemmConfig(128, 256, 64, 8, 8, 3)


def moe_tile(m: int, e: int, h: int, inter: int, top_k: int):
    """The fused-MoE tile for m rows: vLLM's default rule by M (`stock_config`), which stock and detent both
    follow. Harmless for the bits, like the GEMM tile: on the H200 every tile field changed alone gives the
    same bits (benchmarks/gpu_moe.py), and rows keep their bits across the rule's switch at M = E
    (tests/kernels/test_gpu_moe.py). det keeps one fixed tile."""
    from detent_audit.kernels.triton_moe import stock_config

    return stock_config(m, e, h, inter, top_k)


def selected_attention_config(params: AttentionParams, streaming: bool = False):
    """The Triton attention config of selected params (det/detent; the tuner's candidates): the KV tile and
    split stride they name (0: one split), BLOCK_M 64 (16 changes the bits)."""
    from detent_audit.kernels.triton_attention import TritonAttentionConfig

    return TritonAttentionConfig(block_m=64, block_n=params.kv_tile, split=params.split_stride or NO_SPLIT,
                                 streaming=streaming)


@dataclass
class GpuKernelSet:
    mode: str                                         # stock | det | detent
    select_attention: Callable[..., AttentionParams]  # per launch, from the batch's shape
    moe_config: object | None = None                  # det: its one MoE tile (None: moe_tile by M)
    streaming: bool = False                           # det/detent: the attention's streaming fold
    _plan: tuple | None = None                        # (metadata, config, plan) of the current step

    def attention_config(self, num_seqs: int, max_seqlen_q: int, max_seqlen_k: int, num_kv_heads: int,
                         heads_per_group: int):
        """The Triton attention config of a launch, from the mode's selector (stock's reads the batch)."""
        p = self.select_attention(num_seqs=num_seqs, max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k)
        return selected_attention_config(p, self.streaming)

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if self.mode == Mode.STOCK:
            return F.linear(x, weight, bias)
        from detent_audit.kernels.triton_gemm import linear

        x2 = x.reshape(-1, x.shape[-1])
        tile = gemm_tile(x2.shape[0], weight.shape[0], weight.shape[1])
        return linear(x2, weight, bias, tile).reshape(*x.shape[:-1], weight.shape[0])

    def attention(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  meta: AttentionMetadata, scale: float) -> torch.Tensor:
        from detent_audit.kernels.triton_attention import paged_attention, plan_step

        hkv = k_cache.shape[2]
        cfg = self.attention_config(meta.num_seqs, meta.max_seqlen_q, meta.max_seqlen_k, hkv,
                                    q.shape[1] // hkv)
        if self._plan is None or self._plan[0] is not meta or self._plan[1] != cfg:  # one plan per step
            self._plan = (meta, cfg, plan_step(meta.cu_seqlens_q, meta.context_lens, meta.block_tables, cfg,
                                               q.device, q.shape[1] // hkv))
        return paged_attention(q, k_cache, v_cache, meta.cu_seqlens_q, meta.context_lens, meta.block_tables,
                               scale, cfg, plan=self._plan[2])

    def qkv_prologue(self, qkv: torch.Tensor, positions: torch.Tensor, cos_sin: RopeCache,
                     heads: tuple[int, int, int], kv_cache: tuple[torch.Tensor, torch.Tensor],
                     slot_mapping: torch.Tensor, q_norm: torch.Tensor | None = None,
                     k_norm: torch.Tensor | None = None, eps: float = 0.0) -> torch.Tensor:
        # positions come from the engine, bounded by max_model_len <= the table; no negative slots (CUDA-graph
        # padding rows write a scratch block): no host-side check, so the call stays capturable
        from detent_audit.kernels.triton_rowlocal import qkv_prologue

        return qkv_prologue(qkv, positions, cos_sin.cos, cos_sin.sin, heads, kv_cache[0], kv_cache[1],
                            slot_mapping, q_norm, k_norm, eps)

    def moe(self, x, router_logits, w13, w2, top_k: int, renormalize: bool) -> torch.Tensor:
        from detent_audit.kernels import triton_moe

        m, e, h, inter = x.shape[0], w13.shape[0], w13.shape[2], w2.shape[2]
        config = self.moe_config or moe_tile(m, e, h, inter, top_k)
        return triton_moe.fused_moe(x, router_logits, w13, w2, top_k, renormalize, config)

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        from detent_audit.kernels.triton_rowlocal import rms_norm

        return rms_norm(x, weight, eps)

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        from detent_audit.kernels.triton_rowlocal import add_rms_norm

        return add_rms_norm(x, residual, weight, eps)

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        from detent_audit.kernels.triton_rowlocal import silu_and_mul

        return silu_and_mul(x)

    def log_softmax(self, x: torch.Tensor) -> torch.Tensor:
        return rowlocal.log_softmax(x)


if TYPE_CHECKING:
    from detent_audit.kernels import Kernels

    def _satisfies(kernels: GpuKernelSet) -> Kernels:
        return kernels  # the type checker holds GpuKernelSet to the protocol
