"""Tuner search core: the per-family optimum of a legal grid on a recorded workload (pure, engine-free).

A family's grid is its pins x the knobs only that family reads; `legal` lists the assignments VRA allows.
The cost of an assignment `a` on a workload W = {(call, count)} is `fsum(count * oracle(a, call))`, so
families are tuned independently (`tune`) and the optimum of the sum is the sum of the optima.

`search(mode="exhaustive")` measures every legal assignment. `search(mode="budgeted")` measures at most
`budget(len(legal), fraction)` distinct assignments (an assignment counts as measured once the oracle has
timed it on any call; results are cached, so re-visiting one is free). The budgeted method is a
model-based search:

1. measure the default on every call; order the calls heaviest first (count x the default's time); then
   measure the grid's anchors (`FamilyGrid.anchors`: points of a kernel regime of their own, which no trend
   of their neighbours predicts; for GPU attention the class of each KV tile that splits no call, where the
   H200's closed-loop optimum lies: the search without them stopped at 1.107 of it live and 1.118 for every
   replayed seed, with them 0 of 150 replayed seeds miss 2%);
2. measure a seeded space-filling sample (a quarter of the budget: each point in turn the farthest, in
   scaled axis ranks, from those measured and chosen before it);
3. until the budget is spent, fit a response surface to the log costs measured so far (`_Surface`:
   additive per-axis effects, smooth along each axis, plus pairwise interactions, weighted towards the
   cheapest points) and measure (a) the unmeasured legal point it predicts cheapest anywhere (global step)
   and (b) the one it predicts cheapest within one step on every axis of the best point so far (two or
   three steps when those are all measured; local step, which refines around the optimum). A step is one
   rank, or size // 16 ranks on an axis of more levels (a split stride on a 256 step has ~60), so a local
   move crosses a long axis in a few steps;
4. whenever those steps moved the best point, a line search along that move (`_line_search`: moves doubled
   while they improve, then the move's own length and halves), which reaches a valley the additive surface
   misplaces (on the H200's docs landscape with the one-pass streaming fold, the surface alone stopped at
   1.050 of the optimum for every seed; with the line search, 0 of 150 replayed seeds miss 2%).

The surface extrapolates trends to points no local move reaches (the largest tile a shared-memory limit
allows, across a worse region) and needs no numeric axis values: a categorical axis just gets one effect
per value. Only legal points are ever proposed (the surface ranks `grid.legal` alone).

Every comparison is "is the candidate cheaper than the best so far?": a candidate is timed on the calls
heaviest first and abandoned as soon as its partial sum exceeds that bound (times are non-negative, so
this loses nothing: the best assignment is always measured on every call and its cost is exact; the surface
sees an abandoned point's partial sum scaled up by the default's share of those calls). This is the
lossless form of measuring candidates on the heaviest calls first; it saves oracle calls, not budget. With
a noisy oracle (a GPU timer) `abandon=False` times every candidate on every call: the abandoned points'
estimates crowd just above the best and hide the landscape from the surface (benchmarks/replay_tune.py on
recorded H200 costs: 98-100 of 100 seeds within 2% of the optimum against 88-90 with abandoning).

The search is deterministic for a given seed on one machine (the surface is a numpy least-squares fit).
"""

from __future__ import annotations

import functools
import itertools
import math
import numbers
import random
from collections.abc import Callable, Hashable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Literal, NamedTuple

import numpy as np

from detent_audit.errors import BadInput

Call = Hashable
Oracle = Callable[["Assignment", Call], float]
Progress = Callable[[int, int], None]
Mode = Literal["budgeted", "exhaustive"]

DEFAULT_BUDGET_FRACTION = 0.15
# grids with fewer than MIN_BUDGET / fraction points still get MIN_BUDGET measurements (all, if smaller)
MIN_BUDGET = 8


