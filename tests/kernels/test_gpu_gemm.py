"""GPU tier: the Triton persistent GEMM's rows do not depend on M, nor on the tile (measured on an H200 with
Triton 3.6, benchmarks/gpu_gemm.py). Skipped without CUDA and Triton."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)
triton_gemm = pytest.importorskip("detent_audit.kernels.triton_gemm")

CONFIGS = [triton_gemm.TritonGemmConfig(64, 128, 64, 8, 4, 4),
           triton_gemm.TritonGemmConfig(128, 256, 64, 8, 8, 3),
           triton_gemm.TritonGemmConfig(16, 64, 64, 8, 4, 4),
           triton_gemm.TritonGemmConfig(64, 64, 128, 8, 4, 3),
           triton_gemm.TritonGemmConfig(16, 32, 256, 8, 4, 4),
           triton_gemm.TritonGemmConfig(16, 64, 256, 8, 4, 4)]


@pytest.mark.parametrize(("k", "n"), [(4096, 4096), (14336, 4096), (512, 1000)])
def test_rows_do_not_depend_on_m_nor_on_the_tile(k: int, n: int) -> None:
    g = torch.Generator(device="cuda").manual_seed(k + n)
    x = torch.randn(1500, k, device="cuda", dtype=torch.bfloat16, generator=g)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=g) * 0.02
    ref = triton_gemm.linear(x, w, config=CONFIGS[0])
    for cfg in CONFIGS:
        for m in (1, 3, 64, 129, 1500):
            assert torch.equal(triton_gemm.linear(x[:m], w, config=cfg), ref[:m]), (cfg, m)
    want = x[:64].double() @ w.double().t()
    err = ((ref[:64].double() - want).norm() / want.norm()).item()
    assert err < 1e-2  # bf16 operands, fp32 accumulation


def test_bias_and_empty() -> None:
    x = torch.randn(5, 256, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(384, 256, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(384, device="cuda", dtype=torch.bfloat16)
    got = triton_gemm.linear(x, w, b)
    want = torch.nn.functional.linear(x.float(), w.float(), b.float())
    assert ((got.float() - want).norm() / want.norm()).item() < 1e-2
    assert triton_gemm.linear(x[:0], w).shape == (0, 384)


@pytest.mark.parametrize(("k", "n"), [(4096, 6144), (4096, 4096), (4096, 28672), (14336, 4096)])
def test_every_engine_tile_gives_a_row_the_reference_bits(k: int, n: int) -> None:
    """The tiles `gemm_tile` picks per shape and row count (Llama-3.1-8B's projections) give the rows of any
    M the reference tile's bits: the tile follows the shape without touching a bit."""
    from detent_audit.kernels.gpu import gemm_tile

    g = torch.Generator(device="cuda").manual_seed(k * 3 + n)
    x = torch.randn(300, k, device="cuda", dtype=torch.bfloat16, generator=g)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=g) * 0.02
    ref = triton_gemm.linear(x, w, config=CONFIGS[0])
    for tile in sorted({gemm_tile(m, n, k) for m in (1, 16, 32, 64, 128, 256, 300)}, key=repr):
        for m in (1, 7, 129, 256, 300):
            assert torch.equal(triton_gemm.linear(x[:m], w, config=tile), ref[:m]), (tile, m)
