"""Batch-invariant GEMM on the GPU: a persistent Triton matmul with no split-K and a tile fixed per call site.

Every output tile is computed by one program over the whole K dimension, in BLOCK_K chunks in order, with an
fp32 accumulator: so for a fixed (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages) an element's reduction order is
the same for every M, and a row's bits depend only on that row (the rows of a tile share the matrix
instruction, whose shape is set by the tile, not by M). The tile is a selection point: it comes from the
pinned selector, never from the batch. Which tile dimensions can change a row's bits is measured on the
device (benchmarks/gpu_gemm.py), not assumed.

Importing this module needs Triton (GPU machines); the CPU path is kernels/gemm.py.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl


@dataclass(frozen=True)
class TritonGemmConfig:
    block_m: int = 128
    block_n: int = 128
    block_k: int = 64
    group_m: int = 8
    num_warps: int = 8
    num_stages: int = 3


@triton.jit(do_not_specialize=["M", "num_programs"])  # they change per call: no compile per value class
def _persistent_matmul(a_ptr, b_ptr, c_ptr, bias_ptr, M, N, K,
                       stride_am, stride_ak, stride_bk, stride_bn, stride_cm, stride_cn, num_programs,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                       GROUP_M: tl.constexpr, HAS_BIAS: tl.constexpr):
    pid = tl.program_id(0)
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    num_tiles = num_pid_m * num_pid_n
    k_tiles = tl.cdiv(K, BLOCK_K)
    num_in_group = GROUP_M * num_pid_n
    for tile_id in range(pid, num_tiles, num_programs):
        # grouped ordering of output tiles (L2 reuse); it changes which program computes a tile, not how
        group_id = tile_id // num_in_group
        first_m = group_id * GROUP_M
        group_size_m = min(num_pid_m - first_m, GROUP_M)
        pid_m = first_m + (tile_id % group_size_m)
        pid_n = (tile_id % num_in_group) // group_size_m
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for ki in range(k_tiles):  # the whole K, in order: no split-K
            offs_k = ki * BLOCK_K + tl.arange(0, BLOCK_K)
            a = tl.load(a_ptr + offs_m[:, None] * stride_am + offs_k[None, :] * stride_ak,
                        mask=(offs_m[:, None] < M) & (offs_k[None, :] < K), other=0.0)
            b = tl.load(b_ptr + offs_k[:, None] * stride_bk + offs_n[None, :] * stride_bn,
                        mask=(offs_k[:, None] < K) & (offs_n[None, :] < N), other=0.0)
            acc = tl.dot(a, b, acc)
        if HAS_BIAS:
            acc += tl.load(bias_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)[None, :]
        c = acc.to(c_ptr.dtype.element_ty)
        tl.store(c_ptr + offs_m[:, None] * stride_cm + offs_n[None, :] * stride_cn, c,
                 mask=(offs_m[:, None] < M) & (offs_n[None, :] < N))


_NUM_SMS: dict[int, int] = {}


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           config: TritonGemmConfig = TritonGemmConfig()) -> torch.Tensor:
    """y = x @ weight.T (+ bias). x: [M, K], weight: [N, K] -> [M, N] in x's dtype; row i depends on x[i]."""
    m, k = x.shape
    n = weight.shape[0]
    dev = x.device.index or 0
    if dev not in _NUM_SMS:  # (Triton's CPU interpreter: any count)
        _NUM_SMS[dev] = torch.cuda.get_device_properties(x.device).multi_processor_count if x.is_cuda else 4
    out = torch.empty((m, n), device=x.device, dtype=x.dtype)
    if m == 0:
        return out
    tiles = triton.cdiv(m, config.block_m) * triton.cdiv(n, config.block_n)
    # persistent (one program per SM) once the tiles fill the chip; below that one program per tile, so a
    # memory-bound small-M call keeps every SM's loads in flight. Which program computes a tile never
    # changes how it is computed.
    grid = (tiles if tiles <= 4 * _NUM_SMS[dev] else _NUM_SMS[dev],)
    _persistent_matmul[grid](
        x, weight, out, bias if bias is not None else out, m, n, k,
        x.stride(0), x.stride(1), weight.stride(1), weight.stride(0), out.stride(0), out.stride(1), grid[0],
        BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k, GROUP_M=config.group_m,
        HAS_BIAS=bias is not None, num_warps=config.num_warps,
        num_stages=config.num_stages)
    return out
