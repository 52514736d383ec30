"""Partial evaluation: a SelIR function and its deployment facts -> a DAG of runtime values.

Static values (facts, module constants, literals) are computed on the spot: constant folding, branch
pruning, loop unrolling over static collections, table lookups with static keys and inlining of helpers
all happen here. What depends on a runtime input becomes a `Node`.

Control flow becomes gated SSA: after `if` on a runtime condition, each variable the arms disagree on is a
`SELECT(cond, then, else)` (a control dependence); `return`/`break`/`continue` under a runtime condition set
flags that gate every later assignment; `require`/`assume` are recorded with the path condition under which
they run. Both arms of a runtime conditional are evaluated (SELECT semantics), so a division must be guarded
in both (`cdiv(a, max(1, b))`).
"""

from __future__ import annotations

import ast
import dataclasses
import operator
from dataclasses import dataclass, field
from typing import Any

from detent_audit.selection import lang
from detent_audit.selection.errors import SelIRError
from detent_audit.selection.frontend import Source, check_grammar, program_inputs
from detent_audit.selection.ir import Builder, Node, Op


class _Undef:
    def __repr__(self) -> str:
        return "UNDEF"


UNDEF = _Undef()
_SCALARS = (int, float, bool, str, type(None))
_BINOPS = {ast.Add: "+", ast.Sub: "-", ast.Mult: "*", ast.Div: "/", ast.FloorDiv: "//", ast.Mod: "%",
           ast.Pow: "**"}
_CMPOPS = {ast.Lt: "<", ast.LtE: "<=", ast.Gt: ">", ast.GtE: ">=", ast.Eq: "==", ast.NotEq: "!="}
PY_OPS = {"+": operator.add, "-": operator.sub, "*": operator.mul, "/": operator.truediv,
          "//": operator.floordiv, "%": operator.mod, "**": operator.pow, "<": operator.lt,
          "<=": operator.le, ">": operator.gt, ">=": operator.ge, "==": operator.eq, "!=": operator.ne}


@dataclass(frozen=True)
class RecordVal:
    """A @record under construction whose fields may be runtime values."""

    cls: type
    fields: dict[str, Any]


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
    cond: Any            # Node or static value: must be truthy
    msg: str
    line: int
    col: int
    top_level: bool      # ran unconditionally (may bound an input's domain)


@dataclass
class IRProgram:
    """A program after partial evaluation: runtime inputs, knobs, selection points and checks."""

    name: str
    family: str
    source: Source
    result_cls: type
    inputs: list[InputInfo]
    knobs: dict[str, Node]
    outputs: dict[str, Any]  # field -> Node or static value
    checks: list[Check]
    builder: Builder

    def roots(self) -> list[Node]:
        nodes = [v for v in self.outputs.values() if isinstance(v, Node)]
        nodes += [c.cond for c in self.checks if isinstance(c.cond, Node)]
        return nodes


@dataclass
class _Frame:
    env: dict[str, Any]
    entry_guard: Any = True
    branch: list[Any] = field(default_factory=list)
    scopes: list[dict[str, Any]] = field(default_factory=list)
    helper: str | None = None


