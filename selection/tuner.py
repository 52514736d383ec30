"""Tuner search core: the per-family optimum of a legal grid on a recorded workload (pure, engine-free).

A family's grid is its pins x the knobs only that family reads; `legal` lists the assignments VRA allows.
The cost of an assignment `a` on a workload W = {(call, count)} is `fsum(count * oracle(a, call))`, so
families are tuned independently (`tune`) and the optimum of the sum is the sum of the optima.

`search(mode="exhaustive")` measures every legal assignment. `search(mode="budgeted")` measures at most
`budget(len(legal), fraction)` distinct assignments (an assignment counts as measured once the oracle has
timed it on any call; results are cached, so re-visiting one is free). The budgeted method:

1. measure the default on every call; order the calls heaviest first (count x the default's time);
2. measure a seeded space-filling sample (greedy max-min distance on axis ranks) of legal points;
3. descend from the best points first: coordinate descent along each axis (the nearest legal point in
   each direction, repeated while it improves), then, at a coordinate minimum, the diagonal moves that
   change two axes by one rank each (they cross the ridges a roofline `max(compute, memory)` makes);
4. while budget is left, kick the best point found (a seeded jump of one or two ranks on a few axes) and
   descend again (iterated local search).

Every comparison is "is the candidate cheaper than `bound`?": a candidate is timed on the calls heaviest
first and abandoned as soon as its partial sum exceeds the bound (times are non-negative, so this loses
nothing: the best assignment is always measured on every call and its cost is exact). This is the lossless
form of measuring candidates on the heaviest calls first; it saves oracle calls, not budget.

The search proposes only legal assignments and is deterministic for a given seed.
"""

from __future__ import annotations

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
            raise BadInput(f"assignment {self._map!r} has an unhashable value", remedy="use numbers or strings") from err

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
    """A family's legal grid. Invariants: axes sorted by name, each a non-empty tuple of distinct values in a
    meaningful order (ascending numbers); every legal assignment sets exactly the axes to values of theirs,
    without repeats; `default` is legal. Mappings given for `legal`/`default` become `Assignment`s."""

    family: str
    axes: dict[str, tuple[Hashable, ...]]
    legal: tuple[Assignment, ...]
    default: Assignment

    def __post_init__(self) -> None:
        bad = f"family {self.family!r}: "
        if not self.axes:
            raise BadInput(bad + "the grid has no axes", remedy="give each pin and knob of the family an axis")
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
        object.__setattr__(self, "axes", axes)
        object.__setattr__(self, "legal", legal)
        object.__setattr__(self, "default", default)

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
        calls = tuple(tuple(pair) for pair in self.calls)
        if not calls:
            raise BadInput("the workload is empty", remedy="record a workload with at least one call")
        for pair in calls:
            if len(pair) != 2:
                raise BadInput(f"workload entry {pair!r} is not a (call, count) pair")
            call, count = pair
            if isinstance(count, bool) or not isinstance(count, numbers.Integral) or count <= 0:
                raise BadInput(f"call {call!r} has count {count!r}; counts must be positive integers")
        try:
            distinct = len({call for call, _ in calls})
        except TypeError as err:
            raise BadInput("a workload call is unhashable", remedy="describe calls by tuples of values") from err
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
           progress: Progress | None = None) -> TuneResult:
    """The cheapest legal assignment of `grid` for `workload` under `oracle` (seconds per call).

    Exhaustive mode measures every legal assignment on every call and returns the true optimum (ties go to
    the first in `grid.legal`). Budgeted mode measures at most `budget(len(grid.legal), budget_fraction)`
    distinct assignments (see the module docstring). `progress(measured, limit)` is called after each new
    assignment. Raises `BadInput` when the oracle returns anything but a finite time >= 0.
    """
    if mode not in ("budgeted", "exhaustive"):
        raise BadInput(f"unknown search mode {mode!r}", remedy="use 'budgeted' or 'exhaustive'")
    size = len(grid.legal)
    limit = size if mode == "exhaustive" else budget(size, budget_fraction)
    meter = _Meter(grid, workload, oracle, limit, progress)
    try:
        meter.cost(grid.default)
        meter.order_by(grid.default)
        if limit >= size:
            for a in grid.legal:
                meter.cost(a)
        else:
            _budgeted(meter, _Lattice(grid), random.Random(seed))
    except _BudgetSpent:
        pass
    best, cost = meter.best
    return TuneResult(grid.family, best, cost, len(meter.times), size, mode, meter.oracle_calls, meter.trace())


