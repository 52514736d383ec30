"""What each Triton kernel config costs in registers, stack (spills) and shared memory on Hopper, read from
its ahead-of-time sm90 build (`cuobjdump --dump-resource-usage`, bundled with Triton): no GPU needed. What
METHOD.md asks to read before spending device time: a kernel at the 255-register ceiling with a stack frame
spills and runs one CTA per SM.

Usage: python benchmarks/triton_resources.py   (Triton installed: `make test-triton` installs it)
"""

from __future__ import annotations

from detent_audit.kernels import triton_attention as ta
from detent_audit.kernels import triton_gemm as tg
from detent_audit.kernels.triton_aot import (
    ATTENTION,
    GEMM,
    GEMM_UNIT_STRIDES,
    compile_sm90,
    instruction_counts,
    resources,
)

# what the instruction mix says: matrix units (HGMMA), asynchronous 16-byte copies (LDGSTS...128), 16-byte
# loads, scalar loads and spills (STL/LDL)
OPS = ("HGMMA", "LDGSTS", "LDG", "STL", "LDL")


def _row(name: str, config: str, compiled) -> str:
    r = resources(compiled)
    ops = instruction_counts(compiled, OPS)
    mix = ", ".join(f"{k} {v}" for k, v in ops.items())
    return f"| {name} | {config} | {r['regs']} | {r['stack']} B | {r['smem']} B | {mix} |"


def main() -> None:
    print("| kernel | config | registers | stack (spills) | shared memory | SASS instructions |\n"
          "|---|---|---|---|---|---|")
    for d in (64, 128):
        for block_m, block_n, warps in ((64, 32, 4), (64, 64, 4), (64, 64, 8), (64, 128, 8), (128, 64, 8),
                                        (128, 128, 8)):
            shape = dict(H=32, HKV=8, D=d, G=4, BLOCK_M=block_m, BLOCK_N=block_n, PAGE=16)
            for name, fn, extra in (("attention split partial", ta._attn_partial, {"DIRECT": False}),
                                    ("attention folded (streaming)", ta._attn_folded, {})):
                compiled = compile_sm90(fn, ATTENTION, {**shape, **extra}, num_warps=warps, num_stages=2)
                print(_row(name, f"D={d} BLOCK_M={block_m} BLOCK_N={block_n} warps={warps}", compiled))
    for bm, bn, bk, w, s in ((16, 32, 256, 4, 4), (16, 128, 128, 4, 4), (64, 128, 64, 4, 4),
                             (128, 256, 64, 8, 3)):
        compiled = compile_sm90(tg._persistent_matmul, GEMM,
                                dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=8,
                                                                  HAS_BIAS=False, **GEMM_UNIT_STRIDES),
                                num_warps=w, num_stages=s)
        print(_row("gemm", f"m{bm} n{bn} k{bk} warps={w} stages={s}", compiled))


if __name__ == "__main__":
    main()
