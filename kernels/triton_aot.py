"""Build a Triton kernel for Hopper (sm90) ahead of time, on a machine without a GPU, specialised as a launch
on the device would be: every pointer and every integer argument the engine passes aligned (16-byte pointers,
integers divisible by 16) is marked so, as Triton's JIT marks them at launch. Without those marks the build
cannot vectorise loads or use asynchronous copies, and reads as a different (slower, spilling) kernel.

Used by the opt-in compile tier (tests/kernels/test_triton_compile.py) and by benchmarks/triton_resources.py.
Needs Triton; imports nothing else from the project.
"""

from __future__ import annotations

import os
import re
import subprocess
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

HOPPER = GPUTarget("cuda", 90, 32)
I32 = "i32"

# argument types by name; scalars not listed in UNALIGNED are divisible by 16 at every launch the engine makes
ATTENTION = {"q_ptr": "*bf16", "k_ptr": "*bf16", "v_ptr": "*bf16", "bt_ptr": "*i32", "tile_seq_ptr": "*i32",
             "tile_row_ptr": "*i32", "tile_len_ptr": "*i32", "cu_ptr": "*i32", "ctx_ptr": "*i32",
             "o_ptr": "*fp32", "m_ptr": "*fp32", "l_ptr": "*fp32", "n_ptr": "*i32", "count_ptr": "*i32",
             "out_ptr": "*bf16", "qk_scale": "fp32", "stride_bt": I32, "num_rows": I32, "SPLIT": I32,
             "num_splits": I32}
GEMM = {"a_ptr": "*bf16", "b_ptr": "*bf16", "c_ptr": "*bf16", "bias_ptr": "*bf16",
        **{n: I32 for n in ("M", "N", "K", "stride_am", "stride_ak", "stride_bk", "stride_bn", "stride_cm",
                            "stride_cn", "num_programs")}}
# the strides that are 1 at every engine launch (x and the weight contiguous along K, the output along N)
GEMM_UNIT_STRIDES = {"stride_ak": 1, "stride_bk": 1, "stride_cn": 1}
ROWLOCAL = {"x_ptr": "*bf16", "r_ptr": "*bf16", "w_ptr": "*bf16", "out_ptr": "*bf16", "sum_ptr": "*bf16",
            "n": I32, "eps": "fp32", "inter": I32, "qkv_ptr": "*bf16", "pos_ptr": "*i64", "cos_ptr": "*fp32",
            "sin_ptr": "*fp32", "qw_ptr": "*bf16", "kw_ptr": "*bf16", "slot_ptr": "*i64", "q_ptr": "*bf16",
            "kc_ptr": "*bf16", "vc_ptr": "*bf16"}
MOE = {"logits_ptr": "*bf16", "weights_ptr": "*fp32", "ids_ptr": "*i32", "E": I32, "stride_lm": I32,
       "sorted_ptr": "*i32", "block_expert_ptr": "*i32", "num_valid_ptr": "*i32", "scratch_ptr": "*i32",
       "num_entries": I32, "num_experts": I32, "num_blocks": I32}
# integers that take any value at a launch (row and entry counts, sizes) or that a kernel declines to
# specialise (do_not_specialize): never marked aligned
UNALIGNED = frozenset({"num_rows", "num_splits", "M", "n", "num_entries", "num_blocks", "num_programs", "E",
                       "stride_lm", "num_experts", "stride_bt", "SPLIT"})


def compile_sm90(fn, types: dict[str, str], constexprs: dict[str, object], **options):
    """Compile `fn` for sm90: arguments typed by name from `types`, the rest constexprs (all must be given);
    pointers and aligned integers marked divisible by 16. An integer argument given in `constexprs` is
    specialised to that value, as the JIT specialises an argument equal to 1 (GEMM_UNIT_STRIDES).
    Returns Triton's compiled kernel."""
    signature = {name: "constexpr" if name in constexprs else types.get(name,
                                                                        "constexpr") for name in fn.arg_names}
    missing = [n for n, t in signature.items() if t == "constexpr" and n not in constexprs]
    if missing:
        raise ValueError(f"no type or constexpr for {missing}")
    attrs = {(i,): [["tt.divisibility", 16]] for i, (name, t) in enumerate(signature.items())
             if t.startswith("*") or (t in ("i32", "i64") and name not in UNALIGNED)}
    return triton.compile(ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs),
                          target=HOPPER, options=options)


def _cuobjdump(compiled, flag: str) -> str:
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        return subprocess.run([tool, flag, f.name], capture_output=True, text=True, check=True).stdout


def resources(compiled) -> dict[str, int]:
    """Registers, stack bytes (spills) and shared memory of a build, read with the cuobjdump Triton
    bundles."""
    found = dict(re.findall(r"(REG|STACK):(\d+)", _cuobjdump(compiled, "--dump-resource-usage")))
    return {"regs": int(found["REG"]), "stack": int(found["STACK"]), "smem": compiled.metadata.shared}


def instruction_counts(compiled, prefixes: tuple[str, ...]) -> dict[str, int]:
    """How many SASS instructions of each opcode starting with one of `prefixes` the build holds (static
    counts: which memory and matrix instructions the compiler chose, e.g. LDGSTS, HGMMA, STL)."""
    counts: dict[str, int] = {}
    for op in re.findall(r"/\*[0-9a-f]{4}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)",
                         _cuobjdump(compiled, "--dump-sass")):
        if op.startswith(prefixes):
            counts[op] = counts.get(op, 0) + 1
    return dict(sorted(counts.items()))
