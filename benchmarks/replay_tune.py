"""The tuner's budgeted search replayed on real GPU costs: every (candidate, call) time that
`benchmarks/gpu_tune.py` measured on the device is the oracle (median of its measurements), so the search can
be run for many seeds on the CPU. Reports, per workload kind, the grid, its classes of identical launches,
the exhaustive optimum and the budgeted search's true cost (the median costs) over it for each seed.
`--noise-draws N`: each oracle call also multiplies the median by the median of N draws from the recorded
spread (every measurement over its own pair's median): what a live search sees when each timing is the
median of N independent measurements (N = 1: one measurement, as a live search without repeats takes;
RESULTS.md, "Tuner").

Usage: python benchmarks/replay_tune.py [--seeds 40] [--noise-draws N] [FILE]
(FILE's default: the split-combine H200 landscape)
"""

from __future__ import annotations

import argparse
import random
import statistics
from pathlib import Path

from tune_replay import load_recorded

from detent_audit.selection.tuner import search

DEFAULT = Path(__file__).parent / "results" / "h200-split-combine" / "gpu_tune_llama-3.1-8b.json.gz"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("file", nargs="?", default=str(DEFAULT))
    ap.add_argument("--seeds", type=int, default=40)
    ap.add_argument("--noise-draws", type=int, default=0, help="0: the median costs, no noise")
    ap.add_argument("--abandon", action="store_true",
                    help="search(abandon=True): the CPU's early abandon (GPU tuning times every candidate "
                         "fully)")
    args = ap.parse_args()
    print("| kind | grid | classes | budget | exhaustive optimum | default / optimum | budgeted / optimum: "
          f"worst, median over {args.seeds} seeds (noise: {args.noise_draws or 'none'}, "
          f"abandon {args.abandon}) | within 2% |\n|---|---|---|---|---|---|---|---|")
    for r in load_recorded(args.file):
        exhaustive = search(r.classes, r.workload, r.median_cost, mode="exhaustive")
        ratios = []
        for seed in range(args.seeds):
            best = search(r.classes, r.workload, r.noisy(args.noise_draws, random.Random(seed)),
                          mode="budgeted",
                          budget_fraction=r.budget_fraction, seed=seed, abandon=args.abandon).best
            ratios.append(r.cost(best) / exhaustive.cost)
        default = next(m.cost for m in exhaustive.trace if m.assignment == r.classes.default)
        budget = search(r.classes, r.workload, r.median_cost, mode="budgeted",
                        budget_fraction=r.budget_fraction, abandon=args.abandon).measured
        print(f"| {r.kind} | {len(r.grid.legal)} | {len(r.classes.legal)} | {budget} "
              f"({budget / len(r.grid.legal):.0%}) | "
              f"{dict(exhaustive.best)} {exhaustive.cost * 1e3:.1f} ms | {default / exhaustive.cost:.3f} | "
              f"{max(ratios):.4f}, {statistics.median(ratios):.4f} | "
              f"{sum(x <= 1.02 for x in ratios)}/{len(ratios)} |")


if __name__ == "__main__":
    main()
