"""Serving latency per output token: stock, det, detent-default and detent-tuned on three kinds of
workload, each mode's figures as ratios over stock's from the same run.

Workloads (request counts at --scale 1, the default 0.5 halves them; --workloads picks a subset):
- sharegpt: the ShareGPT-like multi-turn replay, 600 requests, ~64% of prompt tokens repeating the previous
  turn (`--scale` shrinks its count and its lengths); Poisson arrivals at --sharegpt-load x stock's peak.
- docs-25, docs-50, docs-100: 32 long documents (7/8 to 1 x --doc-tokens, default 8192; 128 output tokens),
  the same documents at each load, Poisson at 0.25, 0.5 and 1.0 x stock's peak on them.
- closed-c1, closed-c8: prompts of 128-1024 tokens, 128 output tokens; 16 requests at concurrency 1 and 64
  at 8 (the first 16 are the same requests).
With --tune (and no --tuned-tuple), detent-tuned commits one tuple per kind of workload (sharegpt, docs,
closed), tuned first on a profiling sample of that kind drawn with another seed (`tune_first`), and serves
each kind's workloads from an engine with that kind's tuple.
Stock's peak (`measure_peak`): requests/s with every request queued at time 0 (the engine as full as
max_num_seqs, its token budget and its KV blocks allow); on stock, measured first in the same run (on the
first mode when stock is not run). Each run starts from a reset engine (cold prefix cache); one run each.
`detent-default` is mode detent with its preferred tuple, `detent-tuned` mode detent with --tuned-tuple.

Latency per output token = (finish - arrival) / output tokens, per request (`serving_harness.py`).
The table gives p50/p90/p99 in ms, output tokens/s, and ratios over stock; then per mode the geometric mean
over workloads of the p50 ratio (the acceptance: detent-tuned <= 1.10). Outputs are also compared bit for
bit across concurrency (closed-c1 against closed-c8) and load (docs-*): a batch-invariant mode gives equal
digests. --time-budget is a safety net for the measured runs together (build, warm-up and peaks not
counted): once it is spent, the run in progress admits no more requests and later runs are skipped (both
reported). Modes run in the order stock, detent-tuned, detent-default, det, so the acceptance's pair comes
first.

Usage (device): python3 benchmarks/gpu_serving.py [--shape llama-3.2-1b] [--tuned-tuple FILE] [--scale 0.5]
CPU try:        python benchmarks/gpu_serving.py --device cpu --dtype float32 --shape tiny-llama \
                    --scale 0.05 --doc-tokens 256 --output-tokens 8
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import platform
import sys
import time
from dataclasses import dataclass

import torch
from serving_harness import (
    LOAD_FRACTIONS,
    Peak,
    RunResult,
    engine_requests,
    measure_peak,
    run_workload,
    same_outputs,
    token_space_for,
    token_space_of,
)

from detent_audit.bench.workloads import (
    PROFILING_CONCURRENCY,
    TokenSpace,
    Workload,
    closed_loop,
    long_documents,
    profiling_samples,
    sharegpt_like,
)
from detent_audit.engine.llm import LLM, EngineConfig
from detent_audit.runtime.tuples import load_tuple

MODES = {"stock": "stock", "det": "det", "detent-default": "detent", "detent-tuned": "detent"}
ORDER = ("stock", "detent-tuned", "detent-default", "det")
WORKLOADS = ("sharegpt", "docs-25", "docs-50", "docs-100", "closed-c1", "closed-c8")
# engine sizes per device: decode batches up to max_num_seqs replay CUDA graphs (cuda_graphs.capture_sizes)
SIZES = {"cuda": dict(max_num_seqs=32, max_num_batched_tokens=2048, num_kv_blocks=16384),
         "cpu": dict(max_num_seqs=8, max_num_batched_tokens=256, num_kv_blocks=2048)}


@dataclass(frozen=True)
class Plan:
    """The base request sets; the timed workloads are made from them once the peaks are known."""

    sharegpt: Workload
    docs: Workload
    closed: Workload
    num_c1: int

    def workloads(self, peaks: dict[str, Peak], sharegpt_load: float, wanted: list[str]) -> list[Workload]:
        out = []
        for name in wanted:
            if name == "sharegpt":
                rate = sharegpt_load * peaks["sharegpt"].requests_per_s
                out.append(self.sharegpt.with_poisson_arrivals(rate, seed=1))
            elif name.startswith("docs-"):
                fraction = int(name.removeprefix("docs-")) / 100
                out.append(self.docs.with_poisson_arrivals(fraction * peaks["docs"].requests_per_s, seed=2,
                                                           name=name))
            elif name == "closed-c1":
                out.append(self.closed.head(self.num_c1).as_closed_loop(1, name=name))
            else:
                out.append(self.closed.as_closed_loop(8, name=name))
        return out


def make_plan(args: argparse.Namespace, space: TokenSpace) -> Plan:
    def count(n: int) -> int:
        return max(1, round(n * args.scale))

    return Plan(
        sharegpt=sharegpt_like(600, seed=0, vocab=space, scale=args.scale),
        docs=long_documents(count(32), prompt_tokens=args.doc_tokens, output_tokens=args.output_tokens,
                            seed=0, vocab=space),
        closed=closed_loop(count(64), 8,
                           prompt_tokens=(min(128, args.doc_tokens), min(1024, args.doc_tokens)),
                           output_tokens=(args.output_tokens, args.output_tokens), seed=0, vocab=space),
        num_c1=count(16))


def engine_config(args: argparse.Namespace, mode: str, max_model_len: int,
                  kind: str | None = None) -> EngineConfig:
    sizes = {**SIZES[args.device], **{k: v for k, v in (("max_num_seqs", args.max_num_seqs),
                                                         ("max_num_batched_tokens",
                                                          args.max_num_batched_tokens),
                                                         ("num_kv_blocks", args.num_kv_blocks)) if v}}
    tuned = getattr(args, "tuned_tuples", {}).get(kind) or args.tuned_tuple
    committed = load_tuple(tuned) if mode == "detent-tuned" else None
    return EngineConfig(model=args.model or f"random:{args.shape}", device=args.device, dtype=args.dtype,
                        mode=MODES[mode], tuple=committed, cuda_graphs=not args.eager,
                        attention_streaming=args.attention_streaming and MODES[mode] != "stock",
                        max_model_len=max_model_len, cache_dir=args.cache_dir, **sizes)


class CompileWatch:
    """Counts Triton JIT compiles (and their seconds) while open: a compile inside a timed run stalls every
    request in flight, so a run with compiles in it measures the compiler, not the kernels."""

    def __init__(self) -> None:
        self.count, self.seconds, self._t0 = 0, 0.0, 0.0

    def _before(self, **_: object) -> bool:
        self._t0 = time.perf_counter()
        return False  # go on compiling

    def _after(self, **_: object) -> None:
        self.count += 1
        self.seconds += time.perf_counter() - self._t0

    def __enter__(self) -> CompileWatch:
        try:
            from triton import knobs
        except ImportError:  # CPU runs: nothing compiles
            return self
        self._saved = (knobs.runtime.jit_cache_hook, knobs.runtime.jit_post_compile_hook)
        knobs.runtime.jit_cache_hook, knobs.runtime.jit_post_compile_hook = self._before, self._after
        return self

    def __exit__(self, *exc: object) -> None:
        if hasattr(self, "_saved"):
            from triton import knobs

            knobs.runtime.jit_cache_hook, knobs.runtime.jit_post_compile_hook = self._saved


def warm_up(llm: LLM, plan: Plan, wanted: list[str]) -> None:
    """Compile and capture before timing: prefill chunks of every kind and decode batches up to the limit."""
    n = llm.config.max_num_seqs
    if "sharegpt" in wanted:
        run_workload(llm, plan.sharegpt.head(n).at_time_zero())
    if any(w.startswith("docs-") for w in wanted):
        run_workload(llm, plan.docs.head(4).at_time_zero())
    run_workload(llm, plan.closed.head(n).at_time_zero())


def geomean(values: list[float]) -> float:
    return math.exp(sum(math.log(v) for v in values) / len(values)) if values else math.nan


def report(results: dict[str, dict[str, RunResult]], base: str | None) -> tuple[str, dict]:
    lines = ["| workload | mode | requests | p50 ms | p90 ms | p99 ms | tok/s | p50 / stock | p90 / stock | "
             "p99 / stock | tok/s / stock |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    ratios: dict[str, dict[str, dict[str, float]]] = {}
    workload_names = list(dict.fromkeys(w for per in results.values() for w in per))
    for wname in workload_names:
        ref = results.get(base, {}).get(wname) if base else None
        for mode, per in results.items():
            r = per.get(wname)
            if r is None:
                continue
            lat = r.latency_per_output_token
            n = f"{len(r.records)}" + (f" ({r.num_dropped} dropped)" if r.num_dropped else "")
            row = [wname, mode, n, f"{lat.p50 * 1e3:.2f}", f"{lat.p90 * 1e3:.2f}", f"{lat.p99 * 1e3:.2f}",
                   f"{r.throughput:.0f}"]
            if ref is not None:
                q = {"p50": lat.p50 / ref.latency_per_output_token.p50,
                     "p90": lat.p90 / ref.latency_per_output_token.p90,
                     "p99": lat.p99 / ref.latency_per_output_token.p99,
                     "throughput": r.throughput / ref.throughput}
                ratios.setdefault(mode, {})[wname] = q
                row += [f"{q['p50']:.3f}", f"{q['p90']:.3f}", f"{q['p99']:.3f}", f"{q['throughput']:.3f}"]
            else:
                row += ["-"] * 4
            lines.append("| " + " | ".join(row) + " |")
    gm = {mode: geomean([q["p50"] for q in per.values()]) for mode, per in ratios.items()}
    lines += ["", "Geometric mean over workloads of p50 latency per output token over stock's:", ""]
    lines += [f"- {mode}: {value:.3f} ({len(ratios[mode])} workloads)" for mode, value in gm.items()]
    return "\n".join(lines), {"ratios": ratios, "geomean_p50_ratio": gm}


def invariance(results: dict[str, dict[str, RunResult]]) -> dict[str, dict[str, bool]]:
    """Per mode: are the outputs bit-identical across concurrency and across loads?"""
    out: dict[str, dict[str, bool]] = {}
    for mode, per in results.items():
        checks = {}
        if "closed-c1" in per and "closed-c8" in per:
            checks["closed-c1 == closed-c8"] = same_outputs(per["closed-c1"], per["closed-c8"])
        docs = [w for w in per if w.startswith("docs-")]
        if len(docs) > 1:
            checks[" == ".join(docs)] = all(same_outputs(per[docs[0]], per[d]) for d in docs[1:])
        out[mode] = checks
    return out


KINDS = ("sharegpt", "docs", "closed")  # a tuple is committed per kind of workload


def kind_of(workload_name: str) -> str:
    return workload_name.split("-")[0]


def tune_first(args: argparse.Namespace, max_len: int, shape: str) -> dict:
    """Tune detent's tuple per kind of workload served (--workloads) on a profiling sample of that kind
    (another seed than the timed workloads): budgeted and, with --tune-exhaustive, exhaustively (validation).
    Writes each kind's budgeted tuple and returns {kind: report}; args.tuned_tuples maps kind -> tuple file.
    """
    from detent_audit.engine.tune import tune_engine
    from detent_audit.runtime.tuples import save_tuple

    t0 = time.perf_counter()
    llm = LLM(engine_config(args, "detent-default", max_len))
    space = token_space_of(llm)
    samples = profiling_samples(space, scale=args.scale, doc_tokens=args.doc_tokens,
                                output_tokens=args.output_tokens)
    info: dict = {}
    args.tuned_tuples = {}
    served = {kind_of(w.strip()) for w in args.workloads.split(",") if w.strip()}
    for kind, sample in ((k, v) for k, v in samples.items() if k in served):
        requests = engine_requests(f"profile-{kind}", sample)
        info[kind] = {"profiling_requests": len(requests)}
        for mode in ("budgeted", "exhaustive") if kind in args.tune_exhaustive.split(",") else ("budgeted",):
            llm.reset()
            t1 = time.perf_counter()
            committed, reports = tune_engine(llm, requests, mode=mode, cold_kv=args.tune_cold_kv,
                                             concurrency=PROFILING_CONCURRENCY[kind] if args.tune_as_served
                                             else (None,))
            info[kind][mode] = {"tuple": committed, "seconds": time.perf_counter() - t1,
                                "families": [r.to_json() for r in reports]}
            for r in reports:
                print(f"tune {kind} {mode} {r.family}: measured {r.measured} of {r.grid_size} "
                      f"({r.measured / r.grid_size:.0%}; {r.distinct_launches} distinct launches), predicted "
                      f"{r.default_cost * 1e3:.2f} -> "
                      f"{r.tuned_cost * 1e3:.2f} ms, chosen {r.chosen}", flush=True)
        if "exhaustive" in info[kind]:
            for b, e in zip(info[kind]["budgeted"]["families"], info[kind]["exhaustive"]["families"]):
                b["over_exhaustive"] = b["tuned_cost"] / e["tuned_cost"] if e["tuned_cost"] else 1.0
                print(f"tune {kind} {b['family']}: budgeted / exhaustive optimum = "
                      f"{b['over_exhaustive']:.4f}", flush=True)
        path = os.path.join(os.environ.get("OUT", "."), f"tuned_{shape}_{kind}.msgpack")
        save_tuple(info[kind]["budgeted"]["tuple"], path)
        args.tuned_tuples[kind] = info[kind]["tuple_file"] = path
    info["wall_s"] = time.perf_counter() - t0
    del llm
    gc.collect()
    if args.device == "cuda":
        torch.cuda.empty_cache()
    return info


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="llama-3.2-1b", help="named shape; the model is random:<shape>")
    ap.add_argument("--model", default=None, help="a checkpoint folder or random:<shape> (overrides --shape)")
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--dtype", default=None, help="default: bfloat16 on cuda, float32 on cpu")
    ap.add_argument("--modes", default="stock,det,detent-default,detent-tuned")
    ap.add_argument("--tuned-tuple", default=None, help="detent-tuned's tuple file (JSON/msgpack)")
    ap.add_argument("--tune", action="store_true",
                    help="without --tuned-tuple: tune first (`detent-audit tune`'s search on a profiling mix "
                         "of the "
                         "three workload kinds drawn with another seed), then serve detent-tuned with that "
                         "tuple")
    ap.add_argument("--tune-exhaustive", default="",
                    help="kinds (sharegpt,docs,closed) whose tuning also runs the "
                                                            "exhaustive search, for validation")
    ap.add_argument("--tune-cold-kv", action="store_true",
                    help="--tune with the oracle's cold_kv (each timed "
                                                                "launch reads its own K/V copy)")
    ap.add_argument("--tune-as-served", action="store_true", help="--tune on a profile served at each kind's "
                                                                  "concurrencies (PROFILING_CONCURRENCY), "
                                                                  "not all "
                                                                  "at once")
    ap.add_argument("--workloads", default=",".join(WORKLOADS), help=f"subset of {','.join(WORKLOADS)}")
    ap.add_argument("--scale", type=float, default=0.5,
                    help="request counts (and ShareGPT-like lengths); 1 = full")
    ap.add_argument("--doc-tokens", type=int, default=8192, help="long-document prompt length")
    ap.add_argument("--output-tokens", type=int, default=128, help="output tokens of docs and closed loop")
    ap.add_argument("--sharegpt-load", type=float, default=0.5, help="ShareGPT-like rate over stock's peak")
    ap.add_argument("--peak-requests", type=int, default=64, help="ShareGPT-like requests the peak is run on")
    ap.add_argument("--time-budget", type=float, default=300.0, help="seconds for all measured runs; 0: none")
    ap.add_argument("--max-num-seqs", type=int, default=None)
    ap.add_argument("--max-num-batched-tokens", type=int, default=None)
    ap.add_argument("--num-kv-blocks", type=int, default=None)
    ap.add_argument("--max-model-len", type=int, default=None, help="default: the longest request")
    ap.add_argument("--eager", action="store_true", help="no CUDA graphs")
    ap.add_argument("--attention-streaming", action="store_true",
                    help="det/detent: the attention's streaming fold")
    ap.add_argument("--cache-dir", default=None, help="the selectors' JIT cache")
    ap.add_argument("--progress", action="store_true", help="a progress bar per run")
    ap.add_argument("--json", default=None, help="default: $OUT/gpu_serving_<shape>.json")
    args = ap.parse_args()
    args.dtype = args.dtype or ("bfloat16" if args.device == "cuda" else "float32")
    return args


def main() -> int:
    args = parse_args()
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    wanted = [w.strip() for w in args.workloads.split(",") if w.strip()]
    unknown = [m for m in modes if m not in MODES] + [w for w in wanted if w not in WORKLOADS]
    if unknown:
        sys.exit(f"unknown modes or workloads: {', '.join(unknown)} (modes: {', '.join(MODES)}; "
                 f"workloads: {', '.join(WORKLOADS)})")
    if "detent-tuned" in modes and not args.tuned_tuple and not args.tune:
        print("detent-tuned skipped: no --tuned-tuple given (or --tune)", flush=True)
        modes.remove("detent-tuned")
    modes.sort(key=ORDER.index)  # stock first (its peak sets the loads), then the acceptance's detent-tuned
    base = "stock" if "stock" in modes else None
    shape = args.model.removeprefix("random:") if args.model else args.shape
    device = torch.cuda.get_device_name() if args.device == "cuda" else platform.processor() or "cpu"
    out: dict = {"device": device, "shape": shape, "args": vars(args), "modes": modes}
    plan = make_plan(args, token_space_for(engine_config(args, modes[0], 2048)))
    base_sets = (plan.sharegpt, plan.docs, plan.closed)
    max_len = args.max_model_len or max(w.max_len for w in base_sets)
    out["workloads"] = {w.name: {"requests": len(w.requests), "prompt_tokens": w.num_prompt_tokens,
                                 "output_tokens": w.num_output_tokens, "repeat_fraction": w.repeat_fraction,
                                 "params": dict(w.params)} for w in base_sets}
    if "detent-tuned" in modes and not args.tuned_tuple:
        out["tuning"] = tune_first(args, max_len, shape)
    peaks: dict[str, Peak] = {}
    results: dict[str, dict[str, RunResult]] = {}
    budget_left = args.time_budget if args.time_budget > 0 else math.inf
    skipped: list[str] = []
    t_start = time.perf_counter()
    for mode in modes:
        if budget_left <= 0:
            skipped += [f"{mode}/{w}" for w in wanted]
            continue
        results[mode] = {}
        # one engine per mode; detent-tuned with per-kind tuples: one per kind of workload, each with its
        # tuple
        per_kind = mode == "detent-tuned" and bool(getattr(args, "tuned_tuples", None))
        groups = ([(k, [w for w in wanted if kind_of(w) == k]) for k in KINDS] if per_kind
                  else [(None, wanted)])
        for kind, names in groups:
            if not names:
                continue
            t0 = time.perf_counter()
            llm = LLM(engine_config(args, mode, max_len, kind))
            out.setdefault("engine", {k: getattr(llm.config, k) for k in (
                "max_num_seqs", "max_num_batched_tokens", "num_kv_blocks", "max_model_len", "block_size",
                "cuda_graphs", "dtype")})
            warm_up(llm, plan, names)
            if "peaks" not in out:  # stock's, or the first mode's without stock
                if "sharegpt" in wanted:
                    peaks["sharegpt"] = measure_peak(llm, plan.sharegpt, args.peak_requests)
                if any(w.startswith("docs-") for w in wanted):
                    peaks["docs"] = measure_peak(llm, plan.docs)
                out["peaks"] = {"mode": mode, **{k: p.to_json() for k, p in peaks.items()},
                                "load_fractions": {"sharegpt": args.sharegpt_load,
                                                   "docs": list(LOAD_FRACTIONS)}}
                print(f"peaks on {mode}: " + ", ".join(f"{k} {p.requests_per_s:.2f} req/s"
                                                       for k, p in peaks.items()), flush=True)
            print(f"{mode}{f' ({kind})' if kind else ''}: build, warm-up and peaks "
                  f"{time.perf_counter() - t0:.1f} s",
                  flush=True)
            for w in plan.workloads(peaks, args.sharegpt_load, names):
                if budget_left <= 0:
                    skipped.append(f"{mode}/{w.name}")
                    continue
                with CompileWatch() as compiles:
                    r = run_workload(llm, w, admit_until=budget_left, progress=args.progress)
                results[mode][w.name] = r
                out.setdefault("compiles_in_timed_runs", {}).setdefault(mode, {})[w.name] = {
                    "count": compiles.count, "seconds": compiles.seconds}
                budget_left -= r.duration_s
                lat = r.latency_per_output_token
                print(f"{mode:>14} {w.name:>10}: {len(r.records)} requests ({r.num_dropped} dropped) in "
                      f"{r.duration_s:.1f} s, p50 {lat.p50 * 1e3:.2f} ms/token, {r.throughput:.0f} tok/s, "
                      f"cache hits {r.cached_fraction:.2f}, {compiles.count} kernel compiles "
                      f"({compiles.seconds:.1f} s)", flush=True)
            del llm
            gc.collect()
            if args.device == "cuda":
                torch.cuda.empty_cache()
    table, summary = report(results, base)
    checks = invariance(results)
    out.update(summary, results={m: {w: r.to_json() for w, r in per.items()} for m, per in results.items()},
               invariance=checks, skipped=skipped, wall_s=time.perf_counter() - t_start)
    path = args.json or os.path.join(os.environ.get("OUT", "."), f"gpu_serving_{shape}.json")
    with open(path, "w") as f:
        json.dump(out, f, indent=1)
    print(f"\n{out['device']}; {shape}, {args.dtype}, scale {args.scale}; peaks on {out['peaks']['mode']}; "
          f"wall {out['wall_s']:.0f} s\n")
    print(table)
    print("\nOutputs bit-identical across concurrency and load:")
    for mode, per in checks.items():
        if per:
                print(f"- {mode}: " + ", ".join(f"{k}: {v}" for k, v in per.items()))
    if skipped:
        print(f"\nskipped (--time-budget spent): {', '.join(skipped)}")
    print(f"\nwritten: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
