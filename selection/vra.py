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
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from detent_audit.selection.codegen import builtins_namespace, compile_function, emit
from detent_audit.selection.errors import SelIRError
from detent_audit.selection.intervals import Interval
from detent_audit.selection.ir import Node
from detent_audit.selection.partial_eval import IRProgram

EXHAUSTIVE_POINTS = 4096
SAMPLED_POINTS = 512
MAX_ASSIGNMENTS = 200_000
VRA_SEED = 20261129


@dataclass(frozen=True)
class PinInfo:
    name: str
    line: int
    node_id: int
    candidates: tuple
    legal_values: tuple


@dataclass(frozen=True)
class KnobInfo:
    name: str
    choices: tuple
    default: Any
    legal_values: tuple


@dataclass(frozen=True)
class VraResult:
    pins: tuple[PinInfo, ...]
    knobs: tuple[KnobInfo, ...]
    candidate_count: int
    legal: tuple[tuple, ...]      # legal assignments: pin values (program order) then knob values (by name)
    default: tuple | None         # the default assignment (None when nothing is legal)
    points_tried: int
    exhaustive: bool

    @property
    def legal_count(self) -> int:
        return len(self.legal)

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
    unpinned = emit([*pins, *(c.cond for c in checks)], input_names={n: f"i_{n}" for n in inputs},
                    knob_names={k: f"k_{k}" for k in knob_names}, pin_names={})
    params = [f"i_{n}" for n in inputs] + [f"k_{k}" for k in knob_names]
    body = "\n    ".join(unpinned.lines) or "pass"
    pin_vals = ", ".join(unpinned.names[p.id] for p in pins)
    chk_vals = " and ".join(f"bool({unpinned.names[c.cond.id]})" for c in checks) or "True"
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
    candidates = [tuple(sorted(s, key=_sort_key)) for s in cands]
    pin_index = {p.id: i for i, p in enumerate(pins)}
    candidate_count = math.prod(len(c) for c in candidates) * len(knob_combos)
    if any(not c for c in candidates):
        legal: list[tuple] = []
    elif candidate_count > MAX_ASSIGNMENTS:
        worst = max(range(len(pins)), key=lambda i: len(candidates[i]))
        raise SelIRError(f"{prog.name}: {candidate_count} candidate assignments exceed the analysis limit "
                         f"({MAX_ASSIGNMENTS}); pin `{pin_names[worst]}` alone takes "
                         f"{len(candidates[worst])} values",
                         remedy="pin a value with fewer distinct values (a bucket or a tile, not a count)")
    else:
        tables = [_check_table(prog, c, pins, pin_index, candidates, inputs, knob_names, knob_choices,
                               points, ns) for c in checks]
        legal = []
        for pv in itertools.product(*candidates):
            for kv in knob_combos:
                if all(_table_ok(t, pv, kv) for t in tables):
                    legal.append((*pv, *kv))
    default = _default(fn, domains, inputs, prog, knob_names, legal, len(pins))
    legal_sets = [sorted({a[i] for a in legal}, key=_sort_key) for i in range(len(pins) + len(knob_names))]
    pin_infos = tuple(PinInfo(pin_names[i], p.line, p.id, candidates[i], tuple(legal_sets[i]))
                      for i, p in enumerate(pins))
    knob_infos = tuple(KnobInfo(k, tuple(prog.knobs[k].arg[1]), prog.knobs[k].arg[2],
                                tuple(legal_sets[len(pins) + j])) for j, k in enumerate(knob_names))
    return VraResult(pin_infos, knob_infos, candidate_count, tuple(legal), default, len(points), exhaustive)


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
    pin_pos: tuple[int, ...]
    knob_pos: tuple[int, ...]
    ok: dict[tuple, bool]


def _check_table(prog: IRProgram, check: Any, pins: list[Node], pin_index: dict[int, int],
                 candidates: list[tuple], inputs: list[str], knob_names: list[str],
                 knob_choices: list[tuple], points: list[tuple], ns: dict) -> _Table:
    pin_names = {p.id: f"p_{pin_index[p.id]}" for p in pins}
    em = emit([check.cond], input_names={n: f"i_{n}" for n in inputs},
              knob_names={k: f"k_{k}" for k in knob_names}, pin_names=pin_names)
    in_pos = [i for i, n in enumerate(inputs) if n in em.inputs_read]
    knob_pos = tuple(j for j, k in enumerate(knob_names) if k in em.knobs_read)
    pin_pos = tuple(sorted(pin_index[p] for p in em.pins_read))
    params = ([f"i_{inputs[i]}" for i in in_pos] + [f"k_{knob_names[j]}" for j in knob_pos]
              + [f"p_{i}" for i in pin_pos])
    body = "\n    ".join(em.lines) or "pass"
    src = f"def _chk({', '.join(params)}):\n    {body}\n    return bool({em.names[check.cond.id]})\n"
    fn = compile_function(src, "_chk", {**ns, **em.consts}, f"<check {prog.name}:{check.line}>")
    projected = sorted({tuple(pt[i] for i in in_pos) for pt in points})
    ok: dict[tuple, bool] = {}
    for kv in itertools.product(*(knob_choices[j] for j in knob_pos)):
        for pv in itertools.product(*(candidates[i] for i in pin_pos)):
            ok[(kv, pv)] = all(_call(fn, (*pt, *kv, *pv), prog, [inputs[i] for i in in_pos], [])
                               for pt in projected)
    return _Table(pin_pos, knob_pos, ok)


def _table_ok(t: _Table, pv: tuple, kv: tuple) -> bool:
    return t.ok[(tuple(kv[j] for j in t.knob_pos), tuple(pv[i] for i in t.pin_pos))]


def _default(fn: Any, domains: dict[str, Interval], inputs: list[str], prog: IRProgram,
             knob_names: list[str], legal: list[tuple], num_pins: int) -> tuple | None:
    """The assignment a lone smallest request gets from the unpinned program with default knobs, if legal;
    else the first legal assignment with default knobs; else the first legal one."""
    if not legal:
        return None
    knob_defaults = tuple(prog.knobs[k].arg[2] for k in knob_names)
    lowest = tuple(int(domains[n].lo) for n in inputs)
    values, _ = _call(fn, (*lowest, *knob_defaults), prog, inputs, knob_names)
    want = (*values, *knob_defaults)
    legal_set = set(legal)
    if want in legal_set:
        return want
    for a in legal:
        if a[num_pins:] == knob_defaults:
            return a
    return legal[0]
