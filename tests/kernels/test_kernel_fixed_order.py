"""The portable setting's C kernels (kernels/gemm_c.py, kernels/rowlocal_c.py): their bits are the C source's.

The fixed-order GEMM equals its torch oracle (the same lanes and tree in correctly rounded elementwise ops)
bit for bit; no row's bits depend on M, the other rows, the thread count or the compiler's `-mavx2`; the SiLU
and the float64 log are close to torch's and their bits do not depend on the build flags or the batch."""

from __future__ import annotations

import pytest
import torch

from detent_audit.errors import BadInput
from detent_audit.kernels import attention_c, gemm, gemm_c, rowlocal, rowlocal_c
from detent_audit.kernels.params import BadParams, GemmParams

pytestmark = pytest.mark.skipif(not attention_c.available(), reason="no C compiler here")


@pytest.fixture
def gen() -> torch.Generator:
    return torch.Generator().manual_seed(int(torch.randint(0, 2**31, ())))  # fresh inputs per run


@pytest.mark.parametrize("m,k,n", [(1, 576, 960), (5, 64, 37), (9, 13, 11), (17, 1536, 64), (6, 2048, 77)])
def test_gemm_equals_its_elementwise_oracle(gen: torch.Generator, m: int, k: int, n: int) -> None:
    x, w = torch.randn(m, k, generator=gen), torch.randn(n, k, generator=gen)
    assert torch.equal(gemm_c.linear(x, w), gemm_c.reference(x, w))


def test_a_rows_gemm_bits_depend_on_nothing_but_the_row(gen: torch.Generator) -> None:
    x, w = torch.randn(37, 576, generator=gen), torch.randn(300, 576, generator=gen)
    whole = gemm_c.linear(x, w, threads=1)
    for threads in (2, 3):
        assert torch.equal(gemm_c.linear(x, w, threads=threads), whole)
    assert torch.equal(gemm_c.linear(x, w, arch_flags=()), whole)  # without -mavx2: the same bits
    perm = torch.randperm(37, generator=gen)
    assert torch.equal(gemm_c.linear(x[perm], w)[perm.argsort()], whole)
    for m in (1, 2, 3, 4, 5, 8):
        assert torch.equal(gemm_c.linear(x[:m], w), whole[:m])


def test_the_fixed_form_runs_through_linear_with_its_bias(gen: torch.Generator) -> None:
    x, w = torch.randn(3, 7, 64, generator=gen), torch.randn(48, 64, generator=gen)
    b = torch.randn(48, generator=gen)
    out = gemm.linear(x, w, b, params=GemmParams(1, "fixed"))
    assert torch.equal(out, (gemm_c.linear(x.reshape(-1, 64), w) + b).reshape(3, 7, 48))
    torch.testing.assert_close(out, torch.nn.functional.linear(x, w, b), rtol=1e-4, atol=1e-4)
    with pytest.raises(BadParams):
        GemmParams(16, "fixed")
    with pytest.raises(BadInput):
        gemm_c.linear(x.reshape(-1, 64).double(), w.double())


def test_silu_and_mul_is_close_to_torchs_and_row_local(gen: torch.Generator) -> None:
    x = torch.randn(29, 2 * 200, generator=gen) * 8
    out = rowlocal_c.silu_and_mul(x)
    torch.testing.assert_close(out, rowlocal.silu_and_mul(x), rtol=2e-6, atol=1e-6)
    assert torch.equal(rowlocal_c.silu_and_mul(x, arch_flags=()), out)
    assert torch.equal(rowlocal_c.silu_and_mul(x[11:12]), out[11:12])
    extremes = torch.tensor([[-200.0, -88.0, -1e-30, 0.0, 1e-30, 88.0, 200.0] + [1.0] * 7])
    torch.testing.assert_close(rowlocal_c.silu_and_mul(extremes), rowlocal.silu_and_mul(extremes))