class Assignment(Mapping[str, Hashable]):
    """An immutable mapping axis name -> value; hashable through its canonical form `key`."""

    __slots__ = ("_map", "key", "_hash")

    def __init__(self, values: Mapping[str, Hashable] | Iterable[tuple[str, Hashable]] = (), **kw: Hashable):
        self._map = dict(values, **kw)
        # the canonical form: items sorted by axis name
        self.key: tuple[tuple[str, Hashable], ...] = tuple(sorted(self._map.items(), key=lambda kv: kv[0]))
        try:
            self._hash = hash(self.key)
        except TypeError as err:
            raise BadInput(f"assignment {self._map!r} has an unhashable value",
                           remedy="use numbers or strings") from err

    def __getitem__(self, axis: str) -> Hashable:
        return self._map[axis]

    def __iter__(self) -> Iterator[str]:
        return (axis for axis, _ in self.key)

    def __len__(self) -> int:
        return len(self.key)

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Assignment):
            return self.key == other.key
        return isinstance(other, Mapping) and self._map == dict(other)

    def __repr__(self) -> str:
        return "Assignment(" + ", ".join(f"{axis}={value!r}" for axis, value in self.key) + ")"

    def replace(self, **changes: Hashable) -> Assignment:
        """This assignment with some axes set to other values."""
        return Assignment(self._map, **changes)


@dataclass(frozen=True)
class FamilyGrid:
    """A family's legal grid. Invariants: axes sorted by name, each a non-empty tuple of distinct values
    in a meaningful order (ascending numbers); every legal assignment sets exactly the axes to values of
    theirs, without repeats; `default` is legal. Mappings given for `legal`/`default` become `Assignment`s;
    the order of `legal` breaks ties between equal costs. `anchors`: legal points the grid's owner knows to
    run a kernel regime of their own (a split stride past every call's length launches no split at all, so
    no partials and no combine): a budgeted search measures them right after the default, since no trend of
    their neighbours predicts them."""

    family: str
    axes: dict[str, tuple[Hashable, ...]]
    legal: tuple[Assignment, ...]
    default: Assignment
    anchors: tuple[Assignment, ...] = ()

    def __post_init__(self) -> None:
        bad = f"family {self.family!r}: "
        if not self.axes:
            raise BadInput(bad + "the grid has no axes",
                           remedy="give each pin and knob of the family an axis")
        axes = {name: tuple(self.axes[name]) for name in sorted(self.axes)}
        for name, values in axes.items():
            if not values or len(set(values)) != len(values):
                raise BadInput(bad + f"axis {name!r} must list distinct values, got {values!r}")
        legal = tuple(a if isinstance(a, Assignment) else Assignment(a) for a in self.legal)
        if not legal:
            raise BadInput(bad + "no legal assignment", remedy="check the pins' value ranges (VRA)")
        for a in legal:
            if set(a) != set(axes) or any(a[name] not in values for name, values in axes.items()):
                raise BadInput(bad + f"legal assignment {a!r} does not fit the axes {axes!r}")
        if len(set(legal)) != len(legal):
            raise BadInput(bad + "the legal assignments repeat", remedy="list each assignment once")
        default = self.default if isinstance(self.default, Assignment) else Assignment(self.default)
        if default not in set(legal):
            raise BadInput(bad + f"the default {default!r} is not legal", remedy="pick a legal default")
        anchors = tuple(a if isinstance(a, Assignment) else Assignment(a) for a in self.anchors)
        if not set(anchors) <= set(legal) or len(set(anchors)) != len(anchors):
            raise BadInput(bad + f"the anchors {anchors!r} must be distinct legal assignments")
        object.__setattr__(self, "axes", axes)
        object.__setattr__(self, "legal", legal)
        object.__setattr__(self, "default", default)
        object.__setattr__(self, "anchors", anchors)

    @classmethod
    def product(cls, family: str, axes: Mapping[str, Iterable[Hashable]], default: Mapping[str, Hashable],
                legal_if: Callable[[Assignment], bool] | None = None) -> FamilyGrid:
        """The grid of every combination of the axes' values that `legal_if` accepts (all, if None)."""
        names = sorted(axes)
        values = [tuple(axes[name]) for name in names]
        points = (Assignment(zip(names, combo, strict=True)) for combo in itertools.product(*values))
        legal = tuple(a for a in points if legal_if is None or legal_if(a))
        return cls(family, dict(zip(names, values, strict=True)), legal, Assignment(default))