def tune(grids: Mapping[str, FamilyGrid], workloads: Mapping[str, Workload],
         oracle: Callable[[str, Assignment, Call], float], **options: Any) -> dict[str, TuneResult]:
    """`search` each family independently (cost is additive over families), in sorted family order;
    `options` go to `search`. Every family with a workload must have a grid; families without a workload
    are skipped (they were never called)."""
    missing = sorted(set(workloads) - set(grids))
    if missing:
        raise BadInput(f"workloads name families without a grid: {missing}", remedy="solve those families first")
    return {family: search(grids[family], workloads[family],
                           lambda a, call, family=family: oracle(family, a, call), **options)
            for family in sorted(workloads)}


class _BudgetSpent(Exception):
    """The budget of distinct assignments is spent: the search stops with the best point so far."""


class _Meter:
    """Cached, budgeted, bounded measurement of workload costs; keeps the best complete measurement."""

    def __init__(self, grid: FamilyGrid, workload: Workload, oracle: Oracle, limit: int,
                 progress: Progress | None) -> None:
        self.family, self.calls, self.oracle = grid.family, workload.calls, oracle
        self.limit, self.progress = limit, progress
        self.order = list(range(len(self.calls)))
        # assignment -> count x time per call, in `order`; insertion order is measurement order
        self.times: dict[Assignment, list[float]] = {}
        self.oracle_calls = 0
        self.best: tuple[Assignment, float] = (grid.default, math.inf)
        self._rank = {a: i for i, a in enumerate(grid.legal)}

    def cost(self, a: Assignment, bound: float = math.inf) -> float:
        """`a`'s exact cost, or `math.inf` once its partial sum exceeds `bound` (so it is not below it)."""
        values = self.times.get(a)
        if values is None:
            if len(self.times) >= self.limit:
                raise _BudgetSpent
            values = self.times[a] = []
            if self.progress is not None:
                self.progress(len(self.times), self.limit)
        running = sum(values)
        for i in self.order[len(values):]:
            if running > bound:
                return math.inf
            call, count = self.calls[i]
            values.append(count * self._time(a, call))
            running += values[-1]
        cost = math.fsum(values)
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
        self.default_share = [math.fsum(self.times[a][:k]) / total if total > 0 else 1.0
                              for k in range(len(values) + 1)]

    def lower_bound(self, a: Assignment) -> float:
        return math.fsum(self.times[a])

    def estimate(self, a: Assignment) -> float:
        """`a`'s cost, extrapolated from the calls measured so far by the default's share of them."""
        values = self.times[a]
        if len(values) == len(self.order):
            return math.fsum(values)
        share = self.default_share[len(values)]
        return math.fsum(values) / share if share > 0 else math.inf

    def trace(self) -> tuple[Measurement, ...]:
        n = len(self.calls)
        return tuple(Measurement(a, math.fsum(v), len(v) == n) for a, v in self.times.items())

    def _time(self, a: Assignment, call: Call) -> float:
        t = self.oracle(a, call)
        self.oracle_calls += 1
        if isinstance(t, bool) or not isinstance(t, numbers.Real) or not (math.isfinite(t) and t >= 0):
            raise BadInput(f"family {self.family!r}: the cost oracle returned {t!r} for {a!r} on call {call!r}; "
                           "expected a finite time >= 0 seconds", remedy="check the timer behind the oracle")
        return float(t)