def test_log64_is_close_to_torchs_everywhere_it_is_used(gen: torch.Generator) -> None:
    u = (torch.randint(0, 2**53, (50_000,), generator=gen, dtype=torch.int64).double() + 0.5) * 2.0**-53
    for x in (u, -torch.log(u)):  # the two logs of the Gumbel noise
        out = rowlocal_c.log64(x)
        torch.testing.assert_close(out, torch.log(x), rtol=1e-15, atol=1e-300)
        assert torch.equal(rowlocal_c.log64(x, arch_flags=()), out)
    specials = torch.tensor([0.0, -1.0, 5e-324, 1.0], dtype=torch.float64)
    got = rowlocal_c.log64(specials)
    assert got[0] == -torch.inf and got[1].isnan() and got[3] == 0.0
    torch.testing.assert_close(got[2], torch.log(specials[2]))


def test_sincos_rounds_the_double_result_once(gen: torch.Generator) -> None:
    """RoPE's angles up to a 131,072-token context: the float32 rounding of the double-precision cos and sin
    (a 1-ULP slip is allowed only where the double result sits on a float32 rounding boundary), the same bits
    without -mavx2, NaN passed through, angles past 2^19 refused."""
    x = torch.cat([torch.rand(40_000, generator=gen) * 20 - 10, torch.rand(40_000, generator=gen) * 131_072,
                   torch.tensor([0.0, -0.0, 1e-30, 3.1415927, 1.5707964, 524_287.9])])
    cos, sin = rowlocal_c.sincos(x)
    for got, ref in ((cos, torch.cos(x.double()).float()), (sin, torch.sin(x.double()).float())):
        slip = (got.view(torch.int32).long() - ref.view(torch.int32).long()).abs()
        assert int(slip.max()) <= 1 and int((slip > 0).sum()) <= 2, int((slip > 0).sum())
    plain_cos, plain_sin = rowlocal_c.sincos(x, arch_flags=())
    assert torch.equal(cos, plain_cos) and torch.equal(sin, plain_sin)
    nan_cos, nan_sin = rowlocal_c.sincos(torch.tensor([float("nan")]))
    assert nan_cos.isnan().all() and nan_sin.isnan().all()
    with pytest.raises(BadInput):
        rowlocal_c.sincos(torch.tensor([524_288.0]))


# a Llama-3 table's angles (head 128, base 500,000, 131,072 positions): hashes of torch's and the C cos/sin
TABLE = """
import hashlib, torch
from detent_audit.kernels import rowlocal_c
inv = 1.0 / (500000.0 ** (torch.arange(0, 128, 2, dtype=torch.int64).float() / 128))
angles = torch.outer(torch.arange(131072, dtype=torch.float32), inv)
h = lambda *ts: hashlib.sha256(b"".join(t.numpy().tobytes() for t in ts)).hexdigest()
print(h(angles.cos(), angles.sin()), h(*rowlocal_c.sincos(angles)))
"""


def test_the_c_table_does_not_move_with_mkl_where_torchs_does() -> None:
    """Under the cap, MKL on its AVX branch (as an older CPU runs it) moves torch's float32 sin and cos of
    large angles on an Intel CPU (MKL's branches are Intel's; elsewhere nothing moves and only the C table's
    stability is checked); the C table's bits stay."""
    import os
    import subprocess
    import sys

    from detent_audit import isa

    def run(**env: str) -> list[str]:
        clean = {k: v for k, v in os.environ.items() if not k.startswith("MKL_CBWR")}
        done = subprocess.run([sys.executable, "-c", TABLE], env={**clean, **isa.PORTABLE_ENV, **env},
                              capture_output=True, text=True, timeout=300, check=True)
        return done.stdout.split()

    here, moved = run(), run(MKL_CBWR="AVX")
    assert here[1] == moved[1]
    vendor = open("/proc/cpuinfo").read() if os.path.exists("/proc/cpuinfo") else ""
    if "GenuineIntel" in vendor:
        assert here[0] != moved[0], "MKL's AVX branch left torch's sin and cos as they were: no control"
