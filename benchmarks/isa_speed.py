"""Output tokens per second of an engine in detent mode under the portable ISA cap and natively.

Each setting runs in its own process (the caps are read when torch's libraries initialise:
`detent_audit.isa`; vLLM's and SGLang's processes inherit them), fp32, a closed batch of requests (mixed
prompt lengths, greedy, fixed output length) run to completion; the first round warms up and is dropped, the
median of the others is reported. The embedded engine on random-20m by default; `--engine vllm|sglang` builds
that engine from the registry (on `--model`, default SmolLM2-135M-Instruct).
Usage: python benchmarks/isa_speed.py [--engine embedded] [--model M] [--runs 3] [--requests 8] [--threads 1]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import time

from detent_audit import isa


def child(args: argparse.Namespace) -> None:
    import torch

    from detent_audit.runtime import registry
    from detent_audit.runtime.sampling_params import SamplingParams

    rng = random.Random(0)
    prompts = [[rng.randrange(256) for _ in range(rng.randint(16, 160))] for _ in range(args.requests)]
    params = SamplingParams(temperature=0.0, max_tokens=args.output_tokens, ignore_eos=True)
    model = args.model or ("random-20m" if args.engine == "embedded" else "smollm2-135m-instruct")
    llm = registry.build(args.engine, registry.EngineOptions(model=model, threads=args.threads))
    times = []
    for _ in range(args.runs + 1):
        llm.reset()
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params)
        times.append(time.perf_counter() - t0)
    tokens = sum(len(o.token_ids) for o in outs)
    facts = llm.facts()
    gemm = facts.get("tuple", {}).get("embedded.gemm", {})
    llm.shutdown()
    print(json.dumps({"engine": args.engine, "model": model,
                      "cpu_capability": facts["runtime"].get("cpu_capability"),
                      "isa": isa.runtime_facts(), "torch": torch.__version__,
                      "gemm_form": gemm.get("embedded.gemm.form"), "gemm_rows": gemm.get("chunk_rows"),
                      "fixed_order": facts["runtime"].get("fixed_order"),
                      "tok_s": tokens / statistics.median(times[1:]), "runs_s": times[1:]}))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--engine", default="embedded", help="embedded | vllm | sglang")
    ap.add_argument("--model", default=None)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--output-tokens", type=int, default=32)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--child", action="store_true")
    args = ap.parse_args()
    if args.child:
        child(args)
        return 0
    rows = {}
    for choice in isa.CHOICES:
        env = {k: v for k, v in os.environ.items() if k not in isa.PORTABLE_ENV}
        env.update({k: v for k, v in isa.environment(choice, env).items() if v is not None})
        out = subprocess.run([sys.executable, __file__, "--child", *sys.argv[1:]], env=env, check=True,
                             capture_output=True, text=True).stdout
        rows[choice] = json.loads(out.splitlines()[-1])
    model = rows["native"]["model"]
    print(f"device: {platform.processor() or platform.machine()}, {args.threads} thread(s); {args.engine}, "
          f"{model} fp32 detent; {args.requests} requests x {args.output_tokens} output tokens; median of "
          f"{args.runs}\n")
    print("| --isa | runtime fact | GEMM form (rows) | fixed-order kernels | output tok/s | over native |\n"
          "|---|---|---|---|---|---|")
    for choice, row in rows.items():
        print(f"| {choice} | {row['isa']} | {row['gemm_form']} ({row['gemm_rows']}) | "
              f"{'yes' if row['fixed_order'] else 'no'} | {row['tok_s']:.1f} "
              f"| {row['tok_s'] / rows['native']['tok_s']:.3f} |")
    print(json.dumps(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