@dataclass(frozen=True)
class Workload:
    """A family's recorded calls: distinct hashable call descriptions, each with a positive integer count."""

    calls: tuple[tuple[Call, int], ...]

    def __post_init__(self) -> None:
        calls = tuple(self.calls)
        if not calls:
            raise BadInput("the workload is empty", remedy="record a workload with at least one call")
        for pair in calls:
            if not isinstance(pair, tuple) or len(pair) != 2:
                raise BadInput(f"workload entry {pair!r} is not a (call, count) pair")
            call, count = pair
            if isinstance(count, bool) or not isinstance(count, numbers.Integral) or count <= 0:
                raise BadInput(f"call {call!r} has count {count!r}; counts must be positive integers")
        try:
            distinct = len({call for call, _ in calls})
        except TypeError as err:
            raise BadInput("a workload call is unhashable",
                           remedy="describe calls by tuples of values") from err
        if distinct != len(calls):
            raise BadInput("the workload repeats a call", remedy="merge the counts of equal calls")
        object.__setattr__(self, "calls", calls)

    @classmethod
    def from_counts(cls, counts: Mapping[Call, int]) -> Workload:
        return cls(tuple(counts.items()))


class Measurement(NamedTuple):
    """One measured assignment: `cost` is exact when `complete`, else a lower bound that already exceeded
    the bound it was compared against (the assignment was abandoned)."""

    assignment: Assignment
    cost: float
    complete: bool


@dataclass(frozen=True)
class TuneResult:
    """A family's optimum: `best` (legal, measured on every call) and its workload cost in seconds;
    `measured` distinct assignments of `grid_size`, `oracle_calls` timings, `trace` in measurement order."""

    family: str
    best: Assignment
    cost: float
    measured: int
    grid_size: int
    mode: Mode
    oracle_calls: int
    trace: tuple[Measurement, ...]

    @property
    def fraction(self) -> float:
        return self.measured / self.grid_size


def budget(grid_size: int, fraction: float = DEFAULT_BUDGET_FRACTION) -> int:
    """Distinct assignments a budgeted search may measure: floor(fraction x size), at least MIN_BUDGET (or
    the whole grid if it is smaller)."""
    if not 0.0 < fraction <= 1.0:
        raise BadInput(f"budget fraction {fraction!r} is not in (0, 1]")
    return min(grid_size, max(MIN_BUDGET, math.floor(fraction * grid_size + 1e-9)))


def search(grid: FamilyGrid, workload: Workload, oracle: Oracle, *, mode: Mode = "budgeted",
           budget_fraction: float = DEFAULT_BUDGET_FRACTION, seed: int = 0,
           progress: Progress | None = None, abandon: bool = True) -> TuneResult:
    """The cheapest legal assignment of `grid` for `workload` under `oracle` (seconds per call).

    Exhaustive mode measures every legal assignment on every call and returns the true optimum (ties go to
    the first in `grid.legal`). Budgeted mode measures at most `budget(len(grid.legal), budget_fraction)`
    distinct assignments (see the module docstring). `progress(measured, limit)` is called after each new
    assignment. `abandon=False` times every candidate on every call (more oracle calls, the same budget):
    the surface then fits true costs, not the compressed estimates of abandoned candidates, which a noisy
    oracle's flat-looking landscape needs.
    Raises `BadInput` when the oracle returns anything but a finite time >= 0.
    """
    if mode not in ("budgeted", "exhaustive"):
        raise BadInput(f"unknown search mode {mode!r}", remedy="use 'budgeted' or 'exhaustive'")
    size = len(grid.legal)
    limit = size if mode == "exhaustive" else budget(size, budget_fraction)
    meter = _Meter(grid, workload, oracle, limit, progress, abandon)
    try:
        meter.cost(grid.default)
        meter.order_by(grid.default)
        if limit >= size:
            for a in grid.legal:
                meter.cost(a)
        else:
            _budgeted(meter, _Lattice(grid), random.Random(seed), grid.anchors)
    except _BudgetSpent:
        pass
    best, cost = meter.best
    return TuneResult(grid.family, best, cost, len(meter.times), size, mode, meter.oracle_calls,
                      meter.trace())


