"""Batch-invariant GEMM on CPU: rows go to the BLAS in fixed-size, zero-padded chunks.

`linear(x, weight, bias, params=None)` is torch's F.linear on the whole batch (stock). With `GemmParams`,
rows are processed in chunks of exactly `chunk_rows`, the last chunk zero-padded, so every matrix product the
BLAS sees has M == chunk_rows whatever the batch size. The bias is added after the product (a row-local,
correctly rounded add), as batch_invariant_ops adds it after the K loop.

Measured on this CPU (torch 2.13 CPU build, MKL 2024.2 for fp32, oneDNN for bf16, AVX-512; 1 and 2 threads,
also 3, 4 and 8 threads oversubscribed; K, N in {64..4864}):
- fp32 F.linear is NOT batch-invariant: a row's bits take one value at M=1, another at M=2..3 and a third at
  M>=4 (1 thread). At 2 threads the M rows are split between threads, and rows that land in a remainder
  block (M in 5..11: rows 4.. ) get yet other bits, so a row's bits also depend on its position in the batch.
- bf16 F.linear: M=1 differs from M>=2 for some shapes (K=4864, N=896); otherwise row bits were stable.
- At a fixed M, 1 and 2 threads gave identical bits in every shape tried (the thread count still belongs in
  the deployment facts: it decides which M values split).
- With M fixed to a power of two (1..256), a row's bits do not depend on its position inside the chunk nor
  on the other rows of the chunk (zeros or data), nor on the thread count (1, 2, 3, 4, 8). M in 5..11 is
  position-dependent at 2 threads (the remainder rows), and M = 7 also changed bits between 1 and 2 or 8
  threads; hence GemmParams allows powers of two only.
- fp32 torch.bmm over [C, chunk, K] x expanded weight [C, K, N] (stride 0, MKL batch gemm) gives every chunk
  exactly the bits of F.linear on that chunk alone, for any number of chunks, and is faster than a Python
  loop; it is used for fp32. torch.matmul([C, chunk, K], [K, N]) is NOT equivalent: it folds to one
  [C*chunk, K] product (M changes), so it is never used.
- bf16 torch.bmm with an expanded weight is 5-20x slower than a loop of F.linear calls (oneDNN reorders the
  weight per batch element), so bf16 (and any non-fp32 dtype) loops over chunks with F.linear.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from detent_audit.kernels.params import GemmParams


def _pad_rows(x: torch.Tensor, rows: int) -> torch.Tensor:
    """x: [M, K] -> [rows, K] with zero rows appended (no copy when M == rows)."""
    if x.shape[0] == rows:
        return x.contiguous()
    padded = x.new_zeros(rows, x.shape[1])
    padded[: x.shape[0]] = x
    return padded


def _chunked_matmul(x: torch.Tensor, weight: torch.Tensor, chunk_rows: int) -> torch.Tensor:
    """x: [M, K], weight: [N, K] -> [M, N]; every BLAS call sees exactly chunk_rows rows."""
    m, k = x.shape
    n = weight.shape[0]
    num_chunks = -(-m // chunk_rows)
    padded = _pad_rows(x, num_chunks * chunk_rows)
    if x.dtype == torch.float32:
        # One MKL batch gemm; each batch element is a [chunk_rows, K] x [K, N] product (verified bitwise
        # against a lone F.linear per chunk, see the module docstring).
        w_t = weight.t().unsqueeze(0).expand(num_chunks, k, n)
        out = torch.bmm(padded.view(num_chunks, chunk_rows, k), w_t).view(num_chunks * chunk_rows, n)
    else:
        out = torch.cat([F.linear(chunk, weight) for chunk in padded.split(chunk_rows)])
    return out[:m]


def _row_by_row(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x: [M, K], weight: [N, K] -> [M, N]; each row its own one-row product (MKL's gemv for fp32)."""
    if x.shape[0] == 1:
        return F.linear(x.contiguous(), weight)
    if x.dtype == torch.float32:
        m, k = x.shape
        w_t = weight.t().unsqueeze(0).expand(m, k, weight.shape[0])
        return torch.bmm(x.contiguous().view(m, 1, k), w_t).view(m, -1)
    return torch.cat([F.linear(row, weight) for row in x.contiguous().split(1)])


@torch.no_grad()
def linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    params: GemmParams | None = None,
) -> torch.Tensor:
    """y = x @ weight.T + bias.  x: [..., K], weight: [N, K], bias: [N] -> [..., N] in x's dtype.

    params=None: F.linear on the whole batch (stock; batch-variant on this CPU, see the module docstring).
    With params: for fixed params, weight and bias, row i of the output depends only on row i of x.
    """
    if params is None:
        return F.linear(x, weight, bias)
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    if x2.shape[0] == 0:
        return x.new_empty(*lead, weight.shape[0])
    if params.form == "pad":  # one product, never fewer than chunk_rows rows
        m = x2.shape[0]
        out = F.linear(_pad_rows(x2, max(m, params.chunk_rows)), weight)[:m]
    elif params.form == "row":
        out = _row_by_row(x2, weight)
    else:
        out = _chunked_matmul(x2, weight, params.chunk_rows)
    if bias is not None:
        out = out + bias
    return out.reshape(*lead, weight.shape[0])
