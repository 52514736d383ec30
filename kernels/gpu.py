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
selection, and its BLOCK_M stays 64 (16 on 2 or 4 warps splits a row's sums across warps and changes the
bits; 16 on one warp keeps them but is slower in the decode graph, as are 3 pipeline stages at batch 1).
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
    projections, each layer's launch on its own weights in a CUDA graph as the engine runs them
    (`benchmarks/gpu_decode_profile.py --batch 1`, `--batch 256`)."""
    from detent_audit.kernels.triton_gemm import TritonGemmConfig

    wide = n > 8192  # gate_up, the LM head
    if m <= 16:  # decode: memory-bound; one program per narrow tile so every SM streams weights
        if wide:
            return TritonGemmConfig(16, 128, 128, 8, 4, 4)
        if k > 8192:  # down: 256 programs of 56 K steps, 6 stages in flight
            return TritonGemmConfig(16, 16, 256, 8, 2, 6)
        if n > k:  # qkv: 384 programs
            return TritonGemmConfig(16, 16, 256, 8, 2, 4)
        return TritonGemmConfig(16, 32, 256, 8, 4, 4)
    if m <= 32:
        return TritonGemmConfig(64, 128, 64, 8, 4, 4) if wide else TritonGemmConfig(16, 32, 256, 8, 4, 4)
    if m <= 64:
        return TritonGemmConfig(64, 128, 64, 8, 4, 4) if wide else TritonGemmConfig(32, 64, 256, 8, 4, 3)
    if m <= 128:
        return TritonGemmConfig(64, 128, 64, 8, 4, 4)
    if m <= 256:  # two warp groups on 128 x 256 where the tiles still fill the chip (1.4x gate_up's speed)
        if wide:
            return TritonGemmConfig(128, 256, 64, 8, 8, 3)
        if k > 8192:
            return TritonGemmConfig(64, 128, 128, 8, 4, 3)
        if n > k:
            return TritonGemmConfig(128, 128, 64, 8, 8, 4)
        return TritonGemmConfig(64, 128, 64, 8, 4, 5)
    return TritonGemmConfig(128, 256, 64, 8, 8, 3)


def moe_tile(m: int, e: int, h: int, inter: int, top_k: int):
    """The fused-MoE tile for m rows: vLLM's default rule by M (`stock_config`), which stock and detent both
    follow. Harmless for the bits, like the GEMM tile: on the H200 every tile field changed alone gives the
    same bits (benchmarks/gpu_moe.py), and rows keep their bits across the rule's switch at M = E
    (tests/kernels/test_gpu_moe.py). det keeps one fixed tile."""
    from detent_audit.kernels.triton_moe import stock_config

    return stock_config(m, e, h, inter, top_k)


@dataclass(frozen=True)
class AttentionLaunch:
    """How an attention launch is shaped: packed query rows per program, warps, pipeline stages. Not a
    selection point: a launch shape is used only where it gives the default's bits on the device
    (benchmarks/gpu_attention.py's tile check, tests/kernels/test_gpu_attention.py); decode and prefill
    launches may differ (benchmarks/gpu_decode_variants.py times decode's)."""

    block_m: int = 64
    num_warps: int = 4
    num_stages: int = 2


PREFILL_LAUNCH = AttentionLaunch()
DECODE_LAUNCH = AttentionLaunch()  # a launch whose every query row is a decode token


def selected_attention_config(params: AttentionParams, streaming: bool = False, decode: bool = False):
    """The Triton attention config of selected params (det/detent; the tuner's candidates): the KV tile and
    split stride they name (0: one split), in the launch shape of a decode or a prefill launch."""
    from detent_audit.kernels.triton_attention import TritonAttentionConfig

    launch = DECODE_LAUNCH if decode else PREFILL_LAUNCH
    return TritonAttentionConfig(block_m=launch.block_m, block_n=params.kv_tile,
                                 split=params.split_stride or NO_SPLIT, num_warps=launch.num_warps,
                                 num_stages=launch.num_stages, streaming=streaming)


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
        return selected_attention_config(p, self.streaming, decode=max_seqlen_q == 1)

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
