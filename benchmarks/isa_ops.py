"""Which operations of the embedded engine's forward give other bits on another CPU under one ISA setting.

Every operation the portable engine runs, on fixed seeded inputs, hashed: torch's elementwise and reduction
ops, the row-local kernels (RMSNorm, SiLU, log_softmax, the RoPE table), the C attention and the fixed-order
GEMM. Run it on two machines (same torch build, the same `--isa`) and diff the JSON lines; the C library and
compiler are printed beside them. Usage: python benchmarks/isa_ops.py [--isa portable|native] (it re-executes
itself under the setting's variables).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import subprocess
import sys


def _digest(t) -> str:
    return hashlib.sha256(t.contiguous().numpy().tobytes()).hexdigest()[:12]


def probe() -> dict[str, object]:
    import torch

    from detent_audit import isa
    from detent_audit.kernels import attention_c, gemm_c, rowlocal, rowlocal_c
    from detent_audit.kernels.attention_metadata import AttentionMetadata
    from detent_audit.kernels.params import AttentionParams

    g = torch.Generator().manual_seed(0)
    x = torch.randn(1 << 18, generator=g) * 4
    rows = torch.randn(64, 2048, generator=g)
    out: dict[str, object] = {}
    ops = {
        "exp": lambda: torch.exp(x), "log": lambda: torch.log(x.abs() + 1e-3), "sin": lambda: torch.sin(x),
        "cos": lambda: torch.cos(x), "sqrt": lambda: torch.sqrt(x.abs()),
        "rsqrt": lambda: torch.rsqrt(x.abs() + 1e-3),
        "div": lambda: 1.0 / (x + 0.5), "pow": lambda: 10000.0 ** (x.abs() / 8), "sum": lambda: rows.sum(-1),
        "softmax": lambda: torch.softmax(rows, -1), "torch.log_softmax": lambda: torch.log_softmax(rows, -1),
        "log64": lambda: torch.log(x.double().abs() + 1e-3), "exp64": lambda: torch.exp(x.double() / 8),
        "rms_norm": lambda: rowlocal.rms_norm(rows, torch.ones(2048), 1e-5),
        "silu_and_mul": lambda: rowlocal.silu_and_mul(rows),
        "log_softmax": lambda: rowlocal.log_softmax(rows),
        "rope_cos": lambda: rowlocal.RopeCache.build(64, 10000.0, 8192).cos,
        "rope_sin": lambda: rowlocal.RopeCache.build(64, 10000.0, 8192).sin,
        "silu_and_mul_c": lambda: rowlocal_c.silu_and_mul(rows),
        "log64_c": lambda: rowlocal_c.log64(x.double().abs() + 1e-3),
        "gemm_c": lambda: gemm_c.linear(rows[:8, :576].contiguous(), torch.randn(1536, 576, generator=g)),
        "mkl_linear": lambda: torch.nn.functional.linear(rows[:16, :576],
                                                         torch.randn(1536, 576, generator=g)),
    }
    for name, fn in ops.items():
        out[name] = _digest(fn())
    # one sequence of 300 tokens, 8 query heads over 4 KV heads, a block table of 20 blocks of 16
    q = torch.randn(300, 8, 64, generator=g)
    k_cache, v_cache = torch.randn(20, 16, 4, 64, generator=g), torch.randn(20, 16, 4, 64, generator=g)
    meta = AttentionMetadata.from_lengths([0], [300], torch.arange(20, dtype=torch.int32)[None, :], 16)
    params = AttentionParams(kv_tile=64, split_stride=0)
    out["attention_c"] = _digest(attention_c.paged_attention(q, k_cache, v_cache, meta, scale=0.125,
                                                             params=params))
    cc = subprocess.run([os.environ.get("DETENT_CC", "cc"), "--version"], capture_output=True,
                        text=True).stdout
    return {"machine": platform.processor() or platform.machine(), "libc": platform.libc_ver(),
            "cc": cc.splitlines()[0] if cc else "", "torch": torch.__version__, "isa": isa.runtime_facts(),
            "ops": out}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--isa", choices=("portable", "native"), default="portable")
    args = ap.parse_args()
    from detent_audit import isa

    env = {k: v for k, v in os.environ.items() if k not in isa.PORTABLE_ENV}
    env.update({k: v for k, v in isa.environment(args.isa, env).items() if v is not None})
    if os.environ.get("ISA_OPS_CHILD") != "1":
        env["ISA_OPS_CHILD"] = "1"
        return subprocess.run([sys.executable, __file__, "--isa", args.isa], env=env).returncode
    print(json.dumps(probe()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
