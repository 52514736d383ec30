"""Value-range facts about runtime nodes: closed intervals over the assumed input domains.

Sound over-approximations only: an interval may be wider than the values a node really takes, never
narrower. `None` bounds mean unbounded. Booleans are the interval [0, 1] (or a point).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from detent_audit.selection.ir import Node, Op

INF = math.inf


@dataclass(frozen=True)
class Interval:
    lo: float
    hi: float

    @property
    def is_point(self) -> bool:
        return self.lo == self.hi

    def __contains__(self, x: float) -> bool:
        return self.lo <= x <= self.hi


TOP = Interval(-INF, INF)
BOOL = Interval(0, 1)


def _num(v: Any) -> float | None:
    if isinstance(v, bool):
        return int(v)
    if isinstance(v, (int, float)):
        return v
    return None


def _span(values: Sequence[float]) -> Interval:
    vals = [v for v in values if not (isinstance(v, float) and math.isnan(v))]
    if len(vals) != len(values):
        return TOP
    return Interval(min(vals), max(vals))


def _span_of_numbers(values: Sequence[Any]) -> Interval:
    """The span of `values` when every one is a number, else TOP."""
    nums = [n for n in map(_num, values) if n is not None]
    return _span(nums) if len(nums) == len(values) else TOP


def _mul(a: Interval, b: Interval) -> Interval:
    prods: list[float] = []
    for x in (a.lo, a.hi):
        for y in (b.lo, b.hi):
            if (x == 0 and math.isinf(y)) or (y == 0 and math.isinf(x)):
                prods.append(0)
            else:
                prods.append(x * y)
    return _span(prods)


def _floordiv(a: Interval, b: Interval) -> Interval:
    if b.lo <= 0 <= b.hi:
        return TOP
    cands: list[float] = []
    for x in (a.lo, a.hi):
        for y in (b.lo, b.hi):
            q = x / y
            cands.append(math.floor(q) if not math.isinf(q) else q)
    return _span(cands)


def _truediv(a: Interval, b: Interval) -> Interval:
    if b.lo <= 0 <= b.hi:
        return TOP
    return _span([x / y for x in (a.lo, a.hi) for y in (b.lo, b.hi)])


def interval_of(node: Node, env: dict[int, Interval], domains: dict[str, Interval]) -> Interval:
    """The interval of `node` given its arguments' intervals in `env` and the input domains."""
    op, arg = node.op, node.arg
    if op is Op.CONST:
        v = _num(arg)
        return Interval(v, v) if v is not None else TOP
    if op is Op.INPUT:
        return domains.get(arg[0], TOP)
    if op is Op.KNOB:
        return _span_of_numbers(arg[1])
    src = [env.get(s.id, TOP) for s in node.src]
    if op is Op.UNARY:
        (a,) = src
        if arg == "-":
            return Interval(-a.hi, -a.lo)
        if arg == "+":
            return a
        if a.lo > 0 or a.hi < 0:
            return Interval(0, 0)  # `not x` of a value that is never 0
        return BOOL if not a.is_point else Interval(int(not a.lo), int(not a.lo))
    if op is Op.BINARY:
        a, b = src
        if arg == "+":
            return Interval(a.lo + b.lo, a.hi + b.hi)
        if arg == "-":
            return Interval(a.lo - b.hi, a.hi - b.lo)
        if arg == "*":
            return _mul(a, b)
        if arg == "//":
            return _floordiv(a, b)
        if arg == "/":
            return _truediv(a, b)
        if arg == "%" and b.lo > 0 and a.lo >= 0:
            if a.hi < b.lo:
                return a  # 0 <= a < b: a % b is a
            return Interval(0, min(a.hi, b.hi - 1) if b.hi != INF else a.hi)
        return TOP
    if op is Op.COMPARE:
        return _compare(arg, *src)
    if op in (Op.AND, Op.OR):  # Python's `and`/`or` return one of their operands
        return _span([src[0].lo, src[0].hi, src[1].lo, src[1].hi])
    if op is Op.SELECT:
        c, t, f = src
        if c.is_point:
            return t if c.lo else f
        return Interval(min(t.lo, f.lo), max(t.hi, f.hi))
    if op is Op.CALL:
        return _call(arg, node, src)
    return TOP


def _compare(op: str, a: Interval, b: Interval) -> Interval:
    true, false = Interval(1, 1), Interval(0, 0)
    if op == "<":
        return true if a.hi < b.lo else false if a.lo >= b.hi else BOOL
    if op == "<=":
        return true if a.hi <= b.lo else false if a.lo > b.hi else BOOL
    if op == ">":
        return true if a.lo > b.hi else false if a.hi <= b.lo else BOOL
    if op == ">=":
        return true if a.lo >= b.hi else false if a.hi < b.lo else BOOL
    if op == "==":
        if a.is_point and b.is_point and a.lo == b.lo:
            return true
        return false if a.hi < b.lo or b.hi < a.lo else BOOL
    if op == "!=":
        if a.is_point and b.is_point and a.lo == b.lo:
            return false
        return true if a.hi < b.lo or b.hi < a.lo else BOOL
    return BOOL


def _call(name: str, node: Node, src: list[Interval]) -> Interval:
    if name == "min":
        return Interval(min(s.lo for s in src), min(s.hi for s in src))
    if name == "max":
        return Interval(max(s.lo for s in src), max(s.hi for s in src))
    if name == "abs":
        (a,) = src
        if a.lo >= 0:
            return a
        if a.hi <= 0:
            return Interval(-a.hi, -a.lo)
        return Interval(0, max(-a.lo, a.hi))
    if name in ("cdiv", "round_up"):
        a, b = src
        if b.lo <= 0:
            return TOP
        q = Interval(-_floordiv(Interval(-a.hi, -a.lo), b).hi, -_floordiv(Interval(-a.hi, -a.lo), b).lo)
        return q if name == "cdiv" else _mul(q, b)
    if name == "clamp":
        x, lo, hi = src
        inner = Interval(max(x.lo, lo.lo), max(x.hi, lo.hi))
        return Interval(min(inner.lo, hi.lo), min(inner.hi, hi.hi))
    if name in ("ceil", "int", "floor"):
        (a,) = src
        f = math.ceil if name == "ceil" else math.floor if name == "floor" else math.trunc
        return Interval(*(f(x) if not math.isinf(x) else x for x in (a.lo, a.hi)))
    if name == "float":
        return src[0]
    if name == "bool":
        (a,) = src
        if a.lo > 0 or a.hi < 0:
            return Interval(1, 1)
        return Interval(0, 0) if a == Interval(0, 0) else BOOL
    if name == "next_pow2":
        (a,) = src
        low = 1 if a.lo <= 1 else 1 << (math.ceil(a.lo) - 1).bit_length()
        high = INF if math.isinf(a.hi) else (1 if a.hi <= 1 else 1 << (math.ceil(a.hi) - 1).bit_length())
        return Interval(low, high)
    if name in ("getitem", "nearest"):
        values = node.src[0].arg
        values = [v for _, v in values] if name == "getitem" and _is_table(values) else list(values)
        return _span_of_numbers(values) if values else TOP
    return TOP


def _is_table(values: Any) -> bool:
    return type(values).__name__ == "Table"
