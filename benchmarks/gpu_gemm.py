"""GPU GEMM on the device: row-bit invariance and speed of the Triton persistent
matmul against cuBLAS, bf16, Llama-3.1-8B projection shapes.

1. Invariance: for each shape and config, rows of the product at M in {1..8192} against the same rows computed
   alone (M=1) and at every other M: bits equal? cuBLAS (torch.nn.functional.linear) is measured the same way.
2. Tile sensitivity: do configs that differ only in BLOCK_M / BLOCK_N / warps / stages give the same row bits?
   (Which tile dimensions are selection points that must be pinned, and which are harmless.)
3. Speed: median time (triton.testing.do_bench) of each config and of cuBLAS per (shape, M); the ratio
   to cuBLAS; the bf16 roofline floor (max of FLOPs / 790 TFLOP/s and bytes / 4.28 TB/s).

Writes $OUT/gpu_gemm.json and prints Markdown tables. Usage (device): python3 benchmarks/gpu_gemm.py [--small]
[--decode] (`--small`: decode-sized tiles and BLOCK_K 128 against the same reference tile; `--decode`: the
small-M tiles at M <= 64, the LM head too)
"""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.nn.functional as F
import triton.testing
from kernel_module import load_kernel

_tg = load_kernel("triton_gemm")
TritonGemmConfig, linear = _tg.TritonGemmConfig, _tg.linear

SHAPES = {"qkv 4096->6144": (4096, 6144), "o 4096->4096": (4096, 4096), "gate_up 4096->28672": (4096, 28672),
          "down 14336->4096": (14336, 4096)}
MS = (1, 2, 7, 16, 64, 128, 256, 1000, 4096, 8192)
# `--small`: decode-sized tiles, and a different BLOCK_K, against the same reference config
SMALL_CONFIGS = {
    "m64n128k64w4s4": TritonGemmConfig(64, 128, 64, 8, 4, 4),
    "m64n64k64w4s4": TritonGemmConfig(64, 64, 64, 8, 4, 4),
    "m64n32k64w4s4": TritonGemmConfig(64, 32, 64, 8, 4, 4),
    "m16n64k64w4s4": TritonGemmConfig(16, 64, 64, 8, 4, 4),
    "m32n32k128w4s3": TritonGemmConfig(32, 32, 128, 8, 4, 3),
    "m64n64k128w4s3": TritonGemmConfig(64, 64, 128, 8, 4, 3),
    "m128n256k64w8s3": TritonGemmConfig(128, 256, 64, 8, 8, 3),
}
# `--decode`: the small-M tiles (one program per tile), at decode sizes, against the same reference config
DECODE_CONFIGS = {
    "m64n128k64w4s4": TritonGemmConfig(64, 128, 64, 8, 4, 4),
    "m16n32k256w4s4": TritonGemmConfig(16, 32, 256, 8, 4, 4),
    "m16n64k256w4s4": TritonGemmConfig(16, 64, 256, 8, 4, 4),
    "m16n32k128w4s6": TritonGemmConfig(16, 32, 128, 8, 4, 6),
    "m16n64k128w4s5": TritonGemmConfig(16, 64, 128, 8, 4, 5),
    "m16n128k128w4s4": TritonGemmConfig(16, 128, 128, 8, 4, 4),
    "m32n64k256w4s3": TritonGemmConfig(32, 64, 256, 8, 4, 3),
}
if "--decode" in sys.argv:
    MS = (1, 2, 4, 8, 16, 32, 64)
    SHAPES["lm_head 4096->128256"] = (4096, 128256)
CONFIGS = SMALL_CONFIGS if "--small" in sys.argv else DECODE_CONFIGS if "--decode" in sys.argv else {
    "m64n128k64w4s4": TritonGemmConfig(64, 128, 64, 8, 4, 4),
    "m128n128k64w8s3": TritonGemmConfig(128, 128, 64, 8, 8, 3),
    "m128n256k64w8s3": TritonGemmConfig(128, 256, 64, 8, 8, 3),
    "m64n256k64w8s3": TritonGemmConfig(64, 256, 64, 8, 8, 3),
    "m128n128k64w4s4": TritonGemmConfig(128, 128, 64, 8, 4, 4),
}
PEAK_FLOPS, PEAK_BW = 790e12, 4.28e12


