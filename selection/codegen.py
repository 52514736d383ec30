"""Code generation: IR nodes -> straight-line Python.

`emit` turns the nodes the roots read into one assignment each, in program order. Pinned nodes and knobs are
leaves spelled by the caller: parameters while the solver explores them, literal constants in a compiled
selector. Static values that have no literal spelling (tables, non-finite floats) become module constants.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from detent_audit.selection import lang
from detent_audit.selection.ir import Node, Op

_SIMPLE = (int, bool, str, type(None))


@dataclass
class Emitted:
    lines: list[str]
    names: dict[int, str]                       # node id -> expression naming its value
    consts: dict[str, object] = field(default_factory=dict)
    inputs_read: set[str] = field(default_factory=set)
    knobs_read: set[str] = field(default_factory=set)
    pins_read: set[int] = field(default_factory=set)


def literal(value: object, consts: dict[str, object]) -> str:
    """A Python spelling of a static value: a literal when one exists, else a module constant."""
    if isinstance(value, _SIMPLE) or (isinstance(value, float) and math.isfinite(value)):
        return repr(value)
    if isinstance(value, tuple) and type(value) is tuple and all(
            isinstance(v, _SIMPLE) or (isinstance(v, float) and math.isfinite(v)) for v in value):
        return repr(value)
    name = f"_c{len(consts)}"
    consts[name] = value
    return name


class _Poison:
    """The value of an operation that raised (a division by zero in an arm a SELECT does not take).

    Arithmetic and comparisons on it give it back; taking its truth raises, so it can only be *dropped* by a
    SELECT whose condition is defined. A poisoned selection point or check is an evaluation error.
    """

    __slots__ = ()

    def _same(self, *_: object) -> _Poison:
        return self

    __add__ = __radd__ = __sub__ = __rsub__ = __mul__ = __rmul__ = __neg__ = __pos__ = _same
    __truediv__ = __rtruediv__ = __floordiv__ = __rfloordiv__ = __mod__ = __rmod__ = _same
    __pow__ = __rpow__ = __lt__ = __le__ = __gt__ = __ge__ = _same
    __hash__ = object.__hash__

    # object's `==` and `!=` promise a bool; a poisoned comparison gives the poison back instead
    def __eq__(self, other: object) -> Any:
        return self

    def __ne__(self, other: object) -> Any:
        return self

    def __bool__(self) -> bool:
        raise ArithmeticError("a poisoned value has no truth")

    def __repr__(self) -> str:
        return "POISON"


POISON = _Poison()


def _guarded(fn: Callable[..., object]) -> Callable[..., object]:
    def call(*args: object) -> object:
        for a in args:
            if a is POISON:
                return POISON
        try:
            return fn(*args)
        except (ArithmeticError, LookupError, TypeError, ValueError):
            return POISON

    return call


def _select(c: object, t: object, e: object) -> object:
    if c is POISON:
        return POISON
    return t if c else e


def _and(a: object, b: object) -> object:
    if a is POISON:
        return POISON
    return b if a else a


def _or(a: object, b: object) -> object:
    if a is POISON:
        return POISON
    return a if a else b


def _not(a: object) -> object:
    return POISON if a is POISON else not a


def failed(v: object) -> bool:
    """A check that does not hold, or could not be evaluated."""
    return v is POISON or not v


_FALLIBLE = {"/": "_op_div", "//": "_op_floordiv", "%": "_op_mod", "**": "_op_pow"}


def builtins_namespace() -> dict[str, object]:
    """The names generated code reads: guarded builtins and operators, the poison-aware control ops."""
    import operator

    ns: dict[str, object] = {f"_b_{k}": _guarded(v) for k, v in lang.BUILTINS.items()}
    ns.update(_op_div=_guarded(operator.truediv), _op_floordiv=_guarded(operator.floordiv),
              _op_mod=_guarded(operator.mod), _op_pow=_guarded(operator.pow),
              _getitem=_guarded(operator.getitem), _select=_select, _and=_and, _or=_or, _not=_not,
              _failed=failed, _POISON=POISON)
    return ns


def emit(roots: Iterable[Node], *, input_names: dict[str, str], knob_names: dict[str, str],
         pin_names: dict[int, str], consts: dict[str, object] | None = None, prefix: str = "v") -> Emitted:
    """Assignments computing every root; pinned nodes and knobs are read from the given spellings."""
    out = Emitted([], {}, consts if consts is not None else {})
    order: dict[int, Node] = {}
    stack = list(roots)
    while stack:
        node = stack.pop()
        if node.id in order:
            continue
        order[node.id] = node
        if node.id not in pin_names:
            stack.extend(node.src)
    for node_id in sorted(order):
        node = order[node_id]
        if node_id in pin_names:
            out.names[node_id] = pin_names[node_id]
            out.pins_read.add(node_id)
            continue
        expr = _expr(node, out, input_names, knob_names)
        if node.op in (Op.CONST, Op.INPUT, Op.KNOB):
            out.names[node_id] = expr
        else:
            var = f"{prefix}{node_id}"
            out.lines.append(f"{var} = {expr}")
            out.names[node_id] = var
    return out


def _expr(node: Node, out: Emitted, input_names: dict[str, str], knob_names: dict[str, str]) -> str:
    a = [out.names[s.id] for s in node.src]
    op = node.op
    if op is Op.CONST:
        return literal(node.arg, out.consts)
    if op is Op.INPUT:
        out.inputs_read.add(node.arg[0])
        return input_names[node.arg[0]]
    if op is Op.KNOB:
        out.knobs_read.add(node.arg[0])
        return knob_names[node.arg[0]]
    # Every node is evaluated, both arms of a SELECT included; what would raise yields POISON instead,
    # which only an arm the SELECT does not take may hold (Python's lazy `x if c else y`, made eager).
    if op is Op.UNARY:
        return f"_not({a[0]})" if node.arg == "not" else f"({node.arg}{a[0]})"
    if op is Op.BINARY and node.arg in _FALLIBLE:
        return f"{_FALLIBLE[node.arg]}({a[0]}, {a[1]})"
    if op in (Op.BINARY, Op.COMPARE):
        return f"({a[0]} {node.arg} {a[1]})"
    if op is Op.AND:
        return f"_and({a[0]}, {a[1]})"
    if op is Op.OR:
        return f"_or({a[0]}, {a[1]})"
    if op is Op.SELECT:
        return f"_select({a[0]}, {a[1]}, {a[2]})"
    if op is Op.CALL:
        if node.arg == "getitem":
            return f"_getitem({a[0]}, {a[1]})"
        return f"_b_{node.arg}({', '.join(a)})"
    raise AssertionError(f"no code for {node!r}")


def compile_function(source: str, name: str, namespace: dict[str, object],
                     filename: str) -> Callable[..., object]:
    """Compile generated `source` and return the function `name` defined in it."""
    ns = dict(namespace)
    exec(compile(source, filename, "exec"), ns)  # noqa: S102 - our own generated code
    fn = ns[name]
    if not callable(fn):
        raise AssertionError(f"the generated code defines no function {name}")
    return fn
