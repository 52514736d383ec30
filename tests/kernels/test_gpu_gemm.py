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
