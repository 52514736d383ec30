"""The real model (SmolLM2-135M-Instruct, fp32) on the CPU: output tokens/s of detent against stock at batch 1
and batch 8, one thread, and where each mode's time goes (GEMM, attention, the rest).

Detent runs with three tuples: the engine's default (no tuple), and the tuples `detent-audit tune` commits for
the workload served at concurrency 1 and at concurrency 8 (tuned in this process on these requests, or read
from --tuple-c1/--tuple-c8). One process holds every engine; runs interleave the variants, the first round is
a warm-up, the figure is the median. Bits: each detent variant's batch-1 output of each prompt must equal that
prompt's row of its batch-8 run (batch invariance), or the script exits 1. The time split comes from a
separate pass with the KernelSet's `linear` and `attention` timed (so the timed runs carry no
instrumentation). The GEMM bound: the model's GEMMs of one decode step, per form, timed alone (what a lone row
costs at best). Usage: python benchmarks/real_model_cpu.py [--runs 5] [--output-tokens 32] [--json OUT]
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import statistics
import sys
import time
from collections import defaultdict

import torch

from detent_audit.engine.llm import LLM, EngineConfig
from detent_audit.engine.tune import tune_engine
from detent_audit.kernels import GemmParams, KernelSet, gemm
from detent_audit.manifests.encoding import tuple_hash
from detent_audit.runtime.named_models import REAL_MODEL
from detent_audit.runtime.sampling_params import SamplingParams
from detent_audit.runtime.tuples import load_tuple

QUESTIONS = ["What is 2 + 2?", "Name a colour.", "What is the capital of Peru?", "Tell me a joke.",
             "What is a prime number?", "Count to five.", "Say hello in French.", "Why is the sky blue?"]
VARIANTS = ("stock", "detent", "detent-c1", "detent-c8")


def gemm_form(tup: dict) -> str:
    g = tup.get("embedded.gemm", {})
    return GemmParams(g["chunk_rows"], g.get("embedded.gemm.form", "chunk")).label


def decode_step_gemms(llm: LLM, rows: int, repeats: int = 9) -> dict[str, float]:
    """Seconds of one decode step's GEMMs (every layer's projections and the LM head) at `rows` rows, stock
    against each form, interleaved, median of `repeats`."""
    shapes = [(tuple(m.weight.shape)) for m in llm.model.modules() if type(m).__name__ == "Linear"]
    shapes.append(tuple(llm.model.embed_tokens.weight.shape))
    weights = [torch.randn(*s) for s in shapes]
    forms = {"stock": None, "pad:4": GemmParams(4, "pad"), "row": GemmParams(1, "row"),
             "chunk:16": GemmParams(16)}
    x = {k: torch.randn(rows, k) for k in {s[1] for s in shapes}}
    times: dict[str, list[float]] = defaultdict(list)
    for _ in range(repeats):
        for name, p in forms.items():
            t0 = time.perf_counter()
            for w in weights:
                gemm.linear(x[w.shape[1]], w, params=p)
            times[name].append(time.perf_counter() - t0)
    return {k: statistics.median(v) for k, v in times.items()}


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
    ap.add_argument("--warmup", type=int, default=1, help="rounds run first and dropped")
    ap.add_argument("--check-prompts", type=int, default=8,
                    help="prompts served alone against their batch-8 row")
    ap.add_argument("--tune-prompts-c1", type=int, default=8, help="prompts of the concurrency-1 profile")
    ap.add_argument("--tuple-c1", default=None, help="the tuple for concurrency 1 (default: tune it here)")
    ap.add_argument("--tuple-c8", default=None, help="the tuple for concurrency 8 (default: tune it here)")
    ap.add_argument("--json", default=None, help="also write the raw figures here")
    args = ap.parse_args()
    base = dict(model=REAL_MODEL, num_threads=args.threads,
                num_kv_blocks=128)  # 8 x 70 tokens need 40 blocks; five engines in one process
    engines = {"stock": LLM(EngineConfig(mode="stock", **base)), "detent": LLM(EngineConfig(**base))}
    tok = engines["stock"].tokenizer
    prompts = [tok.encode_chat([{"role": "user", "content": q}]) for q in QUESTIONS]
    params = SamplingParams(temperature=0.0, max_tokens=args.output_tokens, ignore_eos=True)
    tuples = {}
    for c, path in ((1, args.tuple_c1), (8, args.tuple_c8)):
        if path:
            tuples[c] = load_tuple(path)
        else:  # tune on these requests served at concurrency c (a fresh engine: its own prefix cache)
            tuner = LLM(EngineConfig(**base))
            chosen = prompts[:args.tune_prompts_c1] if c == 1 else prompts
            requests = [(f"q{i}", p, params) for i, p in enumerate(chosen)]
            tuples[c], _ = tune_engine(tuner, requests, concurrency=[c])
            del tuner
            gc.collect()
        engines[f"detent-c{c}"] = LLM(EngineConfig(tuple=tuples[c], **base))
    times: dict[tuple[int, str], list[float]] = defaultdict(list)
    outputs: dict[tuple[int, str], list] = {}
    for _ in range(args.warmup + args.runs):  # the warm-up rounds are dropped
        for batch in (1, 8):
            for name in VARIANTS:
                llm = engines[name]
                llm.reset()
                t0 = time.perf_counter()
                outputs[batch, name] = llm.generate(prompts[:batch], params)
                times[batch, name].append(time.perf_counter() - t0)
    invariant = {}
    for name in VARIANTS[1:]:
        alone = [engines[name].generate([p], params)[0] for p in prompts[:args.check_prompts]]
        invariant[name] = all(a.token_ids == b.token_ids and torch.equal(torch.tensor(a.logprobs),
                                                                          torch.tensor(b.logprobs))
                              for a, b in zip(alone, outputs[8, name]))
    tps = {k: k[0] * args.output_tokens / statistics.median(v[args.warmup:]) for k, v in times.items()}
    splits = {f"{b}/{m}": split_times(engines[m], prompts[:b], params) for b in (1, 8) for m in VARIANTS}
    bound = {rows: decode_step_gemms(engines["stock"], rows) for rows in (1, 8)}
    forms = {name: gemm_form(engines[name].selection.tuple) for name in VARIANTS[1:]}
    print(f"device: {platform.processor() or platform.machine()} "
          f"({torch.backends.cpu.get_cpu_capability()}), "
          f"{args.threads} thread(s), torch {torch.__version__}; {REAL_MODEL} fp32; chat prompts of "
          f"{min(map(len, prompts))}-{max(map(len, prompts))} tokens, {args.output_tokens} output tokens "
          f"(prefill included); median of {args.runs} after {args.warmup} warm-up, variants interleaved; "
          "tuples: "
          + ", ".join(f"{n} {forms[n]}" for n in forms) + "\n")
    print("| batch | stock tok/s | " + " | ".join(f"{n} ({forms[n]}) tok/s | / stock" for n in VARIANTS[1:])
          + " |\n|---|---|" + "---|---|" * 3)
    for b in (1, 8):
        cells = " | ".join(f"{tps[b, n]:.2f} | {tps[b, n] / tps[b, 'stock']:.2f}" for n in VARIANTS[1:])
        print(f"| {b} | {tps[b, 'stock']:.2f} | {cells} |")
    print("\nwhere the time goes (one instrumented generate, seconds):\n")
    print("| batch / variant | GEMM | attention | rest | total |\n|---|---|---|---|---|")
    for k, s in splits.items():
        print(f"| {k} | {s['gemm']:.2f} | {s['attention']:.2f} | {s['rest']:.2f} | {s['total']:.2f} |")
    print("\none decode step's GEMMs alone (ms; median of 9, forms interleaved):\n")
    print("| rows | " + " | ".join(bound[1]) + " |\n|---|" + "---|" * len(bound[1]))
    for rows, t in bound.items():
        print(f"| {rows} | " + " | ".join(f"{v * 1e3:.1f}" for v in t.values()) + " |")
    print("\nbatch 1 == its row of batch 8, every prompt, tokens and logprob bits: "
          + ", ".join(f"{n} {'yes' if ok else 'NO'}" for n, ok in invariant.items()))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"tokens_per_s": {f"{b}/{m}": v for (b, m), v in tps.items()},
                       "runs_s": {f"{b}/{m}": v for (b, m), v in times.items()}, "split_s": splits,
                       "decode_step_gemms_s": bound, "invariant": invariant, "threads": args.threads,
                       "tuples": {n: engines[n].selection.tuple for n in VARIANTS[1:]},
                       "tuple_hashes": {n: tuple_hash(engines[n].selection.tuple) for n in VARIANTS[1:]},
                       "gemm_forms": forms, "cpu_capability": torch.backends.cpu.get_cpu_capability()},
                      f, indent=2)
    return 0 if all(invariant.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