def tune(grids: Mapping[str, FamilyGrid], workloads: Mapping[str, Workload],
         oracle: Callable[[str, Assignment, Call], float], **options: Any) -> dict[str, TuneResult]:
    """`search` each family independently (cost is additive over families), in sorted family order;
    `options` go to `search`. Every family with a workload must have a grid; families without a workload
    are skipped (they were never called)."""
    missing = sorted(set(workloads) - set(grids))
    if missing:
        raise BadInput(f"workloads name families without a grid: {missing}",
                       remedy="solve those families first")
    return {family: search(grids[family], workloads[family], functools.partial(oracle, family), **options)
            for family in sorted(workloads)}


class _BudgetSpent(Exception):
    """The budget of distinct assignments is spent: the search stops with the best point so far."""


class _Meter:
    """Cached, budgeted, bounded measurement of workload costs; keeps the best complete measurement."""

    def __init__(self, grid: FamilyGrid, workload: Workload, oracle: Oracle, limit: int,
                 progress: Progress | None, abandon: bool = True) -> None:
        self.family, self.calls, self.oracle = grid.family, workload.calls, oracle
        self.limit, self.progress, self.abandon = limit, progress, abandon
        self.order = list(range(len(self.calls)))
        # assignment -> count x time per call, in `order`; insertion order is measurement order
        self.times: dict[Assignment, list[float]] = {}
        # assignment -> its cost, or for an abandoned one its partial sum scaled up by the default's share
        # of those calls (an estimate for the surface), in the same order as `times`
        self.estimates: dict[Assignment, float] = {}
        self.default_share = [1.0]
        self.oracle_calls = 0
        self.best: tuple[Assignment, float] = (grid.default, math.inf)
        self._rank = {a: i for i, a in enumerate(grid.legal)}

    def cost(self, a: Assignment, bound: float = math.inf) -> float:
        """`a`'s exact cost, or `math.inf` once its partial sum exceeds `bound` (so it is not below it)."""
        if not self.abandon:
            bound = math.inf
        values = self.times.get(a)
        if values is None:
            if len(self.times) >= self.limit:
                raise _BudgetSpent
            values = self.times[a] = []
            if self.progress is not None:
                self.progress(len(self.times), self.limit)
        running = sum(values)
        for i in self.order[len(values):]:
            if running > bound and math.fsum(values) > bound:  # fsum: the exact check, made rarely
                self.estimates[a] = math.fsum(values) / max(self.default_share[len(values)], 1e-300)
                return math.inf
            call, count = self.calls[i]
            values.append(count * self._time(a, call))
            running += values[-1]
        cost = self.estimates[a] = math.fsum(values)
        if (cost, self._rank[a]) < (self.best[1], self._rank[self.best[0]]):
            self.best = (a, cost)
        return cost

    def order_by(self, a: Assignment) -> None:
        """Time later assignments on the calls heaviest for `a` first (a was measured on every call)."""
        values = self.times[a]
        self.order = sorted(range(len(values)), key=lambda i: (-values[i], i))
        self.times[a] = [values[i] for i in self.order]
        total = math.fsum(values)
        # default_share[k]: the default's share of its cost on the k heaviest calls
        self.default_share = [s / total if total > 0 else 1.0
                              for s in itertools.accumulate(self.times[a], initial=0.0)]

    def trace(self) -> tuple[Measurement, ...]:
        n = len(self.calls)
        return tuple(Measurement(a, math.fsum(v), len(v) == n) for a, v in self.times.items())

    def _time(self, a: Assignment, call: Call) -> float:
        t = self.oracle(a, call)
        self.oracle_calls += 1
        if isinstance(t, bool) or not isinstance(t, numbers.Real) or not (math.isfinite(t) and t >= 0):
            raise BadInput(f"family {self.family!r}: the cost oracle returned {t!r} for {a!r} on call "
                           f"{call!r}; expected a finite time >= 0 seconds",
                           remedy="check the timer behind the oracle")
        return float(t)


