"""The SelIR intermediate representation: one immutable node type, hash-consed per build.

A program after partial evaluation is a DAG of `Node`s: the selection points (fields of the returned
record) and the checks (`require`/`assume`) are its roots. Node ids follow creation order, which follows the
source, so sorting by id is program order and every node's arguments have smaller ids (a topological order).
"""

from __future__ import annotations

import enum
import hashlib
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any


class Op(enum.Enum):
    # 1 -- leaves
    CONST = "const"      # a static value: arg = the value
    INPUT = "input"      # arg = (name, kind) with kind in Runtime | Unpinnable | Request
    KNOB = "knob"        # arg = (name, choices, default): a deployment setting
    # 2 -- arithmetic and logic; arg = the Python operator's spelling
    UNARY = "unary"      # '-', '+', 'not'
    BINARY = "binary"    # '+', '-', '*', '/', '//', '%', '**'
    COMPARE = "compare"  # '<', '<=', '>', '>=', '==', '!='
    AND = "and"          # Python `a and b` (both operands evaluated)
    OR = "or"            # Python `a or b` (both operands evaluated)
    # 3 -- control: a phi of gated SSA; src[0] is the condition (a control dependence)
    SELECT = "select"    # src = (cond, if_true, if_false)
    # 4 -- calls of pure builtins; arg = the builtin's name ('getitem' for a table lookup)
    CALL = "call"


@dataclass(eq=False, slots=True)
class Node:
    """One value. Immutable but for `name`, which is set once: the first variable the value is assigned to."""

    id: int
    op: Op
    arg: Any
    src: tuple[Node, ...]
    line: int
    col: int
    name: str | None
    key: str = field(repr=False)

    def __repr__(self) -> str:
        return f"Node({self.id}, {self.op.value}, {self.arg!r}, {self.name or ''})"

    @property
    def label(self) -> str:
        """A human name: the variable it was assigned to, or its operation."""
        if self.name:
            return self.name
        if self.op in (Op.INPUT, Op.KNOB):
            return self.arg[0]
        return f"{self.op.value}:{self.arg}" if self.arg is not None else self.op.value


def _const_key(value: Any) -> str:
    return f"{type(value).__name__}:{value!r}"


class Builder:
    """Creates nodes; structurally equal nodes are the same object (common subexpressions merge)."""

    def __init__(self) -> None:
        self._by_key: dict[str, Node] = {}
        self._next_id = 0

    def make(self, op: Op, arg: Any = None, src: Iterable[Node] = (), *, line: int = 0, col: int = 0,
             name: str | None = None) -> Node:
        src = tuple(src)
        arg_key = _const_key(arg) if op is Op.CONST else repr(arg)
        key = hashlib.sha256(
            "|".join([op.value, arg_key, *(s.key for s in src)]).encode()).hexdigest()
        node = self._by_key.get(key)
        if node is None:
            node = Node(self._next_id, op, arg, src, line, col, name, key)
            self._next_id += 1
            self._by_key[key] = node
        elif name and not node.name:
            node.name = name  # the first variable a value is assigned to names it
        return node

    def const(self, value: Any, line: int = 0, col: int = 0) -> Node:
        return self.make(Op.CONST, value, line=line, col=col)


def is_boolean(node: Node) -> bool:
    """Whether `node` always evaluates to a Python bool (a comparison, `not`, `bool()`, and/or of those)."""
    if node.op is Op.CONST:
        return isinstance(node.arg, bool)
    if node.op is Op.COMPARE or (node.op is Op.UNARY and node.arg == "not") or (
            node.op is Op.CALL and node.arg == "bool"):
        return True
    if node.op in (Op.AND, Op.OR, Op.SELECT):
        return all(is_boolean(s) for s in node.src[node.op is Op.SELECT:])
    return False


def toposort(roots: Iterable[Node]) -> list[Node]:
    """Every node reachable from `roots`, arguments first (ascending id), with an explicit stack."""
    seen: dict[int, Node] = {}
    stack = list(roots)
    while stack:
        node = stack.pop()
        if node.id in seen:
            continue
        seen[node.id] = node
        stack.extend(node.src)
    return [seen[i] for i in sorted(seen)]
