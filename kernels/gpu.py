"""The KernelSet on a CUDA device: the model's calls routed to the Triton kernels (detent/det) or to the
vendor's (stock: cuBLAS and padded SDPA, selection reading the batch).

Measured on an H200 (benchmarks/gpu_gemm.py, gpu_attention.py): the GEMM tile does not change a row's bits,
so its tile follows M for speed; the attention's BLOCK_N and split stride do, so they come from the pinned
selection (the tuple), and its BLOCK_M stays 64 (16 changes the matrix instruction, and the bits). Row-local
ops are the same torch code as on the CPU; whether they are batch-invariant on the GPU is what the battery
measures there.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from detent_audit.kernels import attention as attention_ops
from detent_audit.kernels import rowlocal
from detent_audit.kernels.attention_metadata import AttentionMetadata, write_kv
from detent_audit.kernels.params import AttentionParams


def gemm_tile(m: int):
    """The GEMM tile for M rows (harmless for the bits; fastest measured per M range on the H200)."""
    from detent_audit.kernels.triton_gemm import TritonGemmConfig

    if m <= 64:
        return TritonGemmConfig(64, 64, 128, 8, 4, 3)
    if m <= 256:
        return TritonGemmConfig(64, 128, 64, 8, 4, 4)
    return TritonGemmConfig(128, 256, 64, 8, 8, 3)


@dataclass
class GpuKernelSet:
    mode: str                                 # stock | det | detent
    attention_params: AttentionParams | None  # the pinned kv tile and split stride (None: stock)
    _plan: tuple | None = None                # (the step's metadata, its attention plan)

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if self.mode == "stock":
            return F.linear(x, weight, bias)
        from detent_audit.kernels.triton_gemm import linear

        x2 = x.reshape(-1, x.shape[-1])
        return linear(x2, weight, bias, gemm_tile(x2.shape[0])).reshape(*x.shape[:-1], weight.shape[0])

    def attention(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                  scale: float) -> torch.Tensor:
        if self.mode == "stock":
            return attention_ops.paged_attention(q, k_cache, v_cache, _on(meta, q.device), scale=scale, params=None)
        from detent_audit.kernels.triton_attention import TritonAttentionConfig, paged_attention, plan_step

        p = self.attention_params
        cfg = TritonAttentionConfig(block_m=64, block_n=p.kv_tile, split=p.split_stride or 1 << 30)
        if self._plan is None or self._plan[0] is not meta:  # one plan per step, shared by its layers
            self._plan = (meta, plan_step(meta.cu_seqlens_q, meta.context_lens, meta.block_tables, cfg, q.device))
        return paged_attention(q, k_cache, v_cache, meta.cu_seqlens_q, meta.context_lens, meta.block_tables, scale,
                               cfg, plan=self._plan[1])

    def write_kv(self, k, v, k_cache, v_cache, slot_mapping) -> None:
        # no negative slots here (CUDA-graph padding rows write a scratch block): no host-side check, so
        # the call stays capturable
        write_kv(k, v, k_cache, v_cache, slot_mapping, skip_negative=False)

    def moe(self, x, router_logits, w13, w2, top_k: int, renormalize: bool) -> torch.Tensor:
        raise NotImplementedError("MoE on the GPU is not implemented yet (issue 5)")

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return rowlocal.rms_norm(x, weight, eps)

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        return rowlocal.silu_and_mul(x)

    def rope(self, q, k, positions, cos_sin):
        # positions come from the engine, which bounds them by max_model_len <= the table: no host-side check
        return rowlocal.rope(q, k, positions, cos_sin, check_range=False)

    def log_softmax(self, x: torch.Tensor) -> torch.Tensor:
        return rowlocal.log_softmax(x)


def _on(meta: AttentionMetadata, device: torch.device) -> AttentionMetadata:
    return AttentionMetadata(meta.cu_seqlens_q.to(device), meta.context_lens.to(device), meta.seq_lens.to(device),
                             meta.block_tables.to(device), meta.slot_mapping.to(device), meta.max_seqlen_q,
                             meta.max_seqlen_k)
