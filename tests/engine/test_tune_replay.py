"""The tuner's budgeted search on every recorded H200 landscape (benchmarks/results/*/…gpu_tune….json.gz, the
device's measured costs of every candidate on every call): within 2% of the exhaustive optimum, measuring
at most 15% of the grid, on the median costs and under the recorded timing noise."""

from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))  # the benchmarks' own modules
from tune_replay import load_recorded  # noqa: E402

from detent_audit.selection.tuner import search

RESULTS = Path(__file__).parents[2] / "benchmarks" / "results"
RECORDED = sorted(RESULTS.glob("*/*gpu_tune*.json.gz"))


def test_the_recorded_landscapes_are_found() -> None:
    assert len(RECORDED) >= 3, RECORDED


@pytest.mark.parametrize("path", RECORDED, ids=[f"{p.parent.name}/{p.name}" for p in RECORDED])
def test_budgeted_lands_within_2_percent_on_recorded_h200_costs(path) -> None:
    for r in load_recorded(path):
        exhaustive = search(r.classes, r.workload, r.median_cost, mode="exhaustive")
        for seed in range(20):
            for draws in (0, 3):  # the median costs; a timing's noise as the oracle's 15 repeats leave it
                found = search(r.classes, r.workload, r.noisy(draws, random.Random(seed)), mode="budgeted",
                               budget_fraction=r.budget_fraction, seed=seed, abandon=False)
                assert found.measured <= 0.15 * len(r.grid.legal)
                ratio = r.cost(found.best) / exhaustive.cost
                assert ratio <= 1.02, (path.name, r.kind, seed, draws, dict(found.best), ratio)