class _Lattice:
    """The legal points in rank coordinates (axes in sorted order, ranks scaled to [0, 1])."""

    def __init__(self, grid: FamilyGrid) -> None:
        ranks = [{v: r for r, v in enumerate(values)} for values in grid.axes.values()]
        self.sizes = [len(values) for values in grid.axes.values()]
        self.legal = grid.legal
        self.index = {a: i for i, a in enumerate(grid.legal)}
        # rank: [points, axes] integer ranks; u: the same scaled to [0, 1]
        self.rank = np.array([[rank[a[name]] for rank, name in zip(ranks, grid.axes, strict=True)]
                              for a in grid.legal], dtype=np.int64)
        self.u = self.rank / np.maximum(1, np.array(self.sizes) - 1)

    def spread(self, k: int, rng: random.Random, taken: Iterable[Assignment]) -> list[Assignment]:
        """`k` legal points, each in turn the farthest from those chosen before (and from the points
        `taken`); ties go to a seeded shuffle."""
        order = list(range(len(self.legal)))
        rng.shuffle(order)
        u = self.u[order]
        gap = np.full(len(u), np.inf)
        for a in taken:
            gap = np.minimum(gap, ((u - self.u[self.index[a]]) ** 2).sum(1))
        chosen: list[Assignment] = []
        while len(chosen) < k and gap.max() > 0:
            i = int(np.argmax(gap))
            chosen.append(self.legal[order[i]])
            gap = np.minimum(gap, ((u - u[i]) ** 2).sum(1))
        return chosen

    def within(self, a: Assignment, radius: int) -> np.ndarray:
        """Mask of the legal points at most `radius` steps from `a` on every axis, a step being one rank on an
        axis of up to LOCAL_SCALE levels and size / LOCAL_SCALE ranks on a longer one (so a local move
        crosses a long axis, such as a split stride on a 256 step, in a few steps, not dozens)."""
        steps = np.maximum(1, np.array(self.sizes) // LOCAL_SCALE)
        return (np.abs(self.rank - self.rank[self.index[a]]) <= radius * steps).all(1)


class _Surface:
    """The response surface that ranks unmeasured points: log cost as additive per-axis level effects plus
    bilinear interactions of the axes' scaled ranks, fitted by weighted least squares. Invariants: second
    differences of each axis' effects are penalised (unmeasured levels interpolate and extrapolate linearly;
    categorical axes still get a free effect per level); good points weigh more (exp(-(log c - log best) /
    WEIGHT_SCALE)), so the surface is accurate where the optimum is."""

    def __init__(self, lattice: _Lattice) -> None:
        n, sizes = len(lattice.sizes), lattice.sizes
        offsets = np.cumsum([0, *sizes])
        levels = np.zeros((len(lattice.legal), offsets[-1]))
        for i in range(n):
            levels[np.arange(len(levels)), offsets[i] + lattice.rank[:, i]] = 1.0
        cross = [lattice.u[:, i] * lattice.u[:, j] for i, j in itertools.combinations(range(n), 2)]
        # x: [points, levels + interactions]
        self.x = np.column_stack([levels, *cross])
        width = self.x.shape[1]
        rows = []
        for i in range(n):
            for r in range(offsets[i] + 1, offsets[i + 1] - 1):
                rows.append(np.zeros(width))
                rows[-1][r - 1 : r + 2] = (1.0, -2.0, 1.0)
        # the penalty rows, then a tiny ridge that fixes the levels' common offsets
        self.prior = np.vstack([math.sqrt(SMOOTHING) * np.array(rows).reshape(-1, width),
                                math.sqrt(RIDGE) * np.eye(width)])
        self.index = lattice.index

    def predict(self, meter: _Meter) -> np.ndarray:
        """Predicted log cost of every legal point: finite for the unmeasured ones, +inf for the measured
        ones (so an argmin always proposes a new point while one is left)."""
        measured = [self.index[a] for a in meter.times]
        y = np.log(np.maximum(list(meter.estimates.values()), 1e-300))
        w = np.exp(-(y - y.min()) / WEIGHT_SCALE)
        lhs = np.vstack([self.x[measured] * w[:, None], self.prior])
        rhs = np.concatenate([y * w, np.zeros(len(self.prior))])
        predicted = self.x @ np.linalg.lstsq(lhs, rhs, rcond=None)[0]
        largest = float(np.finfo(float).max)
        predicted = np.nan_to_num(predicted, nan=largest, posinf=largest)
        predicted[measured] = np.inf
        return predicted


SAMPLE_SHARE = 4  # a quarter of the budget goes to the space-filling sample
SMOOTHING = 1.0  # weight of the second-difference penalty
RIDGE = 1e-6
WEIGHT_SCALE = 1.0  # in log cost: a point e times dearer than the best weighs 1/e
LOCAL_RADII = (1, 2, 3)
LOCAL_SCALE = 16  # axes longer than this take local steps of size // LOCAL_SCALE ranks


def _budgeted(meter: _Meter, lattice: _Lattice, rng: random.Random,
              anchors: Iterable[Assignment] = ()) -> None:
    """Spend the budget (see the module docstring); returns when it is spent or the grid is measured."""
    for a in anchors:
        meter.cost(a, meter.best[1])
    for a in lattice.spread(max(1, meter.limit // SAMPLE_SHARE), rng, list(meter.times)):
        meter.cost(a, meter.best[1])
    surface = _Surface(lattice)
    while len(meter.times) < len(lattice.legal):
        before = meter.best[0]
        # global step: the best predicted point anywhere
        predicted = surface.predict(meter)
        i = int(np.argmin(predicted))
        meter.cost(lattice.legal[i], meter.best[1])
        predicted[i] = np.inf
        # local step: the best predicted point near the best measured one (the fit is reused)
        for radius in LOCAL_RADII:
            near = np.where(lattice.within(meter.best[0], radius), predicted, np.inf)
            if np.isfinite(near.min()):
                meter.cost(lattice.legal[int(np.argmin(near))], meter.best[1])
                break
        if meter.best[0] != before:
            _line_search(meter, lattice, before)


def _line_search(meter: _Meter, lattice: _Lattice, before: Assignment) -> None:
    """Go on along the move that just improved the best point (from `before`, in ranks): each move twice as
    long as the last while the moves improve on the best; once one does not (or leaves the legal points, or
    lands on a measured one), the move's own length, then half as long after each move that does not
    improve, until a move is shorter than one rank. This finds the valley of a long axis, such as a split
    stride, in a few measurements where the surface's additive fit misplaces it (recorded H200 costs:
    benchmarks/replay_tune.py)."""
    step = lattice.rank[lattice.index[meter.best[0]]] - lattice.rank[lattice.index[before]]
    expanding = True
    while step.any():
        trial = 2 * step if expanding else step
        start = meter.best[0]
        hit = np.flatnonzero((lattice.rank == lattice.rank[lattice.index[start]] + trial).all(1))
        if len(hit) and lattice.legal[hit[0]] not in meter.times:
            meter.cost(lattice.legal[hit[0]], meter.best[1])
        if meter.best[0] != start:
            step = trial
        elif expanding:  # the doubled move failed: the move's own length next, then halves
            expanding = False
        else:
            step = np.trunc(step / 2).astype(np.int64)
