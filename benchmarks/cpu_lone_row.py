"""Whether a lone decode row may skip the pinned chunk's padding on this CPU, and what the padding costs.

For each GEMM shape of SmolLM2-135M (K x N: q/k/v fused, o_proj, gate/up fused, down, the tied lm_head) and
each dtype: fresh random rows x [chunk, K] and weight [N, K]; is F.linear on one row alone (M = 1, what a
lone decode row would run unpadded) bit-equal to that row of the padded chunk (what detent runs)? Then the
median time of each. Usage: python benchmarks/cpu_lone_row.py [--chunk 16] [--trials 20] [--repeats 30]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import torch
import torch.nn.functional as F

from detent_audit.kernels import gemm
from detent_audit.kernels.params import GemmParams
from detent_audit.runtime.threads import set_threads

SHAPES = {"qkv_proj": (576, 960), "o_proj": (576, 576), "gate_up_proj": (576, 3072), "down_proj": (1536, 576),
          "lm_head": (576, 49152)}


def _time(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--chunk", type=int, default=16)
    ap.add_argument("--trials", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    set_threads(args.threads)
    params = GemmParams(chunk_rows=args.chunk)
    gen = torch.Generator().manual_seed(0)
    rows = []
    for dtype in (torch.float32, torch.bfloat16):
        for name, (k, n) in SHAPES.items():
            weight = (torch.randn(n, k, generator=gen) / k**0.5).to(dtype)
            equal = 0
            for _ in range(args.trials):
                x = torch.randn(args.chunk, k, generator=gen).to(dtype)
                padded = gemm.linear(x[:1], weight, params=params)  # the row alone, padded to the chunk
                lone = F.linear(x[:1], weight)                       # the row alone, unpadded (M = 1)
                equal += torch.equal(padded, lone)
            x1 = torch.randn(1, k, generator=gen).to(dtype)
            t_pad = _time(lambda x1=x1, weight=weight: gemm.linear(x1, weight, params=params), args.repeats)
            t_one = _time(lambda x1=x1, weight=weight: F.linear(x1, weight), args.repeats)
            rows.append({"dtype": str(dtype).removeprefix("torch."), "gemm": name, "K": k, "N": n,
                         "bits_equal": f"{equal}/{args.trials}", "padded_us": t_pad * 1e6,
                         "lone_us": t_one * 1e6})
    if args.json:
        print(json.dumps(rows, indent=2))
        return
    print(f"device: {platform.processor() or platform.machine()} "
          f"({torch.backends.cpu.get_cpu_capability()}), "
          f"{args.threads} thread(s), torch {torch.__version__}; chunk {args.chunk}; {args.trials} fresh "
          "inputs "
          f"per shape; median of {args.repeats}\n")
    print("| dtype | GEMM | K x N | M=1 bits == padded row | padded (us) | M=1 (us) | padded / M=1 |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['dtype']} | {r['gemm']} | {r['K']} x {r['N']} | {r['bits_equal']} | "
              f"{r['padded_us']:.0f} | "
              f"{r['lone_us']:.0f} | {r['padded_us'] / r['lone_us']:.2f} |")


if __name__ == "__main__":
    main()