class _Lattice:
    """The legal points as rank coordinates (axes in sorted order) for neighbourhood moves."""

    def __init__(self, grid: FamilyGrid) -> None:
        ranks = [{v: r for r, v in enumerate(values)} for values in grid.axes.values()]
        self.sizes = [len(values) for values in grid.axes.values()]
        self.point = {a: tuple(rank[a[name]] for rank, name in zip(ranks, grid.axes, strict=True))
                      for a in grid.legal}
        self.at = {p: a for a, p in self.point.items()}
        self.legal = grid.legal

    def step(self, a: Assignment, axis: int, direction: int) -> Assignment | None:
        """The nearest legal point from `a` along `axis` in `direction` (+1/-1), or None."""
        p = list(self.point[a])
        for r in range(p[axis] + direction, self.sizes[axis] if direction > 0 else -1, direction):
            p[axis] = r
            b = self.at.get(tuple(p))
            if b is not None:
                return b
        return None

    def shift(self, a: Assignment, offsets: Mapping[int, int]) -> Assignment | None:
        """`a` moved by `offsets` (axis -> ranks), if that point is legal."""
        p = list(self.point[a])
        for axis, offset in offsets.items():
            p[axis] += offset
        return self.at.get(tuple(p))

    def pairs(self, a: Assignment) -> Iterator[Assignment]:
        """Moves of two axes: one rank on axis j, then the nearest legal point along axis i (i != j); this
        covers the diagonals and follows a legality boundary (a shared-memory limit) around its corner."""
        p = self.point[a]
        for j, i in itertools.permutations(range(len(p)), 2):
            for dj, di in ((1, 1), (1, -1), (-1, 1), (-1, -1)):
                if not 0 <= p[j] + dj < self.sizes[j]:
                    continue
                q = list(p)
                q[j] += dj
                for r in range(p[i] + di, self.sizes[i] if di > 0 else -1, di):
                    q[i] = r
                    b = self.at.get(tuple(q))
                    if b is not None:
                        yield b
                        break

    def spread(self, k: int, rng: random.Random, taken: list[Assignment]) -> list[Assignment]:
        """`k` legal points chosen greedily to maximise the distance to the nearest point already taken."""
        def coords(a: Assignment) -> list[float]:
            return [r / max(1, s - 1) for r, s in zip(self.point[a], self.sizes, strict=True)]

        pool = list(self.legal)
        rng.shuffle(pool)
        xs = [coords(a) for a in pool]
        gap = [math.inf] * len(pool)
        for c in map(coords, taken):
            gap = [min(g, _dist2(x, c)) for g, x in zip(gap, xs, strict=True)]
        chosen: list[Assignment] = []
        for _ in range(min(k, len(pool))):
            i = max(range(len(pool)), key=gap.__getitem__)
            if gap[i] == 0.0:
                break
            chosen.append(pool[i])
            gap = [min(g, _dist2(x, xs[i])) for g, x in zip(gap, xs, strict=True)]
        return chosen

    def kick(self, a: Assignment, rng: random.Random) -> Assignment | None:
        """A seeded jump from `a`: one or two ranks on two or three axes, to a legal point (or None)."""
        n = len(self.sizes)
        for _ in range(16):
            axes = rng.sample(range(n), min(n, rng.choice((2, 3))))
            b = self.shift(a, {axis: rng.choice((-2, -1, 1, 2)) for axis in axes})
            if b is not None:
                return b
        return None


def _dist2(x: list[float], y: list[float]) -> float:
    return sum((u - v) ** 2 for u, v in zip(x, y, strict=True))


def _descend(meter: _Meter, lattice: _Lattice, a: Assignment, cost: float) -> tuple[Assignment, float]:
    """Coordinate descent from `a`, then pair moves at a coordinate minimum; returns the local minimum."""
    n = len(lattice.sizes)
    while True:
        moved = False
        for axis in range(n):
            for direction in (1, -1):
                while (b := lattice.step(a, axis, direction)) is not None and (c := meter.cost(b, cost)) < cost:
                    a, cost, moved = b, c, True
        if moved:
            continue
        for b in (lattice.pairs(a) if PAIRS else ()):
            if (c := meter.cost(b, cost)) < cost:
                a, cost, moved = b, c, True
                break
        if not moved or not PAIRS:
            return a, cost


class _Surrogate:
    """A quadratic response surface in the axes' normalised ranks, fitted to log cost by ridge regression;
    it ranks the unmeasured legal points so the search can try the most promising next."""

    def __init__(self, lattice: _Lattice) -> None:
        u = np.array([[r / max(1, s - 1) for r, s in zip(lattice.point[a], lattice.sizes, strict=True)]
                      for a in lattice.legal])
        n = u.shape[1]
        cross = [u[:, i] * u[:, j] for i, j in itertools.combinations(range(n), 2)]
        # x: [points, 1 + 2n + n(n-1)/2]
        self.x = np.column_stack([np.ones(len(u)), u, u * u, *cross])
        self.index = {a: i for i, a in enumerate(lattice.legal)}

    def ranked(self, meter: _Meter) -> list[int]:
        measured = [self.index[a] for a in meter.times]
        y = np.log(np.array([meter.estimate(a) for a in meter.times]) + 1e-30)
        x = self.x[measured]
        f = x.shape[1]
        if TAU:
            w = np.exp(-(y - y.min()) / TAU)
            x = x * w[:, None]
            y = y * w
        beta = np.linalg.solve(x.T @ x + RIDGE * len(measured) * np.eye(f), x.T @ y)
        pred = self.x @ beta
        pred[measured] = np.inf
        order = np.argsort(pred, kind="stable")
        return [int(i) for i in order[: len(order) - len(measured)]]


