"""The tuner's GPU search replayed on recorded device costs: a file of `benchmarks/gpu_tune.py` (every
(assignment, call, seconds) its oracle measured on the device, exhaustive search included) becomes, per
workload kind, the grid the device searched and an oracle that answers with the recorded median, optionally
with the recorded noise. `benchmarks/replay_tune.py` reports on it; the tests hold the budgeted search to 2%
of the optimum on every recorded H200 landscape."""

from __future__ import annotations

import ast
import gzip
import json
import math
import random
import statistics
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

from detent_audit.engine.tune_search import GraphShape, classes_fraction, family_grid, launch_classes
from detent_audit.runtime.kernel_select import engine_deployment, select_kernels
from detent_audit.runtime.model_config import NAMED_SHAPES
from detent_audit.selection.tuner import Assignment, FamilyGrid, Workload

FAMILY = "embedded.attention"
BUDGET_FRACTION = 0.15  # of the whole grid, as `tune_engine` spends it
# the engine benchmarks/gpu_tune.py records on (its grid is the one replayed)
RECORDING_ENGINE = {"max_num_seqs": 32, "max_num_batched_tokens": 2048, "max_model_len": 8320}


@dataclass(frozen=True)
class RecordedKind:
    """One workload kind of a recorded run: the whole grid, the launch classes the device searched, the
    recorded calls (keyed as the log keys them) and every recorded time per (kv_tile, split_stride, call)."""

    kind: str
    grid: FamilyGrid
    classes: FamilyGrid
    workload: Workload
    times: dict[tuple, list[float]]

    @property
    def budget_fraction(self) -> float:
        """The fraction of the classes a budgeted search may measure: 15% of the whole grid."""
        return classes_fraction(self.grid, self.classes, BUDGET_FRACTION)

    def median_cost(self, a: Assignment, call: str) -> float:
        return statistics.median(self.times[(a["kv_tile"], a["split_stride"], call)])

    def cost(self, a: Assignment) -> float:
        """`a`'s workload cost on the median times."""
        return math.fsum(n * self.median_cost(a, c) for c, n in self.workload.calls)

    def noisy(self, draws: int, rng: random.Random):
        """An oracle: the median times, each multiplied by the median of `draws` draws from the recorded
        spread (every measurement over its own pair's median), i.e. what a live search sees when each timing
        is the median of `draws` measurements; `draws` 0: no noise."""
        spread = [t / statistics.median(v) for v in self.times.values() if len(v) > 1 for t in v]

        def oracle(a: Assignment, call: str) -> float:
            if not draws:
                return self.median_cost(a, call)
            return self.median_cost(a, call) * statistics.median(rng.choice(spread) for _ in range(draws))

        return oracle


def load_recorded(path: str | Path) -> list[RecordedKind]:
    """The kinds of a gpu_tune.py file (.json or .json.gz), on the grid of the engine that run used."""
    path = Path(path)
    with (gzip.open(path, "rt") if path.suffix == ".gz" else path.open()) as f:
        data = json.load(f)
    deployment = engine_deployment(NAMED_SHAPES[data["shape"]], dtype="bfloat16", num_threads=1,
                                   block_size=16, prefix_caching=True, **RECORDING_ENGINE)
    selection = select_kernels("detent", deployment)
    grid, _ = family_grid(selection.results[FAMILY], selection.tuple[FAMILY], "cuda")
    # the classes the device run timed: with the graphs' splits for replayed decode steps, if it modelled them
    graphs = GraphShape(*data["graphs"]) if data.get("graphs") else None
    kinds = []
    for kind, k in data["kinds"].items():
        times: dict[tuple, list[float]] = defaultdict(list)
        for a, call, t in k["log"]:
            times[(a["kv_tile"], a["split_stride"], call)].append(t)
        calls = tuple((ast.literal_eval(c), n) for c, n in k["calls"])
        kinds.append(RecordedKind(kind, grid, launch_classes(grid, Workload(calls), graphs),
                                  Workload(tuple((repr(c), n) for c, n in calls)), dict(times)))
    return kinds
