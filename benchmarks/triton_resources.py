"""What each Triton kernel config costs in registers, stack (spills) and shared memory on Hopper, read from
its ahead-of-time sm90 build (`cuobjdump --dump-resource-usage`, bundled with Triton): no GPU needed. What
METHOD.md asks to read before spending device time: a kernel at the 255-register ceiling with a stack frame
spills and runs one CTA per SM.

Usage: python benchmarks/triton_resources.py   (Triton installed: `make test-triton` installs it)
"""

from __future__ import annotations

import os
import re
import subprocess
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from detent_audit.kernels import triton_attention as ta
from detent_audit.kernels import triton_gemm as tg

HOPPER = GPUTarget("cuda", 90, 32)
BIN = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
ATTN = {"q_ptr": "*bf16", "k_ptr": "*bf16", "v_ptr": "*bf16", "bt_ptr": "*i32", "tile_seq_ptr": "*i32",
        "tile_row_ptr": "*i32", "tile_len_ptr": "*i32", "cu_ptr": "*i32", "ctx_ptr": "*i32", "o_ptr": "*fp32",
        "m_ptr": "*fp32", "l_ptr": "*fp32", "out_ptr": "*bf16", "scale": "fp32", "stride_bt": "i32",
        "num_rows": "i32", "page_size": "i32", "SPLIT": "i32"}
GEMM = {"a_ptr": "*bf16", "b_ptr": "*bf16", "c_ptr": "*bf16", "bias_ptr": "*bf16",
        **{n: "i32" for n in ("M", "N", "K", "stride_am", "stride_ak", "stride_bk", "stride_bn", "stride_cm",
                              "stride_cn", "num_programs")}}


def resources(fn, types: dict, constexprs: dict, **options) -> dict[str, int]:
    signature = {n: types.get(n, "constexpr") for n in fn.arg_names}
    compiled = triton.compile(ASTSource(fn=fn, signature=signature, constexprs=constexprs), target=HOPPER,
                              options=options)
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        text = subprocess.run([os.path.join(BIN, "cuobjdump"), "--dump-resource-usage", f.name],
                              capture_output=True, text=True, check=True).stdout
    found = dict(re.findall(r"(REG|STACK):(\d+)", text))
    return {"regs": int(found["REG"]), "stack": int(found["STACK"]), "smem": compiled.metadata.shared}


def main() -> None:
    print("| kernel | config | registers | stack (spills) | shared memory |\n|---|---|---|---|---|")
    for d in (64, 128):
        for block_n in (32, 64, 128):
            for warps in (4, 8):
                shape = dict(H=32, HKV=8, D=d, G=4, BLOCK_M=64, BLOCK_N=block_n)
                for name, fn, extra in (("attention split partial", ta._attn_partial, {"DIRECT": False}),
                                        ("attention folded (streaming)", ta._attn_folded, {})):
                    r = resources(fn, ATTN, {**shape, **extra}, num_warps=warps, num_stages=2)
                    print(f"| {name} | D={d} BLOCK_N={block_n} warps={warps} | {r['regs']} | {r['stack']} B | "
                          f"{r['smem']} B |")
    for bm, bn, bk, w, s in ((16, 32, 256, 4, 4), (16, 128, 128, 4, 4), (64, 128, 64, 4, 4), (128, 256, 64, 8, 3)):
        r = resources(tg._persistent_matmul, GEMM, dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=8,
                                                        HAS_BIAS=False), num_warps=w, num_stages=s)
        print(f"| gemm | m{bm} n{bn} k{bk} warps={w} stages={s} | {r['regs']} | {r['stack']} B | {r['smem']} B |")


if __name__ == "__main__":
    main()
