"""The real model (SmolLM2-135M-Instruct, fp32) on the CPU: output tokens/s of detent against stock at batch 1
and batch 8, one thread, and where each mode's time goes (GEMM, attention, the rest).

One process holds both engines; runs interleave the modes (stock, detent, stock, ...), the first round is a
warm-up, the figure is the median. Bits: detent's batch-1 output of each prompt must equal that prompt's row of
the batch-8 run (batch invariance), or the script exits 1. The time split comes from a separate pass with the
KernelSet's `linear` and `attention` timed (so the timed runs carry no instrumentation).
Usage: python benchmarks/real_model_cpu.py [--runs 5] [--output-tokens 32] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from collections import defaultdict

import torch

from detent_audit.engine.llm import LLM, EngineConfig
from detent_audit.engine.named_models import REAL_MODEL
from detent_audit.engine.sampling_params import SamplingParams
from detent_audit.kernels import KernelSet

QUESTIONS = ["What is 2 + 2?", "Name a colour.", "What is the capital of Peru?", "Tell me a joke.",
             "What is a prime number?", "Count to five.", "Say hello in French.", "Why is the sky blue?"]
MODES = ("stock", "detent")


def split_times(llm: LLM, prompts: list[list[int]], params: SamplingParams) -> dict[str, float]:
    """Seconds in the KernelSet's GEMMs and attention, and the rest, for one generate (instrumented pass)."""
    spent: dict[str, float] = defaultdict(float)
    originals = {name: getattr(KernelSet, name) for name in ("linear", "attention")}

    def timed(name):
        def call(self, *args, **kwargs):
            t0 = time.perf_counter()
            try:
                return originals[name](self, *args, **kwargs)
            finally:
                spent[name] += time.perf_counter() - t0
        return call

    try:
        for name in originals:
            setattr(KernelSet, name, timed(name))
        llm.reset()
        t0 = time.perf_counter()
        llm.generate(prompts, params)
        total = time.perf_counter() - t0
    finally:
        for name, fn in originals.items():
            setattr(KernelSet, name, fn)
    return {"gemm": spent["linear"], "attention": spent["attention"],
            "rest": total - spent["linear"] - spent["attention"], "total": total}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--output-tokens", type=int, default=32)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", default=None, help="also write the raw figures here")
    args = ap.parse_args()
    engines = {m: LLM(EngineConfig(model=REAL_MODEL, mode=m, num_threads=args.threads)) for m in MODES}
    tok = engines["stock"].tokenizer
    prompts = [tok.encode_chat([{"role": "user", "content": q}]) for q in QUESTIONS]
    params = SamplingParams(temperature=0.0, max_tokens=args.output_tokens, ignore_eos=True)
    times: dict[tuple[int, str], list[float]] = defaultdict(list)
    outputs: dict[tuple[int, str], list] = {}
    for _ in range(args.runs + 1):  # the first round warms up and is dropped
        for batch in (1, 8):
            for mode in MODES:
                llm = engines[mode]
                llm.reset()
                t0 = time.perf_counter()
                outputs[batch, mode] = llm.generate(prompts[:batch], params)
                times[batch, mode].append(time.perf_counter() - t0)
    alone = [engines["detent"].generate([p], params)[0] for p in prompts]
    batched = outputs[8, "detent"]
    invariant = all(a.token_ids == b.token_ids and
                    torch.equal(torch.tensor(a.logprobs), torch.tensor(b.logprobs)) for a, b in zip(alone, batched))
    tps = {k: k[0] * args.output_tokens / statistics.median(v[1:]) for k, v in times.items()}
    splits = {f"{b}/{m}": split_times(engines[m], prompts[:b], params) for b in (1, 8) for m in MODES}
    print(f"device: {platform.processor() or platform.machine()} ({torch.backends.cpu.get_cpu_capability()}), "
          f"{args.threads} thread(s), torch {torch.__version__}; {REAL_MODEL} fp32; chat prompts of "
          f"{min(map(len, prompts))}-{max(map(len, prompts))} tokens, {args.output_tokens} output tokens "
          f"(prefill included); median of {args.runs}, modes interleaved\n")
    print("| batch | stock tok/s | detent tok/s | detent / stock |\n|---|---|---|---|")
    for b in (1, 8):
        print(f"| {b} | {tps[b, 'stock']:.2f} | {tps[b, 'detent']:.2f} | {tps[b, 'detent'] / tps[b, 'stock']:.2f} |")
    print("\nwhere the time goes (one instrumented generate, seconds):\n")
    print("| batch / mode | GEMM | attention | rest | total |\n|---|---|---|---|---|")
    for k, s in splits.items():
        print(f"| {k} | {s['gemm']:.2f} | {s['attention']:.2f} | {s['rest']:.2f} | {s['total']:.2f} |")
    print(f"\ndetent batch 1 == its row of batch 8, every prompt, tokens and logprob bits: "
          f"{'yes' if invariant else 'NO'}")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"tokens_per_s": {f"{b}/{m}": v for (b, m), v in tps.items()},
                       "runs_s": {f"{b}/{m}": v for (b, m), v in times.items()}, "split_s": splits,
                       "invariant": invariant, "threads": args.threads,
                       "cpu_capability": torch.backends.cpu.get_cpu_capability()}, f, indent=2)
    return 0 if invariant else 1


if __name__ == "__main__":
    sys.exit(main())
