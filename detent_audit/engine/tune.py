"""`detent-audit tune`: commit a tuple for a workload (docs/design.md section 3, "Tuner").

1. Serve the profiling workload with the current tuple and record every kernel call per family
   (`tune_record.py`).
2. Build each family's grid from the solve, and 3. search it with the tuner core (budgeted or exhaustive)
   against an oracle that times the family's kernel on each recorded call's shape (`tune_search.py`).
4. Commit the best assignment of each family (here): a tuple file the engine, `serve` and `verify` accept.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from detent_audit.engine.llm import LLM
from detent_audit.engine.tune_record import record_profile
from detent_audit.engine.tune_search import (
    Oracle,
    classes_fraction,
    family_grid,
    graph_shape,
    heaviest,
    launch_classes,
)
from detent_audit.enums import Mode
from detent_audit.errors import BadInput
from detent_audit.selection.compiler import SolveResult
from detent_audit.selection.tuner import Mode as SearchMode
from detent_audit.selection.tuner import TuneResult, search


def _gemm_with_every_proven_form(llm: LLM) -> SolveResult:
    """The embedded.gemm family solved for the engine's deployment with every GEMM form the probe proves on
    this CPU, thread count and model (kernels/gemm_probe.py): the tuner's candidates. The committed form is
    probed again when an engine starts with the tuple."""
    from detent_audit.kernels import gemm_probe
    from detent_audit.selection.compiler import solve
    from detent_audit.selection.programs import families_for

    shapes, dtype = llm.model.gemm_shapes(), getattr(torch, llm.config.dtype)
    dep = llm.deployment
    engine = dataclasses.replace(dep.engine, gemm_pad_rows=gemm_probe.least_pad_rows(shapes, dtype),
                                 gemm_row_form=gemm_probe.row_form_holds(shapes, dtype))
    dep = dataclasses.replace(dep, engine=engine)
    spec = next(s for s in families_for(dep) if s.name == "embedded.gemm")
    return solve(spec.program, spec.facts(dep), family=spec.name)


@dataclass(frozen=True)
class FamilyReport:
    family: str
    grid_size: int              # the family's legal grid (distinct kernel parameters)
    measured: int               # distinct assignments timed
    default_cost: float
    tuned_cost: float
    chosen: dict
    distinct_launches: int = 0  # GPU attention: the grid's classes of identical launches on the workload

    def to_json(self) -> dict:
        return dict(self.__dict__)


def tune_engine(llm: LLM, requests: list, *, mode: SearchMode = "budgeted", budget_fraction: float = 0.15,
                seed: int = 0, progress: Callable[[str, int, int], None] | None = None, cold_kv: bool = False,
                concurrency: Sequence[int | None] = (None,)) -> tuple[dict[str, dict], list[FamilyReport]]:
    """Profile `requests` on `llm` (detent mode; `record_profile` at `concurrency`), tune every called family,
    return (tuple, reports). `cold_kv`: the GPU oracle's `cold_kv`."""
    if llm.config.mode != Mode.DETENT:
        raise BadInput("tune commits a tuple for detent mode", remedy="use --mode detent")
    calls = record_profile(llm, requests, concurrency)
    device = llm.config.device
    shape = graph_shape(llm)
    oracle = Oracle(seed, device, getattr(llm.selection.kernels, "streaming", False), shape, cold_kv)
    committed = dict(llm.selection.tuple)
    results = dict(llm.selection.results)
    # the forms this CPU proves, whatever the engine runs now
    if device == "cpu" and "embedded.gemm" in calls:
        results["embedded.gemm"] = _gemm_with_every_proven_form(llm)
    reports = []
    for family, counter in sorted(calls.items()):
        grid, reps = family_grid(results[family], committed[family], device)
        workload = heaviest(family, counter)
        searched, fraction = grid, budget_fraction
        if device != "cpu" and family == "embedded.attention":
            # search the classes of identical launches; the budget stays a fraction of the whole grid
            searched = launch_classes(grid, workload, shape)
            fraction = classes_fraction(grid, searched, budget_fraction)
        # on a GPU candidates are timed on every call (a noisy timer's abandoned estimates mislead the
        # surface: benchmarks/replay_tune.py); the CPU keeps the lossless early abandon
        result: TuneResult = search(searched, workload, functools.partial(oracle, family), mode=mode,
                                    budget_fraction=fraction, seed=seed, abandon=device == "cpu",
                                    progress=functools.partial(progress, family) if progress else None)
        default_cost = next(m.cost for m in result.trace if m.assignment == grid.default and m.complete)
        committed[family] = reps[result.best]
        oracle._inputs.clear()
        reports.append(FamilyReport(family, len(grid.legal), result.measured, default_cost, result.cost,
                                    dict(result.best), len(searched.legal)))
    return committed, reports
