"""gemm.linear: with GemmParams a row's bits depend only on that row; stock F.linear is shown not to be."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from detent_audit.kernels import gemm, reference
from detent_audit.kernels.params import GemmParams

DTYPES = [torch.float32, torch.bfloat16]
CHUNKS = [1, 4, 16, 64]
# Tolerance against the float64 reference, relative to sqrt(K) * max|x| * max|w| (the size of a dot product's
# rounding error): fp32 1e-6, bf16 output rounding (2^-8) dominates: 1e-2.
REL_TOL = {torch.float32: 1e-6, torch.bfloat16: 1e-2}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("chunk_rows", CHUNKS)
def test_prefix_rows_match_the_whole_batch(threads, randn, dtype, chunk_rows):
    x, w, b = randn(64, 96, dtype=dtype), randn(80, 96, dtype=dtype), randn(80, dtype=dtype)
    params = GemmParams(chunk_rows)
    full = gemm.linear(x, w, b, params=params)
    assert full.dtype == dtype and full.shape == (64, 80)
    for k in (1, 2, 3, 5, 8, 17, 33, 63):
        assert torch.equal(gemm.linear(x[:k], w, b, params=params), full[:k]), k


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("chunk_rows", [2, 16])
def test_rows_permuted_or_alone_keep_their_bits(threads, randn, gen, dtype, chunk_rows):
    x, w = randn(40, 128, dtype=dtype), randn(64, 128, dtype=dtype)
    params = GemmParams(chunk_rows)
    full = gemm.linear(x, w, params=params)
    perm = torch.randperm(40, generator=gen)
    assert torch.equal(gemm.linear(x[perm], w, params=params), full[perm])
    probe = x[7:8]
    alone = gemm.linear(probe, w, params=params)
    for size in (1, 2, 5, 16, 31, 64):
        batch = randn(size, 128, dtype=dtype)
        at = int(torch.randint(size, (1,), generator=gen))
        batch[at] = probe[0]
        assert torch.equal(gemm.linear(batch, w, params=params)[at], alone[0]), (size, at)


@pytest.mark.parametrize("chunk_rows", [1, 4, 32])
def test_fp32_batched_path_equals_one_lone_product_per_chunk(threads, randn, chunk_rows):
    x, w = randn(3 * chunk_rows, 256, dtype=torch.float32), randn(384, 256)
    out = gemm.linear(x, w, params=GemmParams(chunk_rows))
    lone = torch.cat([F.linear(c, w) for c in x.split(chunk_rows)])
    assert torch.equal(out, lone)


@pytest.mark.parametrize("dtype", DTYPES)
def test_close_to_float64_reference(randn, dtype):
    x, w, b = randn(37, 200, dtype=dtype), randn(50, 200, dtype=dtype), randn(50, dtype=dtype)
    ref = reference.linear(x, w, b)
    scale = 200**0.5 * x.abs().max().double() * w.abs().max().double()
    for params in (None, GemmParams(1), GemmParams(16)):
        err = (gemm.linear(x, w, b, params=params).double() - ref).abs().max()
        assert err <= REL_TOL[dtype] * scale, (params, float(err))


def test_leading_dims_and_empty_batch(randn):
    x, w = randn(2, 3, 32), randn(8, 32)
    out = gemm.linear(x, w, params=GemmParams(4))
    assert out.shape == (2, 3, 8)
    assert torch.equal(out.view(6, 8), gemm.linear(x.view(6, 32), w, params=GemmParams(4)))
    assert gemm.linear(x[:0, 0], w, params=GemmParams(4)).shape == (0, 8)


def test_stock_is_not_batch_invariant_on_this_cpu(threads, randn):
    """Recorded fact: fp32 F.linear gives a row other bits at M=1 than inside M=7 (measured on this CPU)."""
    x, w = randn(7, 256), randn(384, 256)
    if torch.equal(gemm.linear(x[:1], w), gemm.linear(x, w)[:1]):
        pytest.skip("stock F.linear happened to be invariant for this shape on this machine")
    assert not torch.equal(gemm.linear(x[:1], w), gemm.linear(x, w)[:1])


@settings(max_examples=25, deadline=None)
@given(
    rows=st.integers(1, 48),
    k=st.integers(1, 48),
    chunk_rows=st.sampled_from([1, 2, 8, 32]),
    seed=st.integers(0, 2**31 - 1),
)
def test_prefix_property(rows, k, chunk_rows, seed):
    """For all batch sizes and prefixes: f(x[:k]) == f(x)[:k] bitwise (fp32, the thread count in force)."""
    k = min(k, rows)
    g = torch.Generator().manual_seed(seed)
    x, w = torch.randn(rows, 48, generator=g), torch.randn(40, 48, generator=g)
    params = GemmParams(chunk_rows)
    assert torch.equal(gemm.linear(x[:k], w, params=params), gemm.linear(x, w, params=params)[:k])
