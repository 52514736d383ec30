"""Value-range analysis of the pins: candidate values and legal assignments.

A pin's candidates are the values it takes in the unpinned program over the runtime domain (for every knob
setting). An assignment of values to pins and knobs is legal when every require/assume holds, with those
values, at every input point tried: all points where the domain is small, otherwise a fixed seeded sample
(uniform, log-uniform and around powers of two) plus the domain's corners and edges.

Legality is checked check by check: each check reads a few inputs, knobs and pins, so it is evaluated on
the distinct projections of the points and over the product of just the values it reads.
"""

from __future__ import annotations

import itertools
import math
import random
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeAlias

from detent_audit.selection.codegen import builtins_namespace, compile_function, emit
from detent_audit.selection.errors import SelIRError
from detent_audit.selection.intervals import Interval
from detent_audit.selection.ir import Node
from detent_audit.selection.pe_values import IRProgram

EXHAUSTIVE_POINTS = 4096
SAMPLED_POINTS = 512
MAX_ASSIGNMENTS = 1_000_000
VRA_SEED = 20261129

Value: TypeAlias = Hashable               # a pin or knob value: int, bool, str (JSON scalars)
AxisValues: TypeAlias = dict[str, Value]  # axis (pin or knob name) -> value


@dataclass(frozen=True, slots=True)
class PinInfo:
    """A pin: the values it takes over the runtime domain (candidates) and those some legal row uses."""

    name: str
    line: int
    node_id: int
    candidates: tuple[Value, ...]
    legal_values: tuple[Value, ...]


@dataclass(frozen=True, slots=True)
class KnobInfo:
    """A knob: its declared choices and default, and the choices some legal row uses."""

    name: str
    choices: tuple[Value, ...]
    default: Value
    legal_values: tuple[Value, ...]

    def as_dict(self) -> dict[str, Any]:
        return {"name": self.name, "choices": list(self.choices), "default": self.default,
                "legal_values": list(self.legal_values)}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> KnobInfo:
        return cls(d["name"], tuple(d["choices"]), d["default"], tuple(d["legal_values"]))


@dataclass(frozen=True, slots=True)
class LegalGroup:
    """Axes (pins and knobs) that some check reads together, and their legal rows. Groups are independent:
    an assignment is legal when its projection on every group is one of that group's rows."""

    axes: tuple[str, ...]
    rows: tuple[tuple[Value, ...], ...]

    def as_dict(self) -> dict[str, Any]:
        return {"axes": list(self.axes), "rows": [list(r) for r in self.rows]}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> LegalGroup:
        return cls(tuple(d["axes"]), tuple(tuple(r) for r in d["rows"]))

    def admits(self, assignment: Mapping[str, Value]) -> bool:
        """The projection of `assignment` on these axes is a row (values of the same types: True is not 1)."""
        row = tuple(assignment[a] for a in self.axes)
        return any(row == r and all(type(x) is type(y) for x, y in zip(row, r)) for r in self.rows)


@dataclass(frozen=True, slots=True)
class VraResult:
    pins: tuple[PinInfo, ...]
    knobs: tuple[KnobInfo, ...]
    candidate_count: int
    groups: tuple[LegalGroup, ...]
    default: AxisValues | None    # None when nothing is legal
    points_tried: int
    exhaustive: bool

    @property
    def legal_count(self) -> int:
        return math.prod(len(g.rows) for g in self.groups) if self.groups else 1

    @property
    def axes(self) -> tuple[str, ...]:
        return tuple(p.name for p in self.pins) + tuple(k.name for k in self.knobs)


def _sort_key(v: Any) -> tuple:
    return (type(v).__name__, v)


def sample_points(domains: dict[str, Interval], names: Sequence[str], seed: int = VRA_SEED
                  ) -> tuple[list[tuple], bool]:
    """Input points (tuples in `names` order) and whether they cover the whole domain."""
    if not names:
        return [()], True
    ranges = [(int(domains[n].lo), int(domains[n].hi)) for n in names]
    size = math.prod(hi - lo + 1 for lo, hi in ranges)
    if size <= EXHAUSTIVE_POINTS:
        return list(itertools.product(*(range(lo, hi + 1) for lo, hi in ranges))), True
    rng = random.Random(seed)
    points: set[tuple] = set()

    def draw(lo: int, hi: int) -> int:
        kind = rng.random()
        if kind < 1 / 3:
            return rng.randint(lo, hi)
        if kind < 2 / 3:
            v = int(round(math.exp(rng.uniform(math.log(max(lo, 1)), math.log(max(hi, 1))))))
        else:
            p = 1 << rng.randint(0, max(0, max(hi, 1).bit_length()))
            v = p + rng.choice((-1, 0, 1))
        return min(max(v, lo), hi)

    edges = [sorted({lo, min(lo + 1, hi), max(hi - 1, lo), hi}) for lo, hi in ranges]
    if len(names) <= 8:
        points.update(itertools.product(*[(lo, hi) for lo, hi in ranges]))
    for i in range(len(names)):
        for e in edges[i]:
            base = [lo for lo, _ in ranges]
            base[i] = e
            points.add(tuple(base))
    while len(points) < SAMPLED_POINTS + 2 ** min(len(names), 8):
        points.add(tuple(draw(lo, hi) for lo, hi in ranges))
    return sorted(points), False


