"""The tuner on the GPU, recorded for replay: profile a workload kind on the engine, time every
class of identical attention launches on every recorded call (the exhaustive search), run the budgeted search,
and write every (assignment, call, seconds) the oracle measured, so the search can be studied offline on real
H200 costs (`replay_oracle`).

Usage (device): python3 benchmarks/gpu_tune.py [--shape llama-3.1-8b] [--kinds docs,closed]
Writes $OUT/gpu_tune_<shape>.json (after every kind).
"""

from __future__ import annotations

import argparse
import json
import os
import time

from serving_harness import engine_requests, token_space_of
from tune_replay import BUDGET_FRACTION, FAMILY, RECORDING_ENGINE

from detent_audit.bench.workloads import PROFILING_CONCURRENCY, profiling_samples
from detent_audit.engine.llm import LLM, EngineConfig
from detent_audit.engine.tune_record import record_profile
from detent_audit.engine.tune_search import (
    Oracle,
    classes_fraction,
    family_grid,
    graph_shape,
    heaviest,
    launch_classes,
)
from detent_audit.selection.tuner import search


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="llama-3.1-8b")
    ap.add_argument("--kinds", default="docs,closed")
    ap.add_argument("--attention-streaming", action="store_true", help="tune the attention's streaming mode")
    ap.add_argument("--as-served", action="store_true",
                    help="profile each kind at the concurrencies its timed "
                                                             "workloads run at (PROFILING_CONCURRENCY), as "
                                                             "gpu_serving.py --tune-as-served does")
    ap.add_argument("--cold-kv", action="store_true",
                    help="the oracle's cold_kv: each launch of a repeat reads "
                                                           "its own K/V copy, as the engine's layers do")
    args = ap.parse_args()
    llm = LLM(EngineConfig(model=f"random:{args.shape}", device="cuda", dtype="bfloat16", mode="detent",
                           num_kv_blocks=16384, **RECORDING_ENGINE,
                           attention_streaming=args.attention_streaming))
    space = token_space_of(llm)
    samples = profiling_samples(space, scale=0.25, doc_tokens=8192, output_tokens=128)
    shape = graph_shape(llm)
    out: dict = {"shape": args.shape, "kinds": {}, "cold_kv": args.cold_kv, "as_served": args.as_served,
                 "graphs": [shape.max_model_len, shape.max_batch] if shape is not None else None}
    for kind in args.kinds.split(","):
        llm.reset()
        requests = engine_requests(kind, samples[kind])
        calls = record_profile(llm, requests, PROFILING_CONCURRENCY[kind] if args.as_served else (None,))
        grid, _ = family_grid(llm.selection.results[FAMILY], llm.selection.tuple[FAMILY], "cuda")
        workload = heaviest(FAMILY, calls[FAMILY])
        reduced = launch_classes(grid, workload, shape)  # as tune does
        oracle = Oracle(0, "cuda", args.attention_streaming, shape, args.cold_kv)
        log: list = []

        def timed(a, call, oracle=oracle, log=log):
            t = oracle(FAMILY, a, call)
            log.append((dict(a), repr(call), t))
            return t

        t0 = time.perf_counter()
        ex = search(reduced, workload, timed, mode="exhaustive")
        t1 = time.perf_counter()
        frac = classes_fraction(grid, reduced, BUDGET_FRACTION)
        bu = search(reduced, workload, timed, mode="budgeted", budget_fraction=frac,
                    abandon=False)  # as tune does
        t2 = time.perf_counter()
        out["kinds"][kind] = {
            "grid": len(grid.legal), "classes": len(reduced.legal), "default": dict(grid.default),
            "calls": [(repr(c), n) for c, n in workload.calls],
            "exhaustive": {"best": dict(ex.best), "cost": ex.cost, "measured": ex.measured, "s": t1 - t0,
                           "trace": [(dict(m.assignment), m.cost, m.complete) for m in ex.trace]},
            "budgeted": {"best": dict(bu.best), "cost": bu.cost, "measured": bu.measured, "s": t2 - t1},
            "log": log}
        print(f"{kind}: grid {len(grid.legal)}, classes {len(reduced.legal)}; exhaustive {dict(ex.best)} "
              f"{ex.cost * 1e3:.2f} ms ({t1 - t0:.0f} s); budgeted {dict(bu.best)} {bu.cost * 1e3:.2f} ms, "
              f"measured {bu.measured} ({t2 - t1:.0f} s); ratio {bu.cost / ex.cost:.4f}", flush=True)
        oracle._inputs.clear()
        # after every kind, so a run cut short keeps the kinds it finished
        with open(os.path.join(os.environ.get("OUT", "."), f"gpu_tune_{args.shape}.json"), "w") as f:
            json.dump(out, f)


if __name__ == "__main__":
    main()
