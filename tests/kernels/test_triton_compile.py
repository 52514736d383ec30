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

from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from detent_audit.kernels import triton_attention as ta  # noqa: E402
from detent_audit.kernels import triton_gemm as tg  # noqa: E402
from detent_audit.kernels import triton_moe as tm  # noqa: E402
from detent_audit.kernels import triton_rowlocal as tr  # noqa: E402

HOPPER = GPUTarget("cuda", 90, 32)


def _compile(fn, types: dict[str, str], constexprs: dict[str, object], **options) -> None:
    """Compile `fn` with pointer/scalar `types` by argument name and the rest as constexprs."""
    signature = {name: types.get(name, "constexpr") for name in fn.arg_names}
    missing = [n for n, t in signature.items() if t == "constexpr" and n not in constexprs]
    assert not missing, f"no type or constexpr for {missing}"
    compiled = triton.compile(ASTSource(fn=fn, signature=signature, constexprs=constexprs), target=HOPPER,
                              options=options)
    assert compiled.asm["ptx"]


I32 = "i32"
ATTN = {"q_ptr": "*bf16", "k_ptr": "*bf16", "v_ptr": "*bf16", "bt_ptr": "*i32", "tile_seq_ptr": "*i32",
        "tile_row_ptr": "*i32", "tile_len_ptr": "*i32", "cu_ptr": "*i32", "ctx_ptr": "*i32", "o_ptr": "*fp32",
        "m_ptr": "*fp32", "l_ptr": "*fp32", "out_ptr": "*bf16", "scale": "fp32", "stride_bt": I32, "num_rows": I32,
        "page_size": I32, "SPLIT": I32, "num_splits": I32}


@pytest.mark.parametrize(("d", "g", "block_n"), [(128, 4, 64), (64, 4, 32), (128, 8, 128)])
def test_attention_kernels_compile(d: int, g: int, block_n: int) -> None:
    shape = dict(H=8 * g, HKV=8, D=d, G=g, BLOCK_M=64, BLOCK_N=block_n)
    for direct in (True, False):
        _compile(ta._attn_partial, ATTN, {**shape, "DIRECT": direct}, num_warps=4, num_stages=2)
    _compile(ta._attn_folded, ATTN, shape, num_warps=4, num_stages=2)
    _compile(ta._attn_combine, ATTN, dict(H=8 * g, D=d))
    _compile(ta._attn_fold_combine, ATTN, dict(H=8 * g, D=d))


def test_gemm_compiles_for_every_tile_the_engine_picks() -> None:
    from detent_audit.kernels.gpu import gemm_tile

    types = {"a_ptr": "*bf16", "b_ptr": "*bf16", "c_ptr": "*bf16", "bias_ptr": "*bf16", **{
        n: I32 for n in ("M", "N", "K", "stride_am", "stride_ak", "stride_bk", "stride_bn", "stride_cm",
                         "stride_cn", "num_programs")}}
    for m, n in ((1, 4096), (1, 28672), (32, 4096), (64, 4096), (200, 4096), (4096, 4096)):
        t = gemm_tile(m, n, 4096)
        _compile(tg._persistent_matmul, types, dict(BLOCK_M=t.block_m, BLOCK_N=t.block_n, BLOCK_K=t.block_k,
                                                    GROUP_M=t.group_m, HAS_BIAS=False),
                 num_warps=t.num_warps, num_stages=t.num_stages)


def test_rowlocal_kernels_compile() -> None:
    types = {"x_ptr": "*bf16", "r_ptr": "*bf16", "w_ptr": "*bf16", "out_ptr": "*bf16", "sum_ptr": "*bf16", "n": I32,
             "eps": "fp32", "inter": I32, "qkv_ptr": "*bf16", "pos_ptr": "*i64", "cos_ptr": "*fp32",
             "sin_ptr": "*fp32", "qw_ptr": "*bf16", "kw_ptr": "*bf16", "slot_ptr": "*i64", "q_ptr": "*bf16",
             "kc_ptr": "*bf16", "vc_ptr": "*bf16"}
    for residual in (True, False):
        _compile(tr._rms_norm, types, dict(HAS_RESIDUAL=residual, BLOCK=4096), num_warps=4)
    _compile(tr._silu_and_mul, types, dict(BLOCK=1024))
    for norm in (True, False):
        _compile(tr._qkv_prologue, types, dict(H=32, HKV=8, D=128, HAS_NORM=norm), num_warps=1)


def test_moe_kernels_compile() -> None:
    types = {"logits_ptr": "*bf16", "weights_ptr": "*fp32", "ids_ptr": "*i32", "E": I32, "stride_lm": I32,
             "sorted_ptr": "*i32", "block_expert_ptr": "*i32", "num_valid_ptr": "*i32", "scratch_ptr": "*i32",
             "num_entries": I32, "num_experts": I32, "num_blocks": I32}
    _compile(tm._align_kernel, types, dict(BLOCK_M=64, BLOCK_E=128, CHUNK=32, NUM_CHUNKS=8), num_warps=4)
    route_constexprs = {n: v for n, v in dict(TOP_K=8, BLOCK_E=128, BLOCK_SLOTS=8, RENORMALIZE=True).items()
                        if n in tm._route_kernel.arg_names}
    _compile(tm._route_kernel, types, route_constexprs)
