"""The tuner's budgeted search replayed on real GPU costs (issue 5): every (candidate, call) time that
`benchmarks/gpu_tune.py` measured on the device is the oracle (median of its measurements), so the search can
be run for many seeds on the CPU. Reports, per workload kind, the grid, its classes of identical launches,
the exhaustive optimum and the budgeted search's true cost (the median costs) over it for each seed.
`--noise-draws N`: each oracle call also multiplies the median by the median of N draws from the recorded
spread (every measurement over its own pair's median): what a live search sees when each timing is the
median of N independent measurements (N = 1: one measurement, as in the runs of section 10).

Usage: python benchmarks/replay_tune.py [--seeds 40] [--noise-draws N] [FILE]   (default: the H200 run of 2026-11-29)
"""

from __future__ import annotations

import argparse
import ast
import gzip
import json
import math
import random
import statistics
from collections import defaultdict
from pathlib import Path

from detent_audit.engine.config import NAMED_SHAPES
from detent_audit.engine.kernel_select import engine_deployment, select_kernels
from detent_audit.engine.tune import GraphShape, family_grid, launch_classes
from detent_audit.selection.tuner import Workload, search

DEFAULT = Path(__file__).parent / "results" / "h200-2026-11-29" / "gpu_tune_llama-3.1-8b.json.gz"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("file", nargs="?", default=str(DEFAULT))
    ap.add_argument("--seeds", type=int, default=40)
    ap.add_argument("--noise-draws", type=int, default=0, help="0: the median costs, no noise")
    ap.add_argument("--abandon", action="store_true",
                    help="search(abandon=True): the CPU's early abandon (GPU tuning times every candidate fully)")
    args = ap.parse_args()
    opener = gzip.open if args.file.endswith(".gz") else open
    with opener(args.file, "rt") as f:
        data = json.load(f)
    # the engine the device run used (gpu_tune.py), for the same legal grid
    deployment = engine_deployment(NAMED_SHAPES[data["shape"]], dtype="bfloat16", num_threads=1, block_size=16,
                                   max_model_len=8320, max_num_seqs=32, max_num_batched_tokens=2048,
                                   prefix_caching=True)
    selection = select_kernels("detent", deployment)
    family = "embedded.attention"
    grid, _ = family_grid(selection.results[family], selection.tuple[family], "cuda")
    print("| kind | grid | classes | budget | exhaustive optimum | default / optimum | budgeted / optimum: "
          f"worst, median over {args.seeds} seeds (noise: {args.noise_draws or 'none'}, abandon {args.abandon}) | within 2% |\n|---|---|---|---|---|---|---|---|")
    for kind, k in data["kinds"].items():
        times: dict[tuple, list[float]] = defaultdict(list)
        for a, call, t in k["log"]:
            times[(a["kv_tile"], a["split_stride"], call)].append(t)
        calls = tuple((ast.literal_eval(c), n) for c, n in k["calls"])
        # the classes the device run timed: with the graphs' splits for replayed decode steps, if it modelled them
        graphs = GraphShape(*data["graphs"]) if data.get("graphs") else None
        reduced = launch_classes(grid, Workload(calls), graphs)
        keyed = Workload(tuple((repr(c), n) for c, n in calls))  # the log's keys

        def median_cost(a, call, times=times):
            return statistics.median(times[(a["kv_tile"], a["split_stride"], call)])

        spread = [t / statistics.median(v) for v in times.values() if len(v) > 1 for t in v]
        exhaustive = search(reduced, keyed, median_cost, mode="exhaustive")
        fraction = min(1.0, 0.15 * len(grid.legal) / len(reduced.legal))
        ratios = []
        for seed in range(args.seeds):
            rng = random.Random(seed)

            def oracle(a, call, rng=rng, spread=spread, cost=median_cost):
                if not args.noise_draws:
                    return cost(a, call)
                return cost(a, call) * statistics.median(rng.choice(spread) for _ in range(args.noise_draws))

            best = search(reduced, keyed, oracle, mode="budgeted", budget_fraction=fraction, seed=seed,
                          abandon=args.abandon).best
            ratios.append(math.fsum(n * median_cost(best, c) for c, n in keyed.calls) / exhaustive.cost)
        default = next(m.cost for m in exhaustive.trace if m.assignment == reduced.default)
        budget = search(reduced, keyed, median_cost, mode="budgeted", budget_fraction=fraction,
                        abandon=args.abandon).measured
        print(f"| {kind} | {len(grid.legal)} | {len(reduced.legal)} | {budget} ({budget / len(grid.legal):.0%}) | "
              f"{dict(exhaustive.best)} {exhaustive.cost * 1e3:.1f} ms | {default / exhaustive.cost:.3f} | "
              f"{max(ratios):.4f}, {statistics.median(ratios):.4f} | {sum(r <= 1.02 for r in ratios)}/{len(ratios)} |")


if __name__ == "__main__":
    main()
