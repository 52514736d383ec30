"""Batch-invariant GEMM on CPU, in one of three forms (`GemmParams.form`).

`linear(x, weight, bias, params=None)` is torch's F.linear on the whole batch (stock). With `GemmParams`:
- "chunk": rows are processed in chunks of exactly `chunk_rows`, the last chunk zero-padded, so every matrix
  product the BLAS sees has M == chunk_rows whatever the batch size (invariant by construction);
- "pad": one F.linear over the whole batch, zero-padded to at least `chunk_rows` rows: at M >= chunk_rows
  it is exactly stock's call (invariant only where the BLAS gives a row the same bits at every
  M >= chunk_rows);
- "row": every row its own one-row product (MKL's gemv; fp32 batches of rows through one batched gemm);
- "fixed": the project's own product in C, every operation's order written out (gemm_c.py): invariant by
  construction and the same bits on every CPU, slower than MKL; fp32 only.
The pad and row forms rest on the BLAS, so the engine proves them where it runs before it uses them
(`gemm_probe.py`). The bias is added after the product (a row-local, correctly rounded add), as
batch_invariant_ops adds it after the K loop.

Measured on the CPU of benchmarks/RESULTS.md's "Real model" section (AMD EPYC, AVX2, no AVX-512; torch 2.13
CPU build, MKL 2024.2 for fp32, oneDNN for bf16; the model's shapes 576x960, 576x576, 576x3072, 1536x576,
576x49152 and smaller ones; fresh random rows, M 1..300, random subsets and permutations):
- fp32 F.linear at 1 thread: a row's bits take one value at M=1 (gemv), another at M=2..3, and a third, the
  same, for EVERY M >= 4, whatever the row's position or neighbours: the pad form at 4 rows holds, and a
  batch of 4 or more rows needs neither padding nor chunks (detent's product is stock's).
- At 2 threads the rows are split between the threads and M in 5..11 gave other bits (rows in a remainder
  block; the probe proved pad at 12 there), so the pad form is used at one thread only
  (kernels/gemm_probe.py refuses it at more).
- torch.bmm over [M, 1, K] x an expanded weight [M, K, N] (stride 0, MKL batch gemm) gives every row exactly
  F.linear's M=1 (gemv) bits, at 1 and 2 threads: the row form. It reads the weight once per row: at batch 1
  it costs what stock's gemv costs, at batch 8 about twice stock's one product (RESULTS.md).
- Padding a lone row to 4 costs 2-4x the gemv (576x3072: 0.27 ms at M=1, 1.1 ms at M=4; the LM head 576x49152:
  17 ms against 32-36 ms): a lone row cannot have the gemv's speed and the batch's bits at once.
- fp32 torch.bmm over [C, chunk, K] x expanded weight [C, K, N] gives every chunk exactly the bits of F.linear
  on that chunk alone, for any number of chunks (the chunk form uses it); torch.matmul([C, chunk, K], [K, N])
  is NOT equivalent: it folds to one [C*chunk, K] product (M changes), so it is never used.
- With M fixed to a power of two (1..256), a row's bits did not depend on its position inside the chunk nor
  on the other rows (zeros or data) at 1-8 threads (an earlier AVX-512 CPU; tests/kernels re-check 1 and 2).
- bf16 (oneDNN): M=1 differed from M>=2 for some shapes on the earlier CPU (K=4864, N=896); bf16 torch.bmm
  with an expanded weight is 5-20x slower than a loop of F.linear calls, so bf16 (any non-fp32 dtype) loops.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from detent_audit.kernels.gemm_c import linear as fixed_order_linear
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
    elif params.form == "fixed":
        out = fixed_order_linear(x2, weight)
    else:
        out = _chunked_matmul(x2, weight, params.chunk_rows)
    if bias is not None:
        out = out + bias
    return out.reshape(*lead, weight.shape[0])