class _Additive:
    """Additive per-level effects (second differences penalised) + bilinear interactions, on log cost."""

    def __init__(self, lattice: _Lattice) -> None:
        pts = np.array([lattice.point[a] for a in lattice.legal])
        sizes = lattice.sizes
        n = len(sizes)
        offs = np.cumsum([0, *sizes])
        cols = offs[-1]
        u = pts / np.maximum(1, np.array(sizes) - 1)
        onehot = np.zeros((len(pts), cols))
        for i in range(n):
            onehot[np.arange(len(pts)), offs[i] + pts[:, i]] = 1.0
        cross = [u[:, i] * u[:, j] for i, j in itertools.combinations(range(n), 2)]
        self.x = np.column_stack([onehot, *cross]) if cross else onehot
        pen = []
        for i in range(n):
            for r in range(1, sizes[i] - 1):
                row = np.zeros(self.x.shape[1])
                row[offs[i] + r - 1], row[offs[i] + r], row[offs[i] + r + 1] = 1.0, -2.0, 1.0
                pen.append(row)
        self.pen = np.array(pen).reshape(-1, self.x.shape[1])
        self.index = {a: i for i, a in enumerate(lattice.legal)}

    def ranked(self, meter):
        measured = [self.index[a] for a in meter.times]
        y = np.log(np.array([meter.estimate(a) for a in meter.times]) + 1e-30)
        x = self.x[measured]
        if TAU:
            w = np.exp(-(y - y.min()) / TAU)
        else:
            w = np.ones_like(y)
        f = x.shape[1]
        a = np.vstack([x * w[:, None], math.sqrt(LAMBDA) * self.pen, math.sqrt(RIDGE) * np.eye(f)])
        b = np.concatenate([y * w, np.zeros(len(self.pen) + f)])
        beta = np.linalg.lstsq(a, b, rcond=None)[0]
        pred = self.x @ beta
        pred[measured] = np.inf
        order = np.argsort(pred, kind="stable")
        return [int(i) for i in order[: len(order) - len(measured)]]


LAMBDA = 1.0
SUR = "quad"
SAMPLE_SHARE = 5
FIRST_DESCENT = True
LOCAL = False
PURE = False
PAIRS = True  # one measurement in SAMPLE_SHARE goes to the space-filling sample
STALE_ROUNDS = 32
TAU = 0.0
RIDGE = 1e-3
USE_SUR = True
USE_KICK = True  # rounds in a row that measure nothing new end the search


def _budgeted(meter: _Meter, lattice: _Lattice, rng: random.Random) -> None:
    default = meter.best[0]
    sample = lattice.spread(max(1, meter.limit // SAMPLE_SHARE), rng, [default])
    for a in sample:
        meter.cost(a, meter.best[1])
    best_first = sorted([default, *sample], key=lambda a: (meter.lower_bound(a), meter._rank[a]))
    if FIRST_DESCENT:
        _descend(meter, lattice, best_first[0], meter.cost(best_first[0]))
    surrogate = _Surrogate(lattice) if SUR == "quad" else _Additive(lattice)
    stale = 0
    while stale < STALE_ROUNDS and len(meter.times) < len(lattice.legal):
        before = len(meter.times)
        if USE_SUR:
          ranked = surrogate.ranked(meter)
          b = lattice.legal[ranked[0]]
          if meter.cost(b, meter.best[1]) < math.inf and not PURE:
            _descend(meter, lattice, b, meter.cost(b))
        if LOCAL and len(meter.times) < meter.limit:
            ranked = surrogate.ranked(meter)
            centre = lattice.point[meter.best[0]]
            for radius in (1, 2, 3):
                near = [i for i in ranked if max(abs(u - v) for u, v in zip(lattice.point[lattice.legal[i]], centre)) <= radius]
                if near:
                    meter.cost(lattice.legal[near[0]], meter.best[1])
                    break
        b = lattice.kick(meter.best[0], rng)
        if USE_KICK and b is not None and meter.cost(b, meter.best[1] * 1.05) < math.inf:
            _descend(meter, lattice, b, meter.cost(b))
        stale = 0 if len(meter.times) > before else stale + 1
