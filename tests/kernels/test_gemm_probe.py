"""The GEMM forms pad and row, and the probe that must prove them where the engine runs.

The probe is tested for power first (kernels that break invariance at one batch size, one position or below
some row count are caught, naming that M), then the forms themselves: where the probe proves a form on this
CPU and thread count, fresh rows keep their bits in any batch; where it does not, the engine must not use it.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from detent_audit.kernels import gemm, gemm_probe
from detent_audit.kernels.params import GemmParams

SHAPES = [(96, 64), (160, 64), (64, 192)]  # (N, K): small, so every schedule runs whole
PAD4, ROW = GemmParams(4, "pad"), GemmParams(1, "row")
CHUNK = GemmParams(16)  # invariant by construction at any thread count: the base the power tests break


def _flip_low_bit(t: torch.Tensor, row: int) -> torch.Tensor:
    out = t.clone()
    out[row].view(torch.int32)[0] ^= 1
    return out


@pytest.fixture
def kernel_breaking(monkeypatch):
    """Replace gemm.linear by the real kernel with one row's lowest bit flipped when `when(M, row)` holds."""
    real = gemm.linear

    def install(when):
        def linear(x, w, bias=None, *, params=None):
            out = real(x, w, bias, params=params)
            for row in range(out.shape[0]):
                if when(out.shape[0], row):
                    out = _flip_low_bit(out, row)
            return out
        monkeypatch.setattr(gemm, "linear", linear)
    return install


@pytest.mark.parametrize("bad_m", [2, 13, 33, 48])
def test_a_kernel_wrong_at_one_batch_size_fails_there(kernel_breaking, bad_m):
    kernel_breaking(lambda m, row: m == bad_m and row == 0)
    report = gemm_probe.check(CHUNK, SHAPES, memo=False)
    assert not report.ok and report.failure[1] == bad_m
    assert f"M={bad_m}" in report.describe() and "chunk:16" in report.describe()


def test_an_unbroken_kernel_passes():
    assert gemm_probe.check(CHUNK, SHAPES, memo=False).ok


def test_a_kernel_wrong_at_one_position_fails(kernel_breaking):
    # right at every M, wrong for whatever row sits at position 3 of a batch of 10 or more rows
    kernel_breaking(lambda m, row: m >= 10 and m != gemm_probe.MAX_ROWS and row == 3)
    report = gemm_probe.check(CHUNK, SHAPES, memo=False)
    assert not report.ok and report.failure[1] == 10


def test_require_refuses_naming_the_form_and_m(kernel_breaking):
    kernel_breaking(lambda m, row: m == 7)
    with pytest.raises(gemm_probe.GemmFormNotInvariant) as err:
        gemm_probe.require(ROW, SHAPES, torch.float32, what="the tuple's (row)")
    assert err.value.exit_code == 3 and err.value.remedy
    assert "the tuple's (row) embedded.gemm form" in err.value.message and "M=7" in err.value.message
    assert gemm_probe.require(GemmParams(16), SHAPES, torch.float32) is None  # the chunk form: no probe


def test_least_pad_rows_walks_up_past_the_failures(monkeypatch):
    real = gemm.linear

    def linear(x, w, bias=None, *, params=None):  # a BLAS whose bits settle only from 9 rows on
        out = real(x, w, bias, params=params)
        blas_m = max(x.shape[0],
                     params.chunk_rows) if params is not None and params.form == "pad" else x.shape[0]
        return out + 1e-3 if blas_m < 9 else out
    monkeypatch.setattr(gemm, "linear", linear)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)  # the pad form is walked at one thread only
    gemm_probe._MEMO.clear()
    try:
        assert gemm_probe.least_pad_rows(SHAPES) == 12
    finally:
        gemm_probe._MEMO.clear()


def test_plan_keeps_the_budget_and_the_dense_floor():
    for n, k in [(960, 576), (49152, 576), (64, 64)]:
        for form in ("pad", "row"):
            ref, sizes = gemm_probe.plan(n, k, form)
            assert list(sizes) == sorted(set(sizes)) and max(sizes) <= ref <= gemm_probe.MAX_ROWS
            floor = gemm_probe._DENSE_FLOOR[form]
            assert set(range(1, floor + 1)) <= set(sizes)
            budget = gemm_probe.MACS_PER_SHAPE if form == "pad" else gemm_probe.ROW_FORM_MACS_PER_SHAPE
            assert (ref + sum(sizes)) * n * k <= max(budget, (ref + sum(range(1, floor + 1))) * n * k)
    assert gemm_probe.plan(64, 64, "pad") == (256, gemm_probe.batch_sizes(256))


@pytest.mark.parametrize("params", [PAD4, ROW, GemmParams(12, "pad")], ids=lambda p: p.label)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_where_the_probe_proves_a_form_fresh_rows_keep_their_bits(threads, randn, gen, params, dtype):
    report = gemm_probe.check(params, SHAPES, dtype, memo=False)
    if not report.ok:
        pytest.skip(f"not proven here: {report.describe()}")  # the engine refuses it (tests/engine)
    n, k = 224, 64  # not a probed shape
    x, w, b = randn(300, k, dtype=dtype), randn(n, k, dtype=dtype), randn(n, dtype=dtype)
    if not gemm_probe.check(params, [(n, k)], dtype, memo=False).ok:
        pytest.skip("not proven on this shape")
    full = gemm.linear(x, w, b, params=params)
    for m in (1, 2, 3, 4, 5, 9, 12, 17, 64, 129, 299):
        rows = torch.randperm(300, generator=gen)[:m]
        assert torch.equal(gemm.linear(x[rows], w, b, params=params), full[rows]), m


def test_pad_is_stocks_product_from_its_rows_and_row_is_the_lone_product(randn):
    x, w = randn(9, 128), randn(96, 128)
    assert torch.equal(gemm.linear(x, w, params=PAD4), F.linear(x, w))      # M >= 4: exactly stock's call
    padded = torch.cat([x[:2], x.new_zeros(2, 128)])
    assert torch.equal(gemm.linear(x[:2], w, params=PAD4), F.linear(padded, w)[:2])
    assert torch.equal(gemm.linear(x[:1], w, params=ROW), F.linear(x[:1], w))
    assert gemm.linear(x[:0], w, params=PAD4).shape == (0, 96)


def test_the_pad_form_at_four_rows_on_this_cpu(threads):
    """What the module docstring records: at one thread pad:4 holds on the model-like shapes (an AVX2 CPU
    with MKL; a CPU where this differs fails this test, not the engine: the engine asks the probe). With two
    threads the pad form is never proven, nor accepted when a tuple commits it."""
    rows = gemm_probe.least_pad_rows([(576, 576), (960, 576)])
    if threads > 1:
        assert rows == 0
        with pytest.raises(gemm_probe.GemmFormNotInvariant, match="one thread only"):
            gemm_probe.require(GemmParams(4, "pad"), [(576, 576)], torch.float32)
        return
    if torch.backends.cpu.get_cpu_capability() != "AVX2":
        pytest.skip("measured on an AVX2 CPU")
    assert rows == 4
