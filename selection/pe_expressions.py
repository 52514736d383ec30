"""Partial evaluation of SelIR expressions: names, attributes, lookups, operators, calls, comprehensions.

Mixed into `PartialEvaluator` (partial_eval.py), which owns the statements, the control state and the
helpers' inlining. Static operands fold to Python values; a runtime operand makes a `Node`.
"""

from __future__ import annotations

import ast
import dataclasses
from typing import TYPE_CHECKING

from detent_audit.selection import lang
from detent_audit.selection.ir import Builder, Node, Op

if TYPE_CHECKING:
    from detent_audit.selection.frontend import Source
from detent_audit.selection.pe_values import (
    BINOPS,
    CMPOPS,
    PY_OPS,
    UNARY_OPS,
    UNDEF,
    Builtin,
    Frame,
    Helper,
    RecordVal,
    freeze,
    is_static,
    static_lookup,
)


class ExpressionEvaluator:
    """Expression methods of the partial evaluator (see PartialEvaluator for the state they use)."""

    # the state and constructors PartialEvaluator provides
    src: Source
    fn_name: str
    b: Builder
    knobs: dict[str, Node]

    if TYPE_CHECKING:
        def node(self, v: object, at: ast.AST | None = None) -> Node: ...
        def _pos(self, at: ast.AST | None) -> tuple[int, int]: ...
        def not_(self, a: object, at: ast.AST | None = None) -> object: ...
        def and_(self, a: object, b: object, at: ast.AST | None = None) -> object: ...
        def or_(self, a: object, b: object, at: ast.AST | None = None) -> object: ...
        def merge(self, cond: object, a: object, b: object, at: ast.AST | None = None) -> object: ...
        def _inline(self, name: str, e: ast.Call, frame: Frame) -> object: ...

    def eval(self, e: ast.expr, frame: Frame) -> object:
        method = getattr(self, f"_e_{type(e).__name__}", None)
        if method is None:
            raise self.src.error(e, f"`{type(e).__name__}` is not SelIR")
        return method(e, frame)

    def _target_names(self, target: ast.AST) -> list[ast.Name]:
        """The names an assignment or comprehension target binds: a name, or a tuple of names."""
        elts: list[ast.AST] = list(target.elts) if isinstance(target, ast.Tuple) else [target]
        names = [e for e in elts if isinstance(e, ast.Name)]
        if len(names) != len(elts):
            raise self.src.error(target, "only names and tuples of names can be assigned in SelIR")
        return names

    def _e_Constant(self, e: ast.Constant, frame: Frame) -> object:
        return e.value

    def _e_Name(self, e: ast.Name, frame: Frame) -> object:
        return self._lookup(e.id, frame, e)

    def _lookup(self, name: str, frame: Frame, at: ast.AST) -> object:
        for scope in reversed(frame.scopes):
            if name in scope:
                return scope[name]
        if name in frame.env:
            value = frame.env[name]
            if value is UNDEF:
                raise self.src.error(at, f"`{name}` may be used before it is assigned")
            return value
        if name in self.src.functions and name != self.fn_name:
            return Helper(name)
        if name in lang.BUILTINS:
            return Builtin(name)
        if name in lang.MARKERS:
            return Builtin(name)
        ns = self.src.namespace
        if name in ns:
            value = ns[name]
            if isinstance(value, type) and dataclasses.is_dataclass(value):
                return value
            if is_static(value):
                return value
            raise self.src.error(at, f"`{name}` is not a SelIR value (module constants must be numbers, "
                                     "strings, tuples or tables)")
        raise self.src.error(at, f"undefined name `{name}`")

    def _e_Attribute(self, e: ast.Attribute, frame: Frame) -> object:
        base = self.eval(e.value, frame)
        if isinstance(base, (Node, RecordVal)):
            raise self.src.error(e, "attributes can only be read from static facts records")
        try:
            value = getattr(base, e.attr)
        except AttributeError:
            raise self.src.error(e, f"{type(base).__name__} has no field `{e.attr}`") from None
        if callable(value) and not isinstance(value, type):
            raise self.src.error(e, "method calls are not SelIR")
        return value

    def _e_Subscript(self, e: ast.Subscript, frame: Frame) -> object:
        base = self.eval(e.value, frame)
        if not isinstance(base, (Node, tuple, list, dict, str, range)):
            raise self.src.error(e, f"only static tables and collections can be indexed, not "
                                    f"{type(base).__name__}")
        if isinstance(e.slice, ast.Slice):
            parts = [None if p is None else self.eval(p, frame) for p in (e.slice.lower, e.slice.upper,
                                                                          e.slice.step)]
            if isinstance(base, Node) or any(isinstance(p, Node) for p in parts):
                raise self.src.error(e, "slices take static bounds of a static collection")
            return static_lookup(base, slice(*parts))
        key = self.eval(e.slice, frame)
        if isinstance(base, Node):
            raise self.src.error(e, "only static tables and collections can be indexed")
        if not isinstance(key, Node):
            try:
                return static_lookup(base, key)
            except (KeyError, IndexError, TypeError) as exc:
                raise self.src.error(e, f"lookup failed: {exc!r}") from None
        if isinstance(base, (tuple, list)) and not all(is_static(v) for v in base):
            raise self.src.error(e, "indexing a collection of runtime values with a runtime index")
        table = dict(base) if isinstance(base, dict) else tuple(base)
        line, col = self._pos(e)
        return self.b.make(Op.CALL, "getitem", (self.b.const(freeze(table)), key), line=line, col=col)

    def _binop(self, op: str, a: object, b: object, at: ast.AST) -> object:
        if not isinstance(a, Node) and not isinstance(b, Node):
            try:
                return PY_OPS[op](a, b)
            except Exception as exc:  # noqa: BLE001 - reported at the source location
                raise self.src.error(at, f"constant folding `{op}` failed: {exc!r}") from None
        line, col = self._pos(at)
        kind = Op.COMPARE if op in ("<", "<=", ">", ">=", "==", "!=") else Op.BINARY
        return self.b.make(kind, op, (self.node(a, at), self.node(b, at)), line=line, col=col)

    def _e_BinOp(self, e: ast.BinOp, frame: Frame) -> object:
        return self._binop(BINOPS[type(e.op)], self.eval(e.left, frame), self.eval(e.right, frame), e)

    def _e_UnaryOp(self, e: ast.UnaryOp, frame: Frame) -> object:
        v = self.eval(e.operand, frame)
        op = {ast.USub: "-", ast.UAdd: "+", ast.Not: "not"}[type(e.op)]
        if not isinstance(v, Node):
            return UNARY_OPS[op](v)
        if op == "not":
            return self.not_(v, e)
        return self.b.make(Op.UNARY, op, (v,), line=e.lineno, col=e.col_offset)

    def _e_BoolOp(self, e: ast.BoolOp, frame: Frame) -> object:
        is_and = isinstance(e.op, ast.And)
        value = self.eval(e.values[0], frame)
        for operand in e.values[1:]:
            if not isinstance(value, Node) and (not value if is_and else value):
                return value  # static short circuit: the rest is not evaluated, as in Python
            # Python evaluates the next operand only where the value so far is truthy (and) / falsy (or)
            nxt = self._eval_under(operand, frame, value if is_and else self.not_(value, e))
            value = self.and_(value, nxt, e) if is_and else self.or_(value, nxt, e)
        return value

    def _eval_under(self, e: ast.expr, frame: Frame, cond: object) -> object:
        """Evaluate `e` where `cond` holds: the require/assume of helpers it calls are gated by `cond`."""
        if not isinstance(cond, Node):
            return self.eval(e, frame)
        frame.branch.append(cond)
        try:
            return self.eval(e, frame)
        finally:
            frame.branch.pop()

    def _e_Compare(self, e: ast.Compare, frame: Frame) -> object:
        left = self.eval(e.left, frame)
        result: object = True
        for op, right_e in zip(e.ops, e.comparators):
            right = self.eval(right_e, frame)
            result = self.and_(result, self._binop(CMPOPS[type(op)], left, right, e), e)
            if result is False:
                return False
            left = right
        return result

    def _e_IfExp(self, e: ast.IfExp, frame: Frame) -> object:
        cond = self.eval(e.test, frame)
        if not isinstance(cond, Node):
            return self.eval(e.body if cond else e.orelse, frame)
        return self.merge(cond, self._eval_under(e.body, frame, cond),
                          self._eval_under(e.orelse, frame, self.not_(cond, e.test)), e)

    def _e_Tuple(self, e: ast.Tuple, frame: Frame) -> object:
        return tuple(self.eval(x, frame) for x in e.elts)

    def _e_List(self, e: ast.List, frame: Frame) -> object:
        return [self.eval(x, frame) for x in e.elts]

    def _e_ListComp(self, e: ast.ListComp | ast.GeneratorExp, frame: Frame) -> object:
        out: list[object] = []
        self._comprehend(e.generators, 0, e.elt, frame, out)
        return out

    _e_GeneratorExp = _e_ListComp

    def _comprehend(self, gens: list[ast.comprehension], i: int, elt: ast.expr, frame: Frame,
                    out: list[object]) -> None:
        if i == len(gens):
            out.append(self.eval(elt, frame))
            return
        gen = gens[i]
        items = self.eval(gen.iter, frame)
        if isinstance(items, Node) or not isinstance(items, (tuple, list, range)):
            raise self.src.error(gen.iter, "a comprehension runs over a static collection")
        for item in items:
            scope: dict[str, object] = {}
            frame.scopes.append(scope)
            try:
                if isinstance(gen.target, ast.Name):
                    scope[gen.target.id] = item
                else:
                    names = self._target_names(gen.target)
                    if not isinstance(item, (tuple, list)) or len(item) != len(names):
                        raise self.src.error(gen.target, f"cannot unpack {item!r} into {len(names)} names")
                    for name, v in zip(names, item):
                        scope[name.id] = v
                keep = True
                for cond_e in gen.ifs:
                    cond = self.eval(cond_e, frame)
                    if isinstance(cond, Node):
                        raise self.src.error(cond_e, "a comprehension filter must be static (the length of "
                                                     "a collection cannot depend on the batch)")
                    keep = keep and bool(cond)
                if keep:
                    self._comprehend(gens, i + 1, elt, frame, out)
            finally:
                frame.scopes.pop()

    def _e_Call(self, e: ast.Call, frame: Frame) -> object:
        fn = self.eval(e.func, frame)
        if isinstance(fn, type):
            return self._record(fn, e, frame)
        if isinstance(fn, Helper):
            return self._inline(fn.name, e, frame)
        if not isinstance(fn, Builtin):
            raise self.src.error(e, "only builtins, helpers of this module and @record classes can be called")
        if fn.name in ("require", "assume"):
            raise self.src.error(e, f"{fn.name} is a statement, not a value")
        if fn.name == "knob":
            return self._knob(e)
        if e.keywords:
            raise self.src.error(e.keywords[0], f"builtin `{fn.name}` takes positional arguments only")
        args = [self.eval(a, frame) for a in e.args]
        return self._builtin(fn.name, args, e)

    def _builtin(self, name: str, args: list[object], e: ast.AST) -> object:
        impl = lang.BUILTINS[name]
        if all(is_static(a) for a in args):
            try:
                return impl(*args)
            except Exception as exc:  # noqa: BLE001
                raise self.src.error(e, f"constant folding `{name}` failed: {exc!r}") from None
        line, col = self._pos(e)
        if name in ("min", "max", "sum", "any",
                    "all") and len(args) == 1 and isinstance(args[0], (list, tuple)):
            args = list(args[0])
            if not args:
                raise self.src.error(e, f"`{name}` of an empty collection")
        if name == "sum":
            total: object = 0
            for a in args:
                total = self._binop("+", total, a, e)
            return total
        if name in ("any", "all"):
            acc: object = name == "all"
            for a in args:
                b = a if not isinstance(a, Node) else self.b.make(Op.CALL, "bool", (a,), line=line, col=col)
                acc = self.and_(acc, b, e) if name == "all" else self.or_(acc, b, e)
            return acc
        if name in ("len", "range"):
            raise self.src.error(e, f"`{name}` needs a static argument")
        return self.b.make(Op.CALL, name, tuple(self.node(a, e) for a in args), line=line, col=col)

    def _knob(self, e: ast.Call) -> Node:
        try:
            values = [ast.literal_eval(a) for a in e.args]
            values += [ast.literal_eval(k.value) for k in e.keywords]
            keys = ["name", "choices", "default"][: len(e.args)] + [k.arg for k in e.keywords]
            spec = dict(zip(keys, values))
            name, choices, default = spec["name"], tuple(spec["choices"]), spec["default"]
        except (ValueError, KeyError, TypeError):
            raise self.src.error(e, "knob takes literal (name, choices, default)") from None
        if default not in choices:
            raise self.src.error(e, f"knob `{name}`: default {default!r} is not among its choices")
        node = self.b.make(Op.KNOB, (name, choices, default), line=e.lineno, col=e.col_offset, name=name)
        if self.knobs.get(name, node) is not node:
            raise self.src.error(e, f"knob `{name}` is declared twice with different choices")
        self.knobs[name] = node
        return node

    def _record(self, cls: type, e: ast.Call, frame: Frame) -> RecordVal:
        if e.args:
            raise self.src.error(e, f"@record `{cls.__name__}` takes keyword arguments")
        names = [f.name for f in dataclasses.fields(cls)]
        given: dict[str, object] = {}
        for k in e.keywords:
            if k.arg is None:
                raise self.src.error(e, f"`{cls.__name__}`: `**` arguments are not SelIR")
            given[k.arg] = self.eval(k.value, frame)
        missing, extra = sorted(set(names) - set(given)), sorted(set(given) - set(names))
        if missing or extra:
            raise self.src.error(e, f"`{cls.__name__}`: missing fields {missing}, unknown fields {extra}")
        return RecordVal(cls, {n: given[n] for n in names})

