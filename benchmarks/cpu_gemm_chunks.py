"""The CPU GEMM's chunk size: does it change a row's bits, and what does it cost? (verify speed's bound)

`kernels/gemm.py` hands the BLAS rows in chunks of exactly `chunk_rows` (a pinned tuple value). For each shape
(the default model's projections, then a spread of others), fp32, at 1 and 2 threads: are the products of
every power-of-two chunk from 4 to 256 bitwise equal to chunk 16's on fresh random inputs, and how many
GFLOP/s does each chunk reach on 4096 rows (median of repeats)? If the bits never differ, the chunk is a
harmless selection point on this CPU and BLAS, as the GPU GEMM's tile is on the H200 (RESULTS.md, "GPU
kernels"). Usage: python benchmarks/cpu_gemm_chunks.py [--repeats 5]
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time

import torch

from detent_audit.kernels.gemm import _chunked_matmul
from detent_audit.runtime.threads import set_threads

CHUNKS = (4, 8, 16, 32, 64, 128, 256)
# (K, N): default-20m's qkv, o, gate_up, down and LM head, then other shapes
MODEL_SHAPES = ((512, 1024), (512, 512), (512, 3072), (1536, 512), (512, 512))
OTHER_SHAPES = ((64, 64), (100, 300), (896, 4864), (4864, 896), (1000, 1000), (4096, 4096))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    gen = torch.Generator().manual_seed(0)
    print(f"CPU: {platform.machine()} ({torch.backends.cpu.get_cpu_capability()}), torch "
          f"{torch.__version__}, "
          f"fp32\n")
    for threads in (1, 2):
        set_threads(threads)
        differ = []
        for k, n in MODEL_SHAPES + OTHER_SHAPES:
            w, x = torch.randn(n, k, generator=gen), torch.randn(512, k, generator=gen)
            ref = _chunked_matmul(x, w, 16)
            differ += [(k, n, c) for c in CHUNKS if not torch.equal(_chunked_matmul(x, w, c), ref)]
        print(f"{threads} thread(s): (K, N, chunk) whose rows differ from chunk 16's: {differ or 'none'}")
    set_threads(1)
    print("\nGFLOP/s on 4096 rows, 1 thread, median of", args.repeats)
    print("| K x N | " + " | ".join(f"chunk {c}" for c in CHUNKS) + " |\n|---|" + "---|" * len(CHUNKS))
    for k, n in dict.fromkeys(MODEL_SHAPES):
        w, x = torch.randn(n, k, generator=gen), torch.randn(4096, k, generator=gen)
        rates = []
        for c in CHUNKS:
            _chunked_matmul(x, w, c)
            times = []
            for _ in range(args.repeats):
                t0 = time.perf_counter()
                _chunked_matmul(x, w, c)
                times.append(time.perf_counter() - t0)
            rates.append(2 * 4096 * k * n / statistics.median(times) / 1e9)
        print(f"| {k} x {n} | " + " | ".join(f"{r:.0f}" for r in rates) + " |")


if __name__ == "__main__":
    main()
