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

from detent_audit.selection.errors import SelIRError
from detent_audit.selection.frontend import Source, check_grammar, program_inputs
from detent_audit.selection.ir import Builder, Node, Op, is_boolean
from detent_audit.selection.pe_expressions import ExpressionEvaluator
from detent_audit.selection.pe_values import (
    BINOPS,
    SCALARS,
    UNDEF,
    Check,
    Frame,
    InputInfo,
    IRProgram,
    RecordVal,
)


class PartialEvaluator(ExpressionEvaluator):
    """Evaluates one program against one facts record. Use `run()`."""

    def __init__(self, src: Source, fn_name: str, facts: object, *, max_inline_depth: int = 32) -> None:
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
        frame = Frame(env={fn.args.args[0].arg: self.facts, "$returned": False})
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
    def node(self, v: object, at: ast.AST | None = None) -> Node:
        if isinstance(v, Node):
            return v
        if isinstance(v, SCALARS) or (isinstance(v, tuple) and all(isinstance(e, SCALARS) for e in v)):
            return self.b.const(v, *self._pos(at))
        raise self.src.error(at, f"a {type(v).__name__} cannot be used as a runtime value")

    def _pos(self, at: ast.AST | None) -> tuple[int, int]:
        return (getattr(at, "lineno", 0), getattr(at, "col_offset", 0))

    def not_(self, a: object, at: ast.AST | None = None) -> object:
        if not isinstance(a, Node):
            return not a
        if a.op is Op.UNARY and a.arg == "not" and a.src[0].op in (Op.COMPARE, Op.UNARY, Op.AND, Op.OR):
            return a.src[0]
        return self.b.make(Op.UNARY, "not", (a,), line=self._pos(at)[0], col=self._pos(at)[1])

    def and_(self, a: object, b: object, at: ast.AST | None = None) -> object:
        if not isinstance(a, Node):
            return b if a else a
        if not isinstance(b, Node) and b:
            return a
        if b is False and is_boolean(a):
            return False  # `<boolean> and False` is False whichever the boolean
        return self.b.make(Op.AND, None, (a, self.node(b, at)), line=self._pos(at)[0], col=self._pos(at)[1])

    def or_(self, a: object, b: object, at: ast.AST | None = None) -> object:
        if not isinstance(a, Node):
            return a if a else b
        if not isinstance(b, Node) and not b:
            return a
        if b is True and is_boolean(a):
            return True  # `<boolean> or True` is True whichever the boolean
        return self.b.make(Op.OR, None, (a, self.node(b, at)), line=self._pos(at)[0], col=self._pos(at)[1])

    def merge(self, cond: object, a: object, b: object, at: ast.AST | None = None) -> object:
        """The value that is `a` where `cond` holds and `b` elsewhere."""
        if a is UNDEF:
            return b
        if b is UNDEF or a is b:
            return a
        if not isinstance(cond, Node):
            return a if cond else b
        if not isinstance(a, Node) and not isinstance(b, Node) and type(a) is type(b):
            if isinstance(a, SCALARS) and a == b:
                return a
            if isinstance(a, (tuple, list)) and isinstance(b, (tuple, list)) and len(a) == len(b):
                return type(a)(self.merge(cond, x, y, at) for x, y in zip(a, b))
            if isinstance(a, RecordVal) and isinstance(b, RecordVal) and a.cls is b.cls:
                return RecordVal(a.cls, {k: self.merge(cond, a.fields[k], b.fields[k], at) for k in a.fields})
            if a == b:
                return a
        line, col = self._pos(at)
        return self.b.make(Op.SELECT, None, (cond, self.node(a, at), self.node(b, at)), line=line, col=col)

    # ---- control state
    def live(self, frame: Frame) -> object:
        live: object = True
        for flag in ("$returned", "$broken", "$continued"):
            live = self.and_(live, self.not_(frame.env.get(flag, False)))
        return live

    def guard(self, frame: Frame) -> object:
        g = frame.entry_guard
        for cond in frame.branch:
            g = self.and_(g, cond)
        return self.and_(g, self.live(frame))

    def bind(self, frame: Frame, name: str, value: object, at: ast.AST) -> None:
        if isinstance(value,
                      Node) and value.name is None and value.op is not Op.CONST and not name.startswith("$"):
            value.name = name  # ($ret and the control flags are no names: the caller's variable names it)
        live = self.live(frame)
        if live is not True:
            value = self.merge(live, value, frame.env.get(name, UNDEF), at)
            if isinstance(value, Node) and value.name is None and not name.startswith("$"):
                value.name = name
        frame.env[name] = value

    def _set_flag(self, frame: Frame, flag: str) -> None:
        frame.env[flag] = self.or_(frame.env.get(flag, False), self.live(frame))

    # ---- statements
    def _block(self, stmts: list[ast.stmt], frame: Frame) -> None:
        for stmt in stmts:
            if self.live(frame) is False:
                return  # the rest is dead code on every path
            self._stmt(stmt, frame)

    def _stmt(self, s: ast.stmt, frame: Frame) -> None:
        if isinstance(s, ast.Assign):
            value = self.eval(s.value, frame)
            for target in s.targets:
                self._assign(target, value, frame)
        elif isinstance(s, ast.AnnAssign):
            if s.value is None:
                raise self.src.error(s, "a declaration without a value is not SelIR")
            self._assign(s.target, self.eval(s.value, frame), frame)
        elif isinstance(s, ast.AugAssign):
            (name,) = self._target_names(s.target)  # Python admits no tuple here
            old = self._lookup(name.id, frame, s.target)
            self._assign(s.target, self._binop(BINOPS[type(s.op)], old, self.eval(s.value, frame), s), frame)
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

    def _need_loop(self, frame: Frame, s: ast.stmt) -> None:
        if "$loop" not in frame.env:
            raise self.src.error(s, "`break`/`continue` outside a loop")

    def _assign(self, target: ast.AST, value: object, frame: Frame) -> None:
        if isinstance(target, ast.Name):
            self.bind(frame, target.id, value, target)
            return
        names = self._target_names(target)
        if isinstance(value, RecordVal) or not isinstance(value, (tuple, list)) or len(value) != len(names):
            raise self.src.error(target, f"cannot unpack {self._describe(value)} into {len(names)} names")
        for name, item in zip(names, value):
            self.bind(frame, name.id, item, name)

    def _if(self, s: ast.If, frame: Frame) -> None:
        cond = self.eval(s.test, frame)
        if not isinstance(cond, Node):  # branch pruning
            self._block(s.body if cond else s.orelse, frame)
            return
        envs = []
        for arm, arm_cond in ((s.body, cond), (s.orelse, self.not_(cond, s.test))):
            arm_frame = Frame(dict(frame.env), frame.entry_guard, [*frame.branch, arm_cond], frame.scopes,
                               frame.helper)
            self._block(arm, arm_frame)
            envs.append(arm_frame.env)
        then_env, else_env = envs
        for name in sorted(set(then_env) | set(else_env)):
            merged = self.merge(cond, then_env.get(name, UNDEF), else_env.get(name, UNDEF), s)
            if isinstance(merged, Node) and merged.name is None and not name.startswith("$"):
                merged.name = name  # the phi takes the variable's name
            frame.env[name] = merged

    def _for(self, s: ast.For, frame: Frame) -> None:
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

    def _expr_stmt(self, s: ast.Expr, frame: Frame) -> None:
        call = s.value
        if isinstance(call, ast.Constant) and isinstance(call.value, str):
            return  # a docstring
        if isinstance(call, ast.Call) and isinstance(call.func,
                                                     ast.Name) and call.func.id in self.src.functions:
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
                                 guard is True))

    def _inline(self, name: str, e: ast.Call, frame: Frame) -> object:
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
        callee = Frame(env={**bound, "$returned": False}, entry_guard=self.guard(frame), helper=name)
        self._stack.append(name)
        try:
            self._block(fn.body, callee)
        finally:
            self._stack.pop()
        result = callee.env.get("$ret", UNDEF)
        if result is UNDEF:
            raise self.src.error(fn, f"helper `{name}` returns no value")
        return result

    def _describe(self, v: object) -> str:
        return "a runtime value" if isinstance(v, Node) else f"a {type(v).__name__}"


def partial_evaluate(src: Source, fn_name: str, facts: object) -> IRProgram:
    """Pass: partial evaluation of `fn_name` with `facts`."""
    return PartialEvaluator(src, fn_name, facts).run()