def analyse(prog: IRProgram, pins: list[Node], domains: dict[str, Interval], pin_names: list[str]
            ) -> VraResult:
    """Pass: candidates and legal assignments of `pins` (program order) and the program's knobs."""
    inputs = [i.name for i in prog.inputs]
    missing = [n for n in inputs if n not in domains]
    if missing:
        info = next(i for i in prog.inputs if i.name == missing[0])
        raise prog.source.error(_at(info.node), f"runtime input `{missing[0]}` has no bounds",
                                remedy=f"add assume(lo <= {missing[0]} <= hi, \"...\") with static bounds")
    points, exhaustive = sample_points(domains, inputs)
    knob_names = sorted(prog.knobs)
    knob_choices = [prog.knobs[k].arg[1] for k in knob_names]
    knob_combos = list(itertools.product(*knob_choices))
    ns = builtins_namespace()

    # candidates: the pins' values in the unpinned program wherever all checks hold
    checks = [c for c in prog.checks if isinstance(c.cond, Node)]
    knob_vars = {k: f"k{j}" for j, k in enumerate(knob_names)}  # knob names may hold dots
    unpinned = emit([*pins, *(c.node for c in checks)], input_names={n: f"i_{n}" for n in inputs},
                    knob_names=knob_vars, pin_names={})
    params = [f"i_{n}" for n in inputs] + [knob_vars[k] for k in knob_names]
    body = "\n    ".join(unpinned.lines) or "pass"
    pin_vals = ", ".join(unpinned.names[p.id] for p in pins)
    chk_vals = " and ".join(f"not _failed({unpinned.names[c.node.id]})" for c in checks) or "True"
    src = (f"def _eval({', '.join(params)}):\n    {body}\n    return (({pin_vals}{',' if pins else ''}), "
           f"{chk_vals})\n")
    fn = compile_function(src, "_eval", {**ns, **unpinned.consts}, f"<vra {prog.name}>")
    cands: list[set] = [set() for _ in pins]
    for combo in knob_combos:
        for pt in points:
            values, ok = _call(fn, (*pt, *combo), prog, inputs, knob_names)
            if ok:
                for s, v in zip(cands, values):
                    s.add(v)
    axes = [*pin_names, *knob_names]
    candidates = [tuple(sorted(s, key=_sort_key)) for s in cands] + [tuple(c) for c in knob_choices]
    candidate_count = math.prod(len(c) for c in candidates)
    pin_index = {p.id: i for i, p in enumerate(pins)}
    tables = [_check_table(prog, c, pins, pin_index, candidates, inputs, knob_names, points, ns)
              for c in checks]
    groups = _legal_groups(prog, axes, candidates, tables)
    want = dict(zip(axes, (*_call(fn, (*(int(domains[n].lo) for n in inputs), *(
        prog.knobs[k].arg[2] for k in knob_names)), prog, inputs, knob_names)[0],
        *(prog.knobs[k].arg[2] for k in knob_names))))
    default = _default(groups, want, set(knob_names))
    legal_sets: dict[Any, set[Any]] = {a: set() for a in axes}
    for g in groups:
        for row in g.rows:
            for a, v in zip(g.axes, row):
                legal_sets[a].add(v)
    legal_vals = {a: tuple(sorted(v, key=_sort_key)) for a, v in legal_sets.items()}
    pin_infos = tuple(PinInfo(pin_names[i], p.line, p.id, candidates[i], legal_vals[pin_names[i]])
                      for i, p in enumerate(pins))
    knob_infos = tuple(KnobInfo(k, tuple(prog.knobs[k].arg[1]), prog.knobs[k].arg[2], legal_vals[k])
                       for k in knob_names)
    return VraResult(pin_infos, knob_infos, candidate_count, groups, default, len(points), exhaustive)


def _at(node: Node) -> Any:
    class _Pos:
        lineno, col_offset = node.line, node.col
    return _Pos


def _call(fn: Any, args: tuple, prog: IRProgram, inputs: list[str], knobs: list[str]) -> Any:
    try:
        return fn(*args)
    except (ArithmeticError, LookupError, TypeError, ValueError) as exc:
        shown = ", ".join(f"{n}={v!r}" for n, v in zip([*inputs, *knobs], args))
        raise SelIRError(f"{prog.name}: evaluating the program at ({shown}) raised {exc!r}",
                         remedy="guard the operation in both arms of runtime conditionals "
                                "(e.g. cdiv(a, max(1, b)))") from None


@dataclass(frozen=True)
class _Table:
    axes: tuple[int, ...]          # axis indices (pins first, then knobs) the check reads
    ok: dict[tuple, bool]          # their values -> holds at every point tried