class PartialEvaluator:
    """Evaluates one program against one facts record. Use `run()`."""

    def __init__(self, src: Source, fn_name: str, facts: Any, *, max_inline_depth: int = 32) -> None:
        self.src, self.fn_name, self.facts = src, fn_name, facts
        self.b = Builder()
        self.knobs: dict[str, Node] = {}
        self.checks: list[Check] = []
        self._stack: list[str] = []
        self._max_depth = max_inline_depth

    # ---- entry
    def run(self) -> IRProgram:
        functions = self.src.functions
        if self.fn_name not in functions:
            raise SelIRError(f"no function `{self.fn_name}` in {self.src.filename}")
        fn = functions[self.fn_name]
        check_grammar(self.src, fn)
        inputs = []
        frame = _Frame(env={fn.args.args[0].arg: self.facts, "$returned": False})
        for name, kind, param in program_inputs(self.src, fn):
            node = self.b.make(Op.INPUT, (name, kind), line=param.lineno, col=param.col_offset, name=name)
            inputs.append(InputInfo(name, kind, node))
            frame.env[name] = node
        self._stack.append(self.fn_name)
        self._block(fn.body, frame)
        result = frame.env.get("$ret", UNDEF)
        if not isinstance(result, RecordVal):
            raise self.src.error(fn, f"program `{self.fn_name}` must return a @record on every path "
                                     "(its fields are the selection points)")
        family = getattr(self.src.namespace.get(self.fn_name), "__selir_family__", self.fn_name)
        return IRProgram(self.fn_name, family, self.src, result.cls, inputs, dict(self.knobs),
                         dict(result.fields), self.checks, self.b)

    # ---- small constructors with static simplification
    def node(self, v: Any, at: ast.AST | None = None) -> Node:
        if isinstance(v, Node):
            return v
        if isinstance(v, _SCALARS) or (isinstance(v, tuple) and all(isinstance(e, _SCALARS) for e in v)):
            return self.b.const(v, *self._pos(at))
        raise self.src.error(at, f"a {type(v).__name__} cannot be used as a runtime value")

    def _pos(self, at: ast.AST | None) -> tuple[int, int]:
        return (getattr(at, "lineno", 0), getattr(at, "col_offset", 0))

    def not_(self, a: Any, at: ast.AST | None = None) -> Any:
        if not isinstance(a, Node):
            return not a
        if a.op is Op.UNARY and a.arg == "not" and a.src[0].op in (Op.COMPARE, Op.UNARY, Op.AND, Op.OR):
            return a.src[0]
        return self.b.make(Op.UNARY, "not", (a,), line=self._pos(at)[0], col=self._pos(at)[1])

    def and_(self, a: Any, b: Any, at: ast.AST | None = None) -> Any:
        if not isinstance(a, Node):
            return b if a else a
        if not isinstance(b, Node) and b:
            return a
        return self.b.make(Op.AND, None, (a, self.node(b, at)), line=self._pos(at)[0], col=self._pos(at)[1])

    def or_(self, a: Any, b: Any, at: ast.AST | None = None) -> Any:
        if not isinstance(a, Node):
            return a if a else b
        if not isinstance(b, Node) and not b:
            return a
        return self.b.make(Op.OR, None, (a, self.node(b, at)), line=self._pos(at)[0], col=self._pos(at)[1])

    def merge(self, cond: Any, a: Any, b: Any, at: ast.AST | None = None) -> Any:
        """The value that is `a` where `cond` holds and `b` elsewhere."""
        if a is UNDEF:
            return b
        if b is UNDEF or a is b:
            return a
        if not isinstance(cond, Node):
            return a if cond else b
        if not isinstance(a, Node) and not isinstance(b, Node) and type(a) is type(b):
            if isinstance(a, _SCALARS) and a == b:
                return a
            if isinstance(a, (tuple, list)) and len(a) == len(b):
                return type(a)(self.merge(cond, x, y, at) for x, y in zip(a, b))
            if isinstance(a, RecordVal) and a.cls is b.cls:
                return RecordVal(a.cls, {k: self.merge(cond, a.fields[k], b.fields[k], at) for k in a.fields})
            if a == b:
                return a
        line, col = self._pos(at)
        return self.b.make(Op.SELECT, None, (cond, self.node(a, at), self.node(b, at)), line=line, col=col)

    # ---- control state
    def live(self, frame: _Frame) -> Any:
        live: Any = True
        for flag in ("$returned", "$broken", "$continued"):
            live = self.and_(live, self.not_(frame.env.get(flag, False)))
        return live

    def guard(self, frame: _Frame) -> Any:
        g = frame.entry_guard
        for cond in frame.branch:
            g = self.and_(g, cond)
        return self.and_(g, self.live(frame))

    def bind(self, frame: _Frame, name: str, value: Any, at: ast.AST) -> None:
        if isinstance(value, Node) and value.name is None and value.op is not Op.CONST:
            value.name = name
        live = self.live(frame)
        if live is not True:
            value = self.merge(live, value, frame.env.get(name, UNDEF), at)
            if isinstance(value, Node) and value.name is None and not name.startswith("$"):
                value.name = name
        frame.env[name] = value

    def _set_flag(self, frame: _Frame, flag: str) -> None:
        frame.env[flag] = self.or_(frame.env.get(flag, False), self.live(frame))

    # ---- statements
    def _block(self, stmts: list[ast.stmt], frame: _Frame) -> None:
        for stmt in stmts:
            if self.live(frame) is False:
                return  # the rest is dead code on every path
            self._stmt(stmt, frame)

    def _stmt(self, s: ast.stmt, frame: _Frame) -> None:
        if isinstance(s, ast.Assign):
            value = self.eval(s.value, frame)
            for target in s.targets:
                self._assign(target, value, frame)
        elif isinstance(s, ast.AnnAssign):
            if s.value is None:
                raise self.src.error(s, "a declaration without a value is not SelIR")
            self._assign(s.target, self.eval(s.value, frame), frame)
        elif isinstance(s, ast.AugAssign):
            old = self._lookup(s.target.id, frame, s.target)
            self._assign(s.target, self._binop(_BINOPS[type(s.op)], old, self.eval(s.value, frame), s), frame)
        elif isinstance(s, ast.If):
            self._if(s, frame)
        elif isinstance(s, ast.For):
            self._for(s, frame)
        elif isinstance(s, ast.Return):
            if s.value is None:
                raise self.src.error(s, "`return` needs a value in SelIR")
            value = self.eval(s.value, frame)
            self.bind(frame, "$ret", value, s)
            self._set_flag(frame, "$returned")
        elif isinstance(s, ast.Break):
            self._need_loop(frame, s)
            self._set_flag(frame, "$broken")
        elif isinstance(s, ast.Continue):
            self._need_loop(frame, s)
            self._set_flag(frame, "$continued")
        elif isinstance(s, ast.Expr):
            self._expr_stmt(s, frame)
        # ast.Pass: nothing

    def _need_loop(self, frame: _Frame, s: ast.stmt) -> None:
        if "$loop" not in frame.env:
            raise self.src.error(s, "`break`/`continue` outside a loop")

    def _assign(self, target: ast.AST, value: Any, frame: _Frame) -> None:
        if isinstance(target, ast.Name):
            self.bind(frame, target.id, value, target)
            return
        names = target.elts  # a tuple of names (the grammar checked it)
        if isinstance(value, RecordVal) or not isinstance(value, (tuple, list)) or len(value) != len(names):
            raise self.src.error(target, f"cannot unpack {self._describe(value)} into {len(names)} names")
        for name, item in zip(names, value):
            self.bind(frame, name.id, item, name)

    def _if(self, s: ast.If, frame: _Frame) -> None:
        cond = self.eval(s.test, frame)
        if not isinstance(cond, Node):  # branch pruning
            self._block(s.body if cond else s.orelse, frame)
            return
        envs = []
        for arm, arm_cond in ((s.body, cond), (s.orelse, self.not_(cond, s.test))):
            arm_frame = _Frame(dict(frame.env), frame.entry_guard, [*frame.branch, arm_cond], frame.scopes,
                               frame.helper)
            self._block(arm, arm_frame)
            envs.append(arm_frame.env)
        then_env, else_env = envs
        for name in sorted(set(then_env) | set(else_env)):
            merged = self.merge(cond, then_env.get(name, UNDEF), else_env.get(name, UNDEF), s)
            if isinstance(merged, Node) and merged.name is None and not name.startswith("$"):
                merged.name = name  # the phi takes the variable's name
            frame.env[name] = merged

    def _for(self, s: ast.For, frame: _Frame) -> None:
        items = self.eval(s.iter, frame)
        if isinstance(items, Node) or not isinstance(items, (tuple, list, range)):
            raise self.src.error(s.iter, "a SelIR loop runs over a static collection (a range of constants "
                                         "or facts, a tuple, a facts list), not a runtime value")
        saved = {k: frame.env.get(k, UNDEF) for k in ("$loop", "$broken", "$continued")}
        frame.env["$loop"], frame.env["$broken"] = True, False
        for item in items:
            frame.env["$continued"] = False
            self._assign(s.target, item, frame)
            self._block(s.body, frame)
            if frame.env.get("$broken") is True or frame.env.get("$returned") is True:
                break
        for k, v in saved.items():
            if v is UNDEF:
                frame.env.pop(k, None)
            else:
                frame.env[k] = v

    def _expr_stmt(self, s: ast.Expr, frame: _Frame) -> None:
        call = s.value
        if isinstance(call, ast.Constant) and isinstance(call.value, str):
            return  # a docstring
        if isinstance(call, ast.Call) and isinstance(call.func, ast.Name) and call.func.id in self.src.functions:
            self.eval(call, frame)  # a helper called for its require/assume; its value is dropped
            return
        if not (isinstance(call, ast.Call) and isinstance(call.func, ast.Name)
                and call.func.id in ("require", "assume")):
            raise self.src.error(s, "an expression statement has no effect in SelIR (only require/assume "
                                    "and helper calls)")
        kind = call.func.id
        if len(call.args) != 2 or call.keywords:
            raise self.src.error(call, f"{kind} takes (condition, message)")
        msg_node = call.args[1]
        if not (isinstance(msg_node, ast.Constant) and isinstance(msg_node.value, str)):
            raise self.src.error(msg_node, f"the message of {kind} must be a string literal")
        cond = self.eval(call.args[0], frame)
        guard = self.guard(frame)
        effective = cond if guard is True else self.or_(self.not_(guard, call), cond, call)
        if not isinstance(effective, Node):
            if not effective:
                raise self.src.error(call, f"{kind} never holds for this deployment: {msg_node.value}",
                                     remedy="check the deployment facts against the program's limits")
            return
        self.checks.append(Check(kind, effective, msg_node.value, call.lineno, call.col_offset,
                                 guard is True and frame.helper is None))

    # ---- expressions
    def eval(self, e: ast.expr, frame: _Frame) -> Any:
        method = getattr(self, f"_e_{type(e).__name__}", None)
        if method is None:
            raise self.src.error(e, f"`{type(e).__name__}` is not SelIR")
        return method(e, frame)

    def _e_Constant(self, e: ast.Constant, frame: _Frame) -> Any:
        return e.value

    def _e_Name(self, e: ast.Name, frame: _Frame) -> Any:
        return self._lookup(e.id, frame, e)

    def _lookup(self, name: str, frame: _Frame, at: ast.AST) -> Any:
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
            if _is_static(value):
                return value
            raise self.src.error(at, f"`{name}` is not a SelIR value (module constants must be numbers, "
                                     "strings, tuples or tables)")
        raise self.src.error(at, f"undefined name `{name}`")

    def _e_Attribute(self, e: ast.Attribute, frame: _Frame) -> Any:
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

    def _e_Subscript(self, e: ast.Subscript, frame: _Frame) -> Any:
        base = self.eval(e.value, frame)
        if isinstance(e.slice, ast.Slice):
            parts = [None if p is None else self.eval(p, frame) for p in (e.slice.lower, e.slice.upper,
                                                                          e.slice.step)]
            if isinstance(base, Node) or any(isinstance(p, Node) for p in parts):
                raise self.src.error(e, "slices take static bounds of a static collection")
            return base[slice(*parts)]
        key = self.eval(e.slice, frame)
        if isinstance(base, Node):
            raise self.src.error(e, "only static tables and collections can be indexed")
        if not isinstance(key, Node):
            try:
                return base[key]
            except (KeyError, IndexError, TypeError) as exc:
                raise self.src.error(e, f"lookup failed: {exc!r}") from None
        if isinstance(base, (tuple, list)) and not all(_is_static(v) for v in base):
            raise self.src.error(e, "indexing a collection of runtime values with a runtime index")
        table = dict(base) if isinstance(base, dict) else tuple(base)
        line, col = self._pos(e)
        return self.b.make(Op.CALL, "getitem", (self.b.const(_freeze(table)), key), line=line, col=col)

    def _binop(self, op: str, a: Any, b: Any, at: ast.AST) -> Any:
        if not isinstance(a, Node) and not isinstance(b, Node):
            try:
                return PY_OPS[op](a, b)
            except Exception as exc:  # noqa: BLE001 - reported at the source location
                raise self.src.error(at, f"constant folding `{op}` failed: {exc!r}") from None
        line, col = self._pos(at)
        kind = Op.COMPARE if op in ("<", "<=", ">", ">=", "==", "!=") else Op.BINARY
        return self.b.make(kind, op, (self.node(a, at), self.node(b, at)), line=line, col=col)

    def _e_BinOp(self, e: ast.BinOp, frame: _Frame) -> Any:
        return self._binop(_BINOPS[type(e.op)], self.eval(e.left, frame), self.eval(e.right, frame), e)

    def _e_UnaryOp(self, e: ast.UnaryOp, frame: _Frame) -> Any:
        v = self.eval(e.operand, frame)
        op = {ast.USub: "-", ast.UAdd: "+", ast.Not: "not"}[type(e.op)]
        if not isinstance(v, Node):
            return {"-": operator.neg, "+": operator.pos, "not": operator.not_}[op](v)
        if op == "not":
            return self.not_(v, e)
        return self.b.make(Op.UNARY, op, (v,), line=e.lineno, col=e.col_offset)

    def _e_BoolOp(self, e: ast.BoolOp, frame: _Frame) -> Any:
        is_and = isinstance(e.op, ast.And)
        value = self.eval(e.values[0], frame)
        for operand in e.values[1:]:
            if not isinstance(value, Node) and (not value if is_and else value):
                return value  # static short circuit: the rest is not evaluated, as in Python
            nxt = self.eval(operand, frame)
            value = self.and_(value, nxt, e) if is_and else self.or_(value, nxt, e)
        return value

    def _e_Compare(self, e: ast.Compare, frame: _Frame) -> Any:
        left = self.eval(e.left, frame)
        result: Any = True
        for op, right_e in zip(e.ops, e.comparators):
            right = self.eval(right_e, frame)
            result = self.and_(result, self._binop(_CMPOPS[type(op)], left, right, e), e)
            if result is False:
                return False
            left = right
        return result

    def _e_IfExp(self, e: ast.IfExp, frame: _Frame) -> Any:
        cond = self.eval(e.test, frame)
        if not isinstance(cond, Node):
            return self.eval(e.body if cond else e.orelse, frame)
        return self.merge(cond, self.eval(e.body, frame), self.eval(e.orelse, frame), e)

    def _e_Tuple(self, e: ast.Tuple, frame: _Frame) -> Any:
        return tuple(self.eval(x, frame) for x in e.elts)

    def _e_List(self, e: ast.List, frame: _Frame) -> Any:
        return [self.eval(x, frame) for x in e.elts]

    def _e_ListComp(self, e: ast.ListComp | ast.GeneratorExp, frame: _Frame) -> Any:
        out: list[Any] = []
        self._comprehend(e.generators, 0, e.elt, frame, out)
        return out

    _e_GeneratorExp = _e_ListComp

    def _comprehend(self, gens: list[ast.comprehension], i: int, elt: ast.expr, frame: _Frame,
                    out: list[Any]) -> None:
        if i == len(gens):
            out.append(self.eval(elt, frame))
            return
        gen = gens[i]
        items = self.eval(gen.iter, frame)
        if isinstance(items, Node) or not isinstance(items, (tuple, list, range)):
            raise self.src.error(gen.iter, "a comprehension runs over a static collection")
        for item in items:
            scope: dict[str, Any] = {}
            frame.scopes.append(scope)
            try:
                if isinstance(gen.target, ast.Name):
                    scope[gen.target.id] = item
                else:
                    for name, v in zip(gen.target.elts, item):
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

    def _e_Call(self, e: ast.Call, frame: _Frame) -> Any:
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

    def _builtin(self, name: str, args: list[Any], e: ast.AST) -> Any:
        impl = lang.BUILTINS[name]
        if all(_is_static(a) for a in args):
            try:
                return impl(*args)
            except Exception as exc:  # noqa: BLE001
                raise self.src.error(e, f"constant folding `{name}` failed: {exc!r}") from None
        line, col = self._pos(e)
        if name in ("min", "max", "sum", "any", "all") and len(args) == 1 and isinstance(args[0], (list, tuple)):
            args = list(args[0])
            if not args:
                raise self.src.error(e, f"`{name}` of an empty collection")
        if name == "sum":
            total: Any = 0
            for a in args:
                total = self._binop("+", total, a, e)
            return total
        if name in ("any", "all"):
            acc: Any = name == "all"
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

    def _record(self, cls: type, e: ast.Call, frame: _Frame) -> RecordVal:
        if e.args:
            raise self.src.error(e, f"@record `{cls.__name__}` takes keyword arguments")
        names = [f.name for f in dataclasses.fields(cls)]
        given = {k.arg: self.eval(k.value, frame) for k in e.keywords}
        missing, extra = sorted(set(names) - set(given)), sorted(set(given) - set(names))
        if missing or extra:
            raise self.src.error(e, f"`{cls.__name__}`: missing fields {missing}, unknown fields {extra}")
        return RecordVal(cls, {n: given[n] for n in names})

    def _inline(self, name: str, e: ast.Call, frame: _Frame) -> Any:
        if name in self._stack:
            raise self.src.error(e, f"helper `{name}` is recursive: SelIR inlines helpers")
        if len(self._stack) >= self._max_depth:
            raise self.src.error(e, "helpers nest too deeply")
        fn = self.src.functions[name]
        check_grammar(self.src, fn)
        params = [a.arg for a in fn.args.args]
        if len(e.args) > len(params):
            raise self.src.error(e, f"helper `{name}` takes {len(params)} arguments")
        bound = dict(zip(params, (self.eval(a, frame) for a in e.args)))
        for k in e.keywords:
            if k.arg not in params or k.arg in bound:
                raise self.src.error(k, f"helper `{name}`: bad argument `{k.arg}`")
            bound[k.arg] = self.eval(k.value, frame)
        if set(bound) != set(params):
            raise self.src.error(e, f"helper `{name}` is missing {sorted(set(params) - set(bound))}")
        callee = _Frame(env={**bound, "$returned": False}, entry_guard=self.guard(frame), helper=name)
        self._stack.append(name)
        try:
            self._block(fn.body, callee)
        finally:
            self._stack.pop()
        result = callee.env.get("$ret", UNDEF)
        if result is UNDEF:
            raise self.src.error(fn, f"helper `{name}` returns no value")
        return result

    def _describe(self, v: Any) -> str:
        return "a runtime value" if isinstance(v, Node) else f"a {type(v).__name__}"


