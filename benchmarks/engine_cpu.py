"""Output tokens per second of the embedded engine on CPU: detent and det over stock.

One process, the random-20m model (~20M parameters, Llama-shaped), fp32; a closed batch of requests
(mixed prompt lengths, greedy, fixed output length) run to completion; modes interleaved, median of N runs.
Usage: python benchmarks/engine_cpu.py [--runs 5] [--requests 16] [--threads 1]
"""

from __future__ import annotations

import argparse
import platform
import random
import statistics
import sys
import time

import torch

from detent_audit.engine.llm import LLM, EngineConfig
from detent_audit.runtime.sampling_params import SamplingParams


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--output-tokens", type=int, default=32)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--dtype", default="float32")
    args = ap.parse_args()
    rng = random.Random(0)
    prompts = [[rng.randrange(256) for _ in range(rng.randint(16, 160))] for _ in range(args.requests)]
    params = SamplingParams(temperature=0.0, max_tokens=args.output_tokens, ignore_eos=True)
    engines = {mode: LLM(EngineConfig(model="random-20m", mode=mode, dtype=args.dtype,
                                      num_threads=args.threads))
               for mode in ("stock", "det", "detent")}
    params_m = sum(p.numel() for p in engines["stock"].model.parameters()) / 1e6
    times: dict[str, list[float]] = {m: [] for m in engines}
    for _ in range(args.runs + 1):  # the first round warms up and is dropped
        for mode, llm in engines.items():
            llm.reset()
            t0 = time.perf_counter()
            outs = llm.generate(prompts, params)
            times[mode].append(time.perf_counter() - t0)
            assert sum(len(o.token_ids) for o in outs) == args.requests * args.output_tokens
    tokens = args.requests * args.output_tokens
    tps = {m: tokens / statistics.median(t[1:]) for m, t in times.items()}
    print(f"device: {platform.processor() or platform.machine()} "
          f"({torch.backends.cpu.get_cpu_capability()}), "
          f"{args.threads} thread(s), torch {torch.__version__}; model default-20m ({params_m:.1f}M params), "
          f"{args.dtype}; {args.requests} requests x {args.output_tokens} output tokens, prompts 16-160 "
          "tokens; "
          f"median of {args.runs}\n")
    print("| mode | output tok/s | ratio over stock |\n|---|---|---|")
    for m in ("stock", "det", "detent"):
        print(f"| {m} | {tps[m]:.1f} | {tps[m] / tps['stock']:.3f} |")
    ok = tps["detent"] / tps["stock"] >= 0.75
    print(f"\ndetent/stock >= 0.75: {'yes' if ok else 'NO'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
