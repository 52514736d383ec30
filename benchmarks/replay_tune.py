"""The tuner's budgeted search replayed on real GPU costs (issue 5): every (candidate, call) time that
`benchmarks/gpu_tune.py` measured on the device is the oracle (median of its measurements), so the search can
be run for many seeds on the CPU. Reports, per workload kind, the grid, its classes of identical launches,
the exhaustive optimum and the budgeted search's cost over it for each seed.

Usage: python benchmarks/replay_tune.py [--seeds 40] [FILE]   (default: the H200 run of 2026-11-29)
"""

from __future__ import annotations

import argparse
import ast
import gzip
import json
import statistics
from collections import defaultdict
from pathlib import Path

from detent_audit.engine.config import NAMED_SHAPES
from detent_audit.engine.kernel_select import engine_deployment, select_kernels
from detent_audit.engine.tune import family_grid, launch_classes
from detent_audit.selection.tuner import Workload, search

DEFAULT = Path(__file__).parent / "results" / "h200-2026-11-29" / "gpu_tune_llama-3.1-8b.json.gz"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("file", nargs="?", default=str(DEFAULT))
    ap.add_argument("--seeds", type=int, default=40)
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
          f"worst, median over {args.seeds} seeds | within 2% |\n|---|---|---|---|---|---|---|---|")
    for kind, k in data["kinds"].items():
        times: dict[tuple, list[float]] = defaultdict(list)
        for a, call, t in k["log"]:
            times[(a["kv_tile"], a["split_stride"], call)].append(t)
        calls = tuple((ast.literal_eval(c), n) for c, n in k["calls"])
        reduced = launch_classes(grid, Workload(calls))
        keyed = Workload(tuple((repr(c), n) for c, n in calls))  # the log's keys

        def oracle(a, call, times=times):
            return statistics.median(times[(a["kv_tile"], a["split_stride"], call)])

        exhaustive = search(reduced, keyed, oracle, mode="exhaustive")
        fraction = min(1.0, 0.15 * len(grid.legal) / len(reduced.legal))
        ratios = [search(reduced, keyed, oracle, mode="budgeted", budget_fraction=fraction, seed=s).cost
                  / exhaustive.cost for s in range(args.seeds)]
        default = next(m.cost for m in exhaustive.trace if m.assignment == reduced.default)
        budget = search(reduced, keyed, oracle, mode="budgeted", budget_fraction=fraction).measured
        print(f"| {kind} | {len(grid.legal)} | {len(reduced.legal)} | {budget} ({budget / len(grid.legal):.0%}) | "
              f"{dict(exhaustive.best)} {exhaustive.cost * 1e3:.1f} ms | {default / exhaustive.cost:.3f} | "
              f"{max(ratios):.4f}, {statistics.median(ratios):.4f} | {sum(r <= 1.02 for r in ratios)}/{len(ratios)} |")


if __name__ == "__main__":
    main()