def _is_static(v: Any) -> bool:
    if isinstance(v, Node) or isinstance(v, (RecordVal, Helper, Builtin)) or v is UNDEF:
        return False
    if isinstance(v, (tuple, list)):
        return all(_is_static(x) for x in v)
    if isinstance(v, dict):
        return all(_is_static(x) for x in v.values())
    return isinstance(v, (*_SCALARS, range, frozenset)) or dataclasses.is_dataclass(v)


def _freeze(v: Any) -> Any:
    """A hashable, reprable form of a static table (dict -> sorted tuple of items)."""
    if isinstance(v, dict):
        return _Table(tuple(sorted((k, _freeze(x)) for k, x in v.items())))
    if isinstance(v, (list, tuple)):
        return tuple(_freeze(x) for x in v)
    return v


class _Table(tuple):
    """A frozen dict: indexable by key, hashable, with a stable repr."""

    def __getitem__(self, key: Any) -> Any:  # type: ignore[override]
        for k, v in tuple.__iter__(self):
            if k == key:
                return v
        raise KeyError(key)

    def __repr__(self) -> str:
        return f"Table({tuple.__repr__(self)})"


def partial_evaluate(src: Source, fn_name: str, facts: Any) -> IRProgram:
    """Pass: partial evaluation of `fn_name` with `facts`."""
    return PartialEvaluator(src, fn_name, facts).run()
