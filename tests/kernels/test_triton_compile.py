"""Opt-in CPU tier: every Triton kernel compiles for Hopper (sm90) ahead of time to PTX, no GPU needed.
Catches what the interpreter lets through (it runs the Python body on numpy and checks no layouts, types
or lowering) before device time is spent on it. DETENT_TRITON_COMPILE=1 runs it:
    DETENT_TRITON_COMPILE=1 .venv/bin/pytest -q tests/kernels/test_triton_compile.py   (Triton installed)
"""

from __future__ import annotations

import os

import pytest

if os.environ.get("DETENT_TRITON_COMPILE") != "1":
    pytest.skip("the ahead-of-time compile tier is opt-in (DETENT_TRITON_COMPILE=1)", allow_module_level=True)
triton = pytest.importorskip("triton")
if os.environ.get("TRITON_INTERPRET") == "1":
    pytest.skip("run without TRITON_INTERPRET (it replaces the kernels)", allow_module_level=True)

from detent_audit.kernels import triton_attention as ta  # noqa: E402
from detent_audit.kernels import triton_gemm as tg  # noqa: E402
from detent_audit.kernels import triton_moe as tm  # noqa: E402
from detent_audit.kernels import triton_rowlocal as tr  # noqa: E402
from detent_audit.kernels.triton_aot import ATTENTION, GEMM, GEMM_UNIT_STRIDES, MOE, ROWLOCAL, compile_sm90  # noqa: E402


def _compile(fn, types: dict[str, str], constexprs: dict[str, object], **options) -> None:
    """Compile `fn` for sm90 as a launch on the device would specialise it; PTX must come out."""
    assert compile_sm90(fn, types, constexprs, **options).asm["ptx"]


@pytest.mark.parametrize(("d", "g", "block_n"), [(128, 4, 64), (64, 4, 32), (128, 8, 128)])
def test_attention_kernels_compile(d: int, g: int, block_n: int) -> None:
    shape: dict[str, object] = dict(H=8 * g, HKV=8, D=d, G=g, BLOCK_M=64, BLOCK_N=block_n, PAGE=16)
    for decode in (True, False):
        shape["DECODE"] = decode
        for direct in (True, False):
            _compile(ta._attn_partial, ATTENTION, {**shape, "DIRECT": direct}, num_warps=4, num_stages=2)
        _compile(ta._attn_folded, ATTENTION, shape, num_warps=4, num_stages=2)
        _compile(ta._attn_folded_one_pass, ATTENTION, shape, num_warps=4, num_stages=2)
        _compile(ta._attn_split_fold, ATTENTION, shape, num_warps=4, num_stages=2)
    _compile(ta._attn_combine, ATTENTION, dict(H=8 * g, D=d))


def test_gemm_compiles_for_every_tile_the_engine_picks() -> None:
    from detent_audit.kernels.gpu import gemm_tile

    for m, n in ((1, 4096), (1, 28672), (32, 4096), (64, 4096), (200, 4096), (4096, 4096)):
        t = gemm_tile(m, n, 4096)
        _compile(tg._persistent_matmul, GEMM, dict(BLOCK_M=t.block_m, BLOCK_N=t.block_n, BLOCK_K=t.block_k,
                                                    GROUP_M=t.group_m, HAS_BIAS=False, **GEMM_UNIT_STRIDES),
                 num_warps=t.num_warps, num_stages=t.num_stages)


def test_rowlocal_kernels_compile() -> None:
    for residual in (True, False):
        _compile(tr._rms_norm, ROWLOCAL, dict(HAS_RESIDUAL=residual, BLOCK=4096), num_warps=4)
    _compile(tr._silu_and_mul, ROWLOCAL, dict(BLOCK=1024))
    for norm in (True, False):
        _compile(tr._qkv_prologue, ROWLOCAL, dict(H=32, HKV=8, D=128, HAS_NORM=norm), num_warps=1)


def test_moe_kernels_compile() -> None:
    _compile(tm._align_kernel, MOE, dict(BLOCK_M=64, BLOCK_E=128, CHUNK=32, NUM_CHUNKS=8), num_warps=4)
    route_constexprs = {n: v for n, v in dict(TOP_K=8, BLOCK_E=128, BLOCK_SLOTS=8, RENORMALIZE=True).items()
                        if n in tm._route_kernel.arg_names}
    _compile(tm._route_kernel, MOE, route_constexprs)