CHECK_BUDGET = 1_000_000  # evaluations per check; beyond it the check's points are subsampled (edges kept)


def _check_table(prog: IRProgram, check: Any, pins: list[Node], pin_index: dict[int, int],
                 candidates: list[tuple], inputs: list[str], knob_names: list[str], points: list[tuple],
                 ns: dict) -> _Table:
    num_pins = len(pins)
    em = emit([check.cond], input_names={n: f"i_{n}" for n in inputs},
              knob_names={k: f"a{num_pins + j}" for j, k in enumerate(knob_names)},
              pin_names={p.id: f"a{pin_index[p.id]}" for p in pins})
    in_pos = [i for i, n in enumerate(inputs) if n in em.inputs_read]
    axes = tuple(sorted([pin_index[p] for p in em.pins_read]
                        + [num_pins + j for j, k in enumerate(knob_names) if k in em.knobs_read]))
    params = [f"i_{inputs[i]}" for i in in_pos] + [f"a{a}" for a in axes]
    body = "\n    ".join(em.lines) or "pass"
    src = f"def _chk({', '.join(params)}):\n    {body}\n    return not _failed({em.names[check.cond.id]})\n"
    fn = compile_function(src, "_chk", {**ns, **em.consts}, f"<check {prog.name}:{check.line}>")
    projected = sorted({tuple(pt[i] for i in in_pos) for pt in points})
    combos = list(itertools.product(*(candidates[a] for a in axes)))
    limit = max(32, CHECK_BUDGET // max(1, len(combos)))
    if len(projected) > limit:  # keep the smallest and largest points, a seeded sample of the rest
        rng = random.Random(VRA_SEED + check.line)
        middle = projected[8:-8]
        projected = projected[:8] + sorted(rng.sample(middle, limit - 16)) + projected[-8:]
    names = [inputs[i] for i in in_pos]
    ok = {combo: all(_call(fn, (*pt, *combo), prog, names, []) for pt in projected) for combo in combos}
    return _Table(axes, ok)


def _legal_groups(prog: IRProgram, axes: list[str], candidates: list[tuple], tables: list[_Table]
                  ) -> tuple[LegalGroup, ...]:
    parent = list(range(len(axes)))

    def find(a: int) -> int:
        while parent[a] != a:
            parent[a] = parent[parent[a]]
            a = parent[a]
        return a

    for t in tables:
        for a in t.axes[1:]:
            parent[find(a)] = find(t.axes[0])
    members: dict[int, list[int]] = {}
    for a in range(len(axes)):
        members.setdefault(find(a), []).append(a)
    groups = []
    for group_axes in sorted(members.values()):
        size = math.prod(len(candidates[a]) for a in group_axes)
        if size > MAX_ASSIGNMENTS:
            worst = max(group_axes, key=lambda a: len(candidates[a]))
            raise SelIRError(f"{prog.name}: {size} candidate assignments of {[axes[a] for a in group_axes]} "
                             f"exceed the analysis limit ({MAX_ASSIGNMENTS}); `{axes[worst]}` alone takes "
                             f"{len(candidates[worst])} values",
                             remedy="pin a value with fewer distinct values (a bucket or a tile, "
                                    "not a count)")
        group_tables = [t for t in tables if t.axes and find(t.axes[0]) == find(group_axes[0])]
        pos = {a: i for i, a in enumerate(group_axes)}
        rows = []
        for row in itertools.product(*(candidates[a] for a in group_axes)):
            if all(t.ok[tuple(row[pos[a]] for a in t.axes)] for t in group_tables):
                rows.append(row)
        groups.append(LegalGroup(tuple(axes[a] for a in group_axes), tuple(rows)))
    if any(not t.axes and not t.ok[()] for t in tables):  # a check no pin or knob can repair
        return tuple(LegalGroup(g.axes, ()) for g in groups) or (LegalGroup((), ()),)
    return tuple(groups)


def _default(groups: tuple[LegalGroup, ...], want: AxisValues, knob_names: set[str]) -> AxisValues | None:
    """Per group: the values a lone smallest request gets from the unpinned program with default knobs, if
    legal; else the legal row with the most knobs at their defaults, then the most pins at those values
    (the first such row)."""
    out: AxisValues = {}
    for g in groups:
        if not g.rows:
            return None
        target = tuple(want[a] for a in g.axes)
        knob_pos = [i for i, a in enumerate(g.axes) if a in knob_names]
        if target in g.rows:
            out.update(zip(g.axes, target))
            continue

        scores = [_default_score(r, target, knob_pos) for r in g.rows]
        out.update(zip(g.axes, g.rows[scores.index(max(scores))]))
    return out


def _default_score(row: tuple, target: tuple, knob_pos: list[int]) -> tuple[int, int]:
    """(knobs at their defaults, pins at the lone request's values): the default prefers more of both."""
    knobs = sum(row[i] == target[i] for i in knob_pos)
    return knobs, sum(row[i] == target[i] for i in range(len(row)) if i not in knob_pos)
