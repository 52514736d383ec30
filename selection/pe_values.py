"""Values of partial evaluation: static values, runtime nodes, records under construction, the IRProgram.

A value during partial evaluation is either a static Python value (facts, literals, tables, tuples of
values), a `Node` (a runtime value), a `RecordVal` (a @record whose fields may be runtime values), or one of
the callables a program may name (`Helper`, `Builtin`). `IRProgram` is what the pass produces.
"""

from __future__ import annotations

import ast
import dataclasses
import operator
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from detent_audit.selection.frontend import Source
from detent_audit.selection.ir import Builder, Node


class _Undef:
    def __repr__(self) -> str:
        return "UNDEF"


UNDEF = _Undef()
SCALARS = (int, float, bool, str, type(None))
BINOPS = {ast.Add: "+", ast.Sub: "-", ast.Mult: "*", ast.Div: "/", ast.FloorDiv: "//", ast.Mod: "%",
           ast.Pow: "**"}
CMPOPS = {ast.Lt: "<", ast.LtE: "<=", ast.Gt: ">", ast.GtE: ">=", ast.Eq: "==", ast.NotEq: "!="}
PY_OPS = {"+": operator.add, "-": operator.sub, "*": operator.mul, "/": operator.truediv,
          "//": operator.floordiv, "%": operator.mod, "**": operator.pow, "<": operator.lt,
          "<=": operator.le, ">": operator.gt, ">=": operator.ge, "==": operator.eq, "!=": operator.ne}
UNARY_OPS: dict[str, Callable[[Any], object]] = {"-": operator.neg, "+": operator.pos, "not": operator.not_}


@dataclass(frozen=True)
class RecordVal:
    """A @record under construction whose fields may be runtime values."""

    cls: type
    fields: dict[str, object]


@dataclass(frozen=True)
class Helper:
    name: str


@dataclass(frozen=True)
class Builtin:
    name: str


@dataclass(frozen=True)
class InputInfo:
    name: str
    kind: str  # Runtime | Unpinnable | Request
    node: Node


@dataclass(frozen=True)
class Check:
    kind: str            # require | assume
    cond: object            # Node or static value: must be truthy
    msg: str
    line: int
    col: int
    top_level: bool      # ran unconditionally (may bound an input's domain)

    @property
    def node(self) -> Node:
        """The condition of a runtime check (one a pass kept because its value is not known statically)."""
        if not isinstance(self.cond, Node):
            raise AssertionError(f"the check at line {self.line} holds statically and was kept")
        return self.cond


@dataclass
class IRProgram:
    """A program after partial evaluation: runtime inputs, knobs, selection points and checks."""

    name: str
    family: str
    source: Source
    result_cls: type
    inputs: list[InputInfo]
    knobs: dict[str, Node]
    outputs: dict[str, object]  # field -> Node or static value
    checks: list[Check]
    builder: Builder

    def roots(self) -> list[Node]:
        nodes = [v for v in self.outputs.values() if isinstance(v, Node)]
        nodes += [c.cond for c in self.checks if isinstance(c.cond, Node)]
        return nodes


def is_static(v: object) -> bool:
    if isinstance(v, Node) or isinstance(v, (RecordVal, Helper, Builtin)) or v is UNDEF:
        return False
    if isinstance(v, (tuple, list)):
        return all(is_static(x) for x in v)
    if isinstance(v, dict):
        return all(is_static(x) for x in v.values())
    return isinstance(v, (*SCALARS, range, frozenset)) or dataclasses.is_dataclass(v)


def freeze(v: object) -> object:
    """A hashable, reprable form of a static table (dict -> sorted tuple of items)."""
    if isinstance(v, dict):
        return Table(tuple(sorted((k, freeze(x)) for k, x in v.items())))
    if isinstance(v, (list, tuple)):
        return tuple(freeze(x) for x in v)
    return v


class Table(tuple):
    """A frozen dict: indexable by key, hashable, with a stable repr."""

    def __getitem__(self, key: object) -> object:  # type: ignore[override]
        for k, v in tuple.__iter__(self):
            if k == key:
                return v
        raise KeyError(key)

    def __repr__(self) -> str:
        return f"Table({tuple.__repr__(self)})"


def static_lookup(base: object, key: object) -> object:
    """`base[key]` of static values: a table or dict by key, a sequence by index or slice. Raises what Python
    raises (KeyError, IndexError, TypeError)."""
    if not isinstance(base, (tuple, list, dict, str, range)):
        raise TypeError(f"{type(base).__name__} object is not subscriptable")
    if isinstance(base, (dict, Table)):
        return base[key]
    if isinstance(key, (int, slice)):
        return base[key]
    raise TypeError(f"{type(base).__name__} indices must be integers or slices, not {type(key).__name__}")


@dataclass
class Frame:
    """The evaluation state of one function body: variables, path conditions, comprehension scopes."""

    env: dict[str, object]
    entry_guard: object = True
    branch: list[object] = field(default_factory=list)
    scopes: list[dict[str, object]] = field(default_factory=list)
    helper: str | None = None


def check_program(prog: IRProgram, after: str) -> None:
    """The IR checker (debug mode, between passes): every node reachable from a root is well formed.

    Arguments come before their readers (smaller ids), the content hash matches the node's operation,
    argument and arguments, a SELECT has three arguments, and a check's condition is a node or a static
    value. Raises AssertionError naming the pass that broke the invariant.
    """
    import hashlib

    from detent_audit.selection.ir import Op, _const_key, toposort

    arity = {Op.CONST: 0, Op.INPUT: 0, Op.KNOB: 0, Op.UNARY: 1, Op.BINARY: 2, Op.COMPARE: 2, Op.AND: 2,
             Op.OR: 2, Op.SELECT: 3}
    for node in toposort(prog.roots()):
        if node.op in arity and len(node.src) != arity[node.op]:
            raise AssertionError(f"after {after}: {node!r} has {len(node.src)} arguments")
        for s in node.src:
            if s.id >= node.id:
                raise AssertionError(f"after {after}: {node!r} reads a later node {s!r}")
        arg_key = _const_key(node.arg) if node.op is Op.CONST else repr(node.arg)
        key = hashlib.sha256("|".join([node.op.value, arg_key,
                                       *(s.key for s in node.src)]).encode()).hexdigest()
        if key != node.key:
            raise AssertionError(f"after {after}: {node!r} does not match its content hash")
        if node.op is Op.INPUT and node.arg[0] not in {i.name for i in prog.inputs}:
            raise AssertionError(f"after {after}: {node!r} is not an input of {prog.name}")
    for c in prog.checks:
        if not isinstance(c.cond, Node) and c.cond:
            raise AssertionError(f"after {after}: the check at line {c.line} holds statically and was kept")
