"""Row-local ops: every row's bits depend only on that row; torch's own variants are recorded where they leak.

What kernels/rowlocal.py relies on, measured on a CPU (torch 2.13; fp32 and bf16; 1 and 2 threads; a row
alone against rows 1..128 of a batch, rows reversed; widths 1..262144) and checked here wherever it runs:
- invariant: log_softmax, softmax, logsumexp, amax, argmax, sort, topk, cumsum over the last dim at every
  width tried (151936 included); sum/mean over the last dim for widths < 32768; elementwise exp, log, sin,
  cos, tanh, rsqrt (fp32), sqrt, +, -, *, / (independent of the element's position in the tensor).
- NOT invariant: (1) sum/mean over a last dim of >= 32768 elements at 2 threads: a lone row (one output) is
  reduced by both threads in two halves, a row inside a batch by one thread, so its bits differ (this also
  hits F.rms_norm); (2) fp32 torch.sigmoid / F.silu: an element's bits depend on whether it falls in the
  vectorised body or the tail of the tensor, i.e. on the tensor's size; (3) fp32 F.gelu on a 1-element
  tensor, bf16 torch.rsqrt on small tensors (not used).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers import LlamaConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from detent_audit.errors import BadInput
from detent_audit.kernels import reference, rowlocal
from detent_audit.kernels.rowlocal import RopeCache

DTYPES = [torch.float32, torch.bfloat16]
# Against float64: fp32 math rounds ~1e-6 relative; bf16 outputs are rounded to 8 bits (~4e-3 relative).
TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.bfloat16: dict(rtol=2e-2, atol=2e-2)}
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 64}


def _check_row_invariance(fn, x: torch.Tensor, gen: torch.Generator) -> None:
    """fn(x[:k]) == fn(x)[:k], rows permuted keep bits, a row alone equals itself inside the batch."""
    full = fn(x)
    for k in (1, 2, 3, 7, 16, x.shape[0] - 1):
        assert torch.equal(fn(x[:k]), full[:k]), k
    perm = torch.randperm(x.shape[0], generator=gen)
    assert torch.equal(fn(x[perm]), full[perm])
    for row in (0, x.shape[0] // 2, x.shape[0] - 1):
        assert torch.equal(fn(x[row : row + 1]), full[row : row + 1]), row


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("width", [64, 896, 40000])
def test_rms_norm(threads, randn, gen, dtype, width):
    rows = 20 if width > 4096 else 64
    x, weight = randn(rows, width, dtype=dtype, scale=3.0), randn(width, dtype=dtype)
    fn = lambda t: rowlocal.rms_norm(t, weight, 1e-6)  # noqa: E731
    _check_row_invariance(fn, x, gen)
    torch.testing.assert_close(fn(x).double(), reference.rms_norm(x, weight, 1e-6), **TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul(threads, randn, gen, dtype):
    x = randn(64, 2 * 37, dtype=dtype, scale=4.0)
    _check_row_invariance(rowlocal.silu_and_mul, x, gen)
    torch.testing.assert_close(rowlocal.silu_and_mul(x).double(), reference.silu_and_mul(x), **TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("width", [32, 40000])
def test_log_softmax(threads, randn, gen, dtype, width):
    x = randn(24, width, dtype=dtype, scale=5.0)
    _check_row_invariance(rowlocal.log_softmax, x, gen)
    assert rowlocal.log_softmax(x).dtype == torch.float32
    tol = dict(rtol=1e-5, atol=1e-4)  # log-probabilities of the same (already rounded) inputs
    torch.testing.assert_close(rowlocal.log_softmax(x).double(), reference.log_softmax(x), **tol)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("scaling", [None, LLAMA3], ids=["default", "llama3"])
def test_rope(threads, randn, gen, dtype, scaling):
    cache = RopeCache.build(head_dim=16, rope_theta=10000.0, max_positions=256, rope_scaling=scaling)
    q, k = randn(48, 4, 16, dtype=dtype), randn(48, 2, 16, dtype=dtype)
    positions = torch.randint(0, 256, (48,), generator=gen)
    full = rowlocal.rope(q, k, positions, cache)
    for n in (1, 5, 47):
        part = rowlocal.rope(q[:n], k[:n], positions[:n], cache)
        assert torch.equal(part.q, full.q[:n]) and torch.equal(part.k, full.k[:n])
    perm = torch.randperm(48, generator=gen)
    moved = rowlocal.rope(q[perm], k[perm], positions[perm], cache)
    assert torch.equal(moved.q, full.q[perm]) and torch.equal(moved.k, full.k[perm])
    ref = reference.rope(q, k, positions, cache)
    torch.testing.assert_close(full.q.double(), ref.q, **TOL[dtype])
    torch.testing.assert_close(full.k.double(), ref.k, **TOL[dtype])


@pytest.mark.parametrize("scaling", [None, LLAMA3], ids=["default", "llama3"])
def test_rope_tables_match_transformers(scaling):
    """Our inverse frequencies are HF's bit for bit (the tables define the model)."""
    config = LlamaConfig(hidden_size=64, num_attention_heads=4, rope_theta=500000.0, rope_scaling=scaling,
                         max_position_embeddings=128)
    if scaling is None:
        inv_freq = 1.0 / (500000.0 ** (torch.arange(0, 16, 2, dtype=torch.float) / 16))
    else:
        inv_freq, _ = ROPE_INIT_FUNCTIONS["llama3"](config, None)
    cache = RopeCache.build(16, 500000.0, 128, scaling)
    positions = torch.arange(128, dtype=torch.float32)
    emb = torch.cat([positions[:, None] * inv_freq] * 2, dim=-1)
    assert torch.equal(cache.cos, emb.cos()) and torch.equal(cache.sin, emb.sin())


def test_rope_rejects_bad_input(randn):
    with pytest.raises(BadInput):
        RopeCache.build(16, 10000.0, 64, {"rope_type": "yarn", "factor": 2.0})
    with pytest.raises(BadInput):
        RopeCache.build(16, 10000.0, 64, {"rope_type": "llama3", "factor": 2.0})
    cache = RopeCache.build(16, 10000.0, 8)
    with pytest.raises(BadInput):
        rowlocal.rope(randn(1, 1, 16), randn(1, 1, 16), torch.tensor([8]), cache)


def test_torch_wide_row_sum_is_not_invariant_at_two_threads(randn, with_threads):
    """Recorded fact: a lone 65536-wide row is summed by two threads, inside a batch by one: bits differ."""
    x = randn(4, 65536, scale=3.0)
    with with_threads(2):
        torch_alone, torch_batch = x[:1].sum(-1), x.sum(-1)[:1]
        ours_alone, ours_batch = rowlocal._row_sum(x[:1]), rowlocal._row_sum(x)[:1]
    assert torch.equal(ours_alone, ours_batch)
    if torch.equal(torch_alone, torch_batch):
        pytest.skip("torch's wide sum happened to be invariant on this machine")


def test_torch_fp32_silu_depends_on_tensor_size(randn):
    """Recorded fact: fp32 F.silu gives an element other bits in the vector tail than in the body; ours
    not."""
    x = randn(4096, scale=5.0)
    gate_up = torch.stack([x, torch.ones_like(x)], dim=-1)  # [4096, 2]: gate x, up 1
    ours = rowlocal.silu_and_mul(gate_up)
    assert all(torch.equal(rowlocal.silu_and_mul(gate_up[:n]), ours[:n]) for n in range(1, 40))
    if all(torch.equal(F.silu(x[:n]), F.silu(x)[:n]) for n in range(1, 40)):
        pytest.skip("fp32 F.silu happened to be size-independent on this machine")