def main() -> None:
    torch.manual_seed(0)
    dev = torch.device("cuda")
    out_dir = os.environ.get("OUT", ".")
    results: dict = {"device": torch.cuda.get_device_name(), "invariance": {}, "tiles": {}, "timing": {}}
    for sname, (k, n) in SHAPES.items():
        w = torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02
        x_all = torch.randn(max(MS), k, device=dev, dtype=torch.bfloat16)
        # 1. invariance: rows 0..min(M,7) at every M against M=1..8 alone
        fns = {"cublas": lambda x, w=w: F.linear(x, w)}
        fns.update({c: (lambda x, cfg=cfg, w=w: linear(x, w, config=cfg)) for c, cfg in CONFIGS.items()})
        for name, fn in fns.items():
            alone = torch.cat([fn(x_all[i:i + 1]) for i in range(8)])
            bad = [m for m in MS if not torch.equal(fn(x_all[:m])[: min(m, 8)], alone[: min(m, 8)])]
            results["invariance"][f"{sname}|{name}"] = bad
        # 2. tile sensitivity: row bits of each config against the first, at M = 4096
        ref_name = next(iter(CONFIGS))
        m_ref = min(4096, max(MS))
        ref = linear(x_all[:m_ref], w, config=CONFIGS[ref_name])
        for c, cfg in CONFIGS.items():
            results["tiles"][f"{sname}|{c}"] = torch.equal(linear(x_all[:m_ref], w, config=cfg), ref)
        # reference accuracy (fp32) once per shape
        got = linear(x_all[:256], w, config=CONFIGS[ref_name]).float()
        want = x_all[:256].float() @ w.float().t()
        results.setdefault("rel_err", {})[sname] = ((got - want).norm() / want.norm()).item()
        # 3. timing
        for m in MS:
            x = x_all[:m].contiguous()
            floor = max(2 * m * n * k / PEAK_FLOPS, (m * k + n * k + m * n) * 2 / PEAK_BW) * 1e3
            row = {"floor_ms": floor}
            for name, fn in fns.items():
                row[name] = triton.testing.do_bench(lambda fn=fn, x=x: fn(x), warmup=25, rep=100,
                                                    return_mode="median")
            results["timing"][f"{sname}|{m}"] = row
    tag = "_small" if "--small" in sys.argv else "_decode" if "--decode" in sys.argv else ""
    with open(os.path.join(out_dir, f"gpu_gemm{tag}.json"), "w") as f:
        json.dump(results, f, indent=1)
    print(f"device: {results['device']}\n")
    print("## row-bit invariance (M values whose rows 0..7 differ from the rows alone)\n")
    print("| shape | " + " | ".join(["cublas", *CONFIGS]) + " |\n|---|" + "---|" * (len(CONFIGS) + 1))
    for sname in SHAPES:
        cells = [str(results["invariance"][f"{sname}|{c}"] or "none") for c in ["cublas", *CONFIGS]]
        print(f"| {sname} | " + " | ".join(cells) + " |")
    print(f"\n## same row bits as {next(iter(CONFIGS))} at M={min(4096, max(MS))}?\n")
    for sname in SHAPES:
        print(f"- {sname}: " + ", ".join(f"{c}={results['tiles'][f'{sname}|{c}']}" for c in CONFIGS))
    print(f"\nrel. error vs fp32 ({next(iter(CONFIGS))}, M=256): " + ", ".join(
        f"{s}: {e:.1e}" for s, e in results["rel_err"].items()))
    print("\n## median ms (ratio to cuBLAS)\n")
    print("| shape | M | floor | cublas | " + " | ".join(CONFIGS) + " |\n|---|---|---|---|"
          + "---|" * len(CONFIGS))
    for key, row in results["timing"].items():
        sname, m = key.split("|")
        cells = [f"{row[c]:.3f} ({row[c] / row['cublas']:.2f})" for c in CONFIGS]
        print(f"| {sname} | {m} | {row['floor_ms']:.3f} | {row['cublas']:.3f} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
