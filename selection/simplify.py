"""Input domains from `assume`, and range-based simplification of the dependence DAG.

`input_domains` reads the bounds each top-level `assume` puts on a runtime input. `simplify` computes an
interval per node over those domains and folds what the intervals decide: comparisons that always hold (or
never do), SELECTs whose condition is decided, `min`/`max` arguments that can never win, `and`/`or` whose
first operand's truth is decided (or, for booleans, either operand's), table lookups whose key is decided.
Nodes that no root reads disappear (dead code). The assumes that define the domains are kept verbatim: they
are what the selector checks.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import replace

from detent_audit.selection.intervals import Interval, interval_of
from detent_audit.selection.ir import Node, Op, is_boolean, toposort
from detent_audit.selection.lang import BUILTINS, nearest
from detent_audit.selection.pe_values import PY_OPS, UNARY_OPS, Check, IRProgram, static_lookup

_KEEP = object()  # "keep the operation" (None is a value a node may fold to)
_FLIP = {"<": ">", "<=": ">=", ">": "<", ">=": "<=", "==": "==", "!=": "!="}


def _conjuncts(node: object) -> list[Node]:
    if isinstance(node, Node) and node.op is Op.AND:
        return _conjuncts(node.src[0]) + _conjuncts(node.src[1])
    return [node] if isinstance(node, Node) else []


def domain_checks(prog: IRProgram) -> list[int]:
    """Indices of the top-level assumes that bound an input (kept verbatim by simplification)."""
    return [i for i, c in enumerate(prog.checks) if c.kind == "assume" and c.top_level
            and any(_bound(n) for n in _conjuncts(c.cond))]


def _bound(node: Node) -> tuple[str, str, float] | None:
    """(input name, op, constant) when `node` compares an input with a number, normalised to `x op c`."""
    if node.op is not Op.COMPARE:
        return None
    a, b = node.src
    op = node.arg
    if b.op is Op.INPUT and a.op is Op.CONST:
        a, b, op = b, a, _FLIP[op]
    if a.op is Op.INPUT and b.op is Op.CONST and isinstance(b.arg,
                                                            (int, float)) and not isinstance(b.arg, bool):
        return a.arg[0], op, b.arg
    return None


def input_domains(prog: IRProgram) -> dict[str, Interval]:
    """Integer bounds per input from top-level assumes; inputs without an assume are absent."""
    lo: dict[str, float] = {}
    hi: dict[str, float] = {}
    for i in domain_checks(prog):
        for conj in _conjuncts(prog.checks[i].cond):
            bound = _bound(conj)
            if bound is None:
                continue
            name, op, c = bound
            if op in (">=", ">"):
                v = c + 1 if op == ">" and float(c).is_integer() else c
                lo[name] = max(lo.get(name, v), v)
            elif op in ("<=", "<"):
                v = c - 1 if op == "<" and float(c).is_integer() else c
                hi[name] = min(hi.get(name, v), v)
            elif op == "==":
                lo[name] = max(lo.get(name, c), c)
                hi[name] = min(hi.get(name, c), c)
    return {n: Interval(lo[n], hi[n]) for n in sorted(set(lo) & set(hi))}


def simplify(prog: IRProgram, domains: dict[str, Interval], *, fixed: Mapping[int, object] | None = None,
             ranges: bool = True) -> IRProgram:
    """Pass: range-based folding and dead-code elimination; returns a new IRProgram.

    `fixed`: node id -> a static value that replaces the node (a pin with one candidate is a constant).
    `ranges=False` (the constant-folding-only ablation): only constants are propagated, no intervals.
    """
    fixed = fixed or {}
    keep = set(domain_checks(prog))
    roots = [v for v in prog.outputs.values() if isinstance(v, Node)]
    roots += [c.cond for i, c in enumerate(prog.checks) if i not in keep and isinstance(c.cond, Node)]
    b = prog.builder
    env: dict[int, Interval] = {}
    new: dict[int, object] = {}  # old id -> Node or static value

    def get(n: Node) -> object:
        return new.get(n.id, n)

    for node in toposort(roots):
        src = [get(s) for s in node.src]
        static = [x.arg if isinstance(x, Node) and x.op is Op.CONST else x for x in src]
        if node.id in fixed:
            value = fixed[node.id]
        elif node.src and not any(isinstance(x, Node) for x in static):
            value = _evaluate(node, static)
        else:
            value = _fold(node, src, env, domains) if ranges else _KEEP
        if value is None and node.id not in fixed:
            value = _KEEP
        if value is _KEEP:
            src_nodes = tuple(s if isinstance(s, Node) else b.const(s, node.line, node.col) for s in src)
            value = node if all(x is y for x, y in zip(src_nodes, node.src)) else b.make(
                node.op, node.arg, src_nodes, line=node.line, col=node.col, name=node.name)
        if isinstance(value, Node):
            env[value.id] = interval_of(value, env, domains)
        new[node.id] = value

    outputs = {k: (get(v) if isinstance(v, Node) else v) for k, v in prog.outputs.items()}
    checks: list[Check] = []
    for i, c in enumerate(prog.checks):
        cond = c.cond if i in keep or not isinstance(c.cond, Node) else get(c.cond)
        if isinstance(cond, Node) or not cond:
            checks.append(replace(c, cond=cond))
    return replace(prog, outputs=outputs, checks=checks)


def _evaluate(node: Node, src: list[object]) -> object:
    """`node`'s operation on static arguments (constant propagation); None when it raises (an arm a SELECT
    drops may divide by zero: the node is kept and codegen poisons it), else _KEEP."""
    op, arg = node.op, node.arg
    try:
        if op is Op.UNARY:
            return UNARY_OPS[arg](src[0])
        if op in (Op.BINARY, Op.COMPARE):
            return PY_OPS[arg](src[0], src[1])
        if op is Op.AND:
            return src[0] and src[1]
        if op is Op.OR:
            return src[0] or src[1]
        if op is Op.SELECT:
            return src[1] if src[0] else src[2]
        if op is Op.CALL and arg == "getitem":
            return static_lookup(src[0], src[1])
        if op is Op.CALL:
            return BUILTINS[arg](*src)
    except (ArithmeticError, LookupError, TypeError, ValueError):
        return _KEEP
    return _KEEP


def _fold(node: Node, src: list[object], env: dict[int, Interval], domains: dict[str, Interval]) -> object:
    """A replacement for `node` (an argument node or a static value), or None to keep the operation."""
    def iv(x: object) -> Interval:
        if isinstance(x, Node):
            return env.get(x.id) or interval_of(x, env, domains)
        return Interval(float(x), float(x)) if isinstance(x, (int, float)) else Interval(float("-inf"),
                                                                                        float("inf"))

    op = node.op
    if op is Op.COMPARE or (op is Op.UNARY and node.arg == "not") or (op is Op.CALL and node.arg == "bool"):
        r = _interval_with(node, src, iv, domains)
        return bool(r.lo) if r.is_point else None
    if op is Op.SELECT:
        c = iv(src[0])
        if c.is_point:
            return src[1] if c.lo else src[2]
        if c.lo > 0 or c.hi < 0:
            return src[1]
        return None
    if op in (Op.AND, Op.OR):
        a = iv(src[0])
        truthy = a.lo > 0 or a.hi < 0
        falsy = a.is_point and a.lo == 0
        if truthy:
            return src[1] if op is Op.AND else src[0]
        if falsy:
            return src[0] if op is Op.AND else src[1]
        # the first operand undecided: a decided second operand decides a boolean first one
        if _boolean(src[0]) and _boolean(src[1]):
            b = iv(src[1])
            if b.is_point and b.lo == 0:
                return False if op is Op.AND else src[0]
            if b.is_point and b.lo == 1:
                return src[0] if op is Op.AND else True
        return None
    if op is Op.CALL and node.arg in ("min", "max"):
        ivs = [iv(s) for s in src]
        if node.arg == "min":
            bound = min(i.hi for i in ivs)
            kept = [s for s, i in zip(src, ivs) if not i.lo > bound]
        else:
            bound = max(i.lo for i in ivs)
            kept = [s for s, i in zip(src, ivs) if not i.hi < bound]
        if len(kept) == 1:
            return kept[0]
        return None  # (dropping losers changes nothing observable; keep the node simple)
    if op is Op.CALL and node.arg == "nearest" and (not isinstance(src[0], Node) or src[0].op is Op.CONST):
        keys = src[0].arg if isinstance(src[0], Node) else src[0]
        if not isinstance(keys, (tuple, list)):
            return None
        x = iv(src[1])
        if list(keys) == sorted(keys) and not any(map(_inf, (x.lo, x.hi))):
            lo_key, hi_key = nearest(keys, x.lo), nearest(keys, x.hi)
            if lo_key == hi_key:
                return lo_key
        return None
    if op is Op.CALL and node.arg == "getitem":
        k = iv(src[1])
        if k.is_point and isinstance(node.src[1], Node):
            table = src[0].arg if isinstance(src[0], Node) else src[0]
            key = int(k.lo) if float(k.lo).is_integer() else k.lo
            try:
                return static_lookup(table, key)
            except (KeyError, IndexError, TypeError):
                return None
    return None


def _boolean(x: object) -> bool:
    return isinstance(x, bool) or (isinstance(x, Node) and is_boolean(x))


def _inf(x: float) -> bool:
    return x in (float("inf"), float("-inf"))


def _interval_with(node: Node, src: list[object], iv: Callable[[object], Interval],
                   domains: dict[str, Interval]) -> Interval:
    """The interval of `node`'s operation applied to (possibly rewritten, possibly static) arguments."""
    proxies, env = [], {}
    for i, s in enumerate(src):
        proxy = Node(-1 - i, Op.CONST, None, (), 0, 0, None, "")
        env[proxy.id] = iv(s)
        proxies.append(proxy)
    return interval_of(Node(-100, node.op, node.arg, tuple(proxies), 0, 0, None, ""), env, domains)
