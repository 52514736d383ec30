"""Rescore against serving on the GPU, per serving concurrency (verify speed in the GPU's regime).

The same N requests (prompts 16-128 tokens, 64 output tokens, seeded sampling, as benchmarks/verify.py) are
served closed loop at each concurrency asked for, on one engine (detent mode, CUDA graphs), then rescored
together in teacher-forced prefills (what `verify --mode rescore` re-executes). Every serving run must give
the same token and logprob bits, and the rescore the served logprob bits and tokens; the script fails if
not. Serving time over rescore time, per output token (the same tokens on both sides).

Usage: python3 benchmarks/gpu_verify.py [--shape llama-3.1-8b] [--requests 256] [--output-tokens 64]
                                        [--concurrency 1,8,32] [--attention-streaming] [--tuple FILE]
Writes $OUT/gpu_verify_<shape>.json.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
from serving_harness import run_workload, sampling_params, token_space_for

from detent_audit.bench.workloads import closed_loop
from detent_audit.engine.llm import LLM, EngineConfig
from detent_audit.runtime.tuples import load_tuple


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="llama-3.1-8b")
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--output-tokens", type=int, default=64)
    ap.add_argument("--concurrency", default="1,8,32", help="comma list of closed-loop concurrencies")
    ap.add_argument("--attention-streaming", action="store_true")
    ap.add_argument("--tuple", default=None, help="the committed tuple (default: the preferred)")
    ap.add_argument("--max-num-seqs", type=int, default=32)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--device", default="cuda", help="cpu: a smoke run of the script itself (fp32, eager)")
    args = ap.parse_args()
    concurrencies = [int(c) for c in args.concurrency.split(",")]
    config = EngineConfig(model=f"random:{args.shape}", device=args.device, mode="detent",
                          dtype="bfloat16" if args.device == "cuda" else "float32",
                          max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                          num_kv_blocks=16384, max_model_len=4096, cuda_graphs=args.device == "cuda",
                          tuple=load_tuple(args.tuple) if args.tuple else None,
                          attention_streaming=args.attention_streaming)
    workload = closed_loop(args.requests, 1, prompt_tokens=(16, 128),
                           output_tokens=(args.output_tokens, args.output_tokens), seed=0,
                           vocab=token_space_for(config), temperature=0.8)
    llm = LLM(config)
    run_workload(llm, closed_loop(8, 8, prompt_tokens=(16, 128), output_tokens=(8, 8), seed=1,
                                  vocab=token_space_for(config)))  # warm-up: Triton builds, graph captures
    tokens = args.requests * args.output_tokens
    sync = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)
    out: dict = {"device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
                 "shape": args.shape,
                 "requests": args.requests, "output_tokens": args.output_tokens, "tuple": llm.selection.tuple,
                 "serving": []}
    first = None
    for c in concurrencies:
        result = run_workload(llm, workload.as_closed_loop(c))
        bits = [(r.token_ids, r.logprobs) for r in result.records]
        first = first or bits
        out["serving"].append({"concurrency": c, "seconds": result.duration_s,
                               "equal_to_first": bits == first, "max_in_flight": result.max_in_flight})
        print(f"served at concurrency {c}: {result.duration_s:.2f} s, bits equal to the first run's: "
              f"{bits == first}", flush=True)
    llm.reset()
    pairs = [(list(r.prompt_token_ids), list(t)) for r, (t, _) in zip(workload.requests, first)]
    params = [sampling_params(r) for r in workload.requests]
    times = []
    for _ in range(3):  # median of 3; the first also checks the bits
        llm.reset()
        sync()
        t0 = time.perf_counter()
        scores = llm.rescore_batch(pairs, params)
        sync()
        times.append(time.perf_counter() - t0)
        if len(times) == 1:
            out["rescore_bits_equal"] = all(list(s.logprobs) == list(lp) and list(s.tokens) == list(t)
                                            for s, (t, lp) in zip(scores, first))
    rescore_s = sorted(times)[1]
    out["rescore_seconds"] = times
    with open(os.path.join(os.environ.get("OUT", "."), f"gpu_verify_{args.shape}.json"), "w") as f:
        json.dump(out, f, indent=1)
    print(f"\ndevice: {out['device']}; {args.shape}, {config.dtype}, detent, "
          f"{'CUDA graphs' if config.cuda_graphs else 'eager'}"
          f"{', streaming attention' if args.attention_streaming else ''}; {args.requests} requests, "
          f"prompts 16-128, "
          f"{args.output_tokens} output tokens; rescore median of 3: {rescore_s:.3f} s "
          f"({rescore_s / tokens * 1e3:.3f} ms per output token); bits equal: {out['rescore_bits_equal']}\n")
    print("| serving concurrency | serve | per output token | rescore speed-up | bits equal to c="
          f"{concurrencies[0]} |\n|---|---|---|---|---|")
    for s in out["serving"]:
        print(f"| {s['concurrency']} | {s['seconds']:.2f} s | {s['seconds'] / tokens * 1e3:.3f} ms | "
              f"**{s['seconds'] / rescore_s:.1f}x** | {s['equal_to_first']} |")
    ok = out["rescore_bits_equal"] and all(s["equal_to_first"] for s in out["serving"])
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
