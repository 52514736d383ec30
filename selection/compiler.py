"""`solve()`: a SelIR program and its deployment facts -> pins, legal values and a compiled selector.

The compiler is a flat list of passes (see `solve`):

    parse -> inline -> partial evaluation (gated SSA DAG) -> simplify -> dependence graph (networkx, with
    control-dependence edges) -> taint -> cut -> VRA -> codegen

Ablations: `constant-folding-only` skips the range-based simplification; `no-cut` pins every batch-dependent
selection point itself instead of solving the cut. The JIT cache is consulted first: a hit skips every pass.
"""

from __future__ import annotations

import ast
import dataclasses
import itertools
import os
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from detent_audit.selection import cut as cut_pass
from detent_audit.selection.cache import JitCache, cache_key
from detent_audit.selection.errors import IllegalAssignment, SelIRError
from detent_audit.selection.frontend import Source, check_grammar, source_of_function
from detent_audit.selection.graph import DependenceGraph, build_graph
from detent_audit.selection.intervals import Interval
from detent_audit.selection.ir import Node, Op, toposort
from detent_audit.selection.partial_eval import partial_evaluate
from detent_audit.selection.pe_values import IRProgram, check_program
from detent_audit.selection.selector import CompiledSelector, SelectorTemplate, make_template
from detent_audit.selection.simplify import domain_checks, input_domains, simplify
from detent_audit.selection.vra import (
    MAX_ASSIGNMENTS,
    SAMPLED_POINTS,
    VRA_SEED,
    AxisValues,
    KnobInfo,
    LegalGroup,
    Value,
    VraResult,
    analyse,
)

COMPILER_VERSION = "selir-2"
ABLATIONS = ("constant-folding-only", "no-cut")


def debug_enabled() -> bool:
    """The IR checker runs between passes when DETENT_AUDIT_DEBUG=1 (the tests set it)."""
    return os.environ.get("DETENT_AUDIT_DEBUG") == "1"


@dataclass(frozen=True, slots=True)
class SolvedPin:
    """A pin as reported: where it is, the values it takes (candidates) and those some legal row uses."""

    name: str
    line: int
    candidates: tuple[Value, ...]
    legal_values: tuple[Value, ...]

    def as_dict(self) -> dict[str, object]:
        return {"name": self.name, "line": self.line, "candidates": list(self.candidates),
                "legal_values": list(self.legal_values)}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> SolvedPin:
        return cls(d["name"], d["line"], tuple(d["candidates"]), tuple(d["legal_values"]))


@dataclass(frozen=True, slots=True)
class FoldedConstant:
    """A value the cut chose that has one candidate: substituted as a constant, not pinned."""

    name: str
    line: int
    value: Value

    def as_dict(self) -> dict[str, object]:
        return {"name": self.name, "line": self.line, "value": self.value}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> FoldedConstant:
        return cls(d["name"], d["line"], d["value"])


@dataclass(frozen=True, slots=True)
class SolveResult:
    """What `detent-audit solve` reports for one program, plus what a selector needs. `to_json()` is the
    JSON the JIT cache stores and `from_json()` reads back; `report()` is what `solve --json` prints."""

    family: str
    program: str
    filename: str
    ablation: str | None
    num_values: int
    selection_points: tuple[str, ...]
    batch_dependent_points: tuple[str, ...]
    pins: tuple[SolvedPin, ...]
    knobs: tuple[KnobInfo, ...]
    candidate_count: int
    legal_count: int
    legal_groups: tuple[LegalGroup, ...]  # independent groups; legal = legal in every group
    default: AxisValues | None
    points_tried: int
    exhaustive: bool
    template: dict[str, object]           # SelectorTemplate.to_json()
    constants: tuple[FoldedConstant, ...] = ()
    solve_seconds: float = 0.0
    cache: str = "miss"
    result_cls: type | None = field(default=None, repr=False, compare=False)

    @property
    def axes(self) -> list[str]:
        return [p.name for p in self.pins] + [k.name for k in self.knobs]

    def to_json(self) -> dict[str, object]:
        return {"family": self.family, "program": self.program, "filename": self.filename,
                "ablation": self.ablation, "num_values": self.num_values,
                "selection_points": list(self.selection_points),
                "batch_dependent_points": list(self.batch_dependent_points),
                "pins": [p.as_dict() for p in self.pins], "knobs": [k.as_dict() for k in self.knobs],
                "candidate_count": self.candidate_count, "legal_count": self.legal_count,
                "legal_groups": [g.as_dict() for g in self.legal_groups],
                "default": None if self.default is None else dict(self.default),
                "points_tried": self.points_tried, "exhaustive": self.exhaustive, "template": self.template,
                "constants": [c.as_dict() for c in self.constants], "solve_seconds": self.solve_seconds,
                "cache": self.cache}

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> SolveResult:
        """The inverse of `to_json` (what the JIT cache holds); `result_cls` is not part of it."""
        fields = {f.name for f in dataclasses.fields(cls)} - {"result_cls"}
        remedy = "remove the JIT cache directory; it is rebuilt on the next solve"
        if set(d) != fields:
            raise SelIRError(f"a cached solve has fields {sorted(set(d) ^ fields)} out of place",
                             remedy=remedy)
        try:
            return cls._from_fields(d)
        except (KeyError, TypeError, ValueError) as exc:
            raise SelIRError(f"a cached solve does not read as a result: {exc!r}", remedy=remedy) from None

    @classmethod
    def _from_fields(cls, d: Mapping[str, Any]) -> SolveResult:
        return cls(
            family=d["family"], program=d["program"], filename=d["filename"], ablation=d["ablation"],
            num_values=d["num_values"], selection_points=tuple(d["selection_points"]),
            batch_dependent_points=tuple(d["batch_dependent_points"]),
            pins=tuple(SolvedPin.from_dict(p) for p in d["pins"]),
            knobs=tuple(KnobInfo.from_dict(k) for k in d["knobs"]),
            candidate_count=d["candidate_count"], legal_count=d["legal_count"],
            legal_groups=tuple(LegalGroup.from_dict(g) for g in d["legal_groups"]),
            default=None if d["default"] is None else dict(d["default"]), points_tried=d["points_tried"],
            exhaustive=d["exhaustive"], template=d["template"],
            constants=tuple(FoldedConstant.from_dict(c) for c in d["constants"]),
            solve_seconds=d["solve_seconds"], cache=d["cache"])

    def report(self) -> dict[str, object]:
        """The user-facing summary (no template, no assignment list)."""
        d = self.to_json()
        d.pop("template")
        d.pop("legal_groups")
        return d

    def is_legal(self, assignment: Mapping[str, object]) -> bool:
        if set(assignment) != set(self.axes):
            return False
        return all(g.admits(assignment) for g in self.legal_groups)

    def legal_assignments(self) -> Iterator[AxisValues]:
        """Every legal assignment (the product of the groups' rows), in a fixed order."""
        axes = self.axes
        for combo in itertools.product(*(g.rows for g in self.legal_groups)):
            out: AxisValues = {}
            for g, row in zip(self.legal_groups, combo):
                out.update(zip(g.axes, row))
            yield {a: out[a] for a in axes}

    def selector(self, assignment: Mapping[str, object] | None = None) -> CompiledSelector:
        """The compiled selector for `assignment` (default: the solve's default assignment)."""
        if assignment is None:
            if self.default is None:
                raise IllegalAssignment(f"{self.program}: no legal assignment exists for this deployment",
                                        remedy="check the deployment facts; see the failing require")
            assignment = self.default
        elif not self.is_legal(assignment):
            raise IllegalAssignment(f"{self.program}: {dict(assignment)} is not a legal assignment of "
                                    f"{self.axes}", remedy="run `detent-audit solve` for the legal values")
        pins = {p.name: assignment[p.name] for p in self.pins}
        knobs = {k.name: assignment[k.name] for k in self.knobs}
        if self.result_cls is None:
            raise SelIRError(f"{self.program}: this result has no @record class (made by from_json, "
                             "not solve)",
                             remedy="get the result from solve(), which attaches the program's record class")
        return CompiledSelector(SelectorTemplate.from_json(self.template), self.result_cls, pins, knobs,
                                self.family)

    def repin(self, selector: CompiledSelector, **values: object) -> CompiledSelector:
        """Swap pin/knob constants of `selector` (checked legal) without solving again."""
        pin_names = {p.name for p in self.pins}
        pins = {k: v for k, v in values.items() if k in pin_names}
        knobs = {k: v for k, v in values.items() if k not in pin_names}
        return selector.repin(pins, knobs, legal=lambda p, k: self.is_legal({**p, **k}))


def _facts_json(facts: object) -> object:
    if dataclasses.is_dataclass(facts):
        return {"__record__": type(facts).__name__,
                **{f.name: _facts_json(getattr(facts, f.name)) for f in dataclasses.fields(facts)}}
    if isinstance(facts, dict):
        return {"__table__": sorted([repr(k), _facts_json(v)] for k, v in facts.items())}
    if isinstance(facts, (list, tuple)):
        return [_facts_json(x) for x in facts]
    if isinstance(facts, float):
        return {"__float__": repr(facts)}
    return facts


def solve(program: Callable[..., object] | tuple[Source, str], facts: object, *, ablation: str | None = None,
          cache: JitCache | None = None, family: str | None = None, debug: bool | None = None) -> SolveResult:
    """Solve one program for one facts record; consult and fill `cache` when given."""
    if ablation is not None and ablation not in ABLATIONS:
        raise SelIRError(f"unknown ablation {ablation!r}", remedy=f"choose one of {', '.join(ABLATIONS)}")
    t0 = time.perf_counter()
    src, name = program if isinstance(program, tuple) else (source_of_function(program), program.__name__)
    fn_obj = src.namespace.get(name)
    family = family or str(getattr(fn_obj, "__selir_family__", name))
    key = cache_key({"compiler": COMPILER_VERSION, "source": src.text, "program": name,
                     "facts": _facts_json(facts), "ablation": ablation, "cut": cut_pass.CUT_WEIGHTS_VERSION,
                     "vra": [SAMPLED_POINTS, MAX_ASSIGNMENTS, VRA_SEED], "family": family})
    if cache is not None:
        body = cache.get(key)
        if body is not None:
            try:
                cached = SolveResult.from_json(body)
            except SelIRError:
                cache.discard(key)  # a bad entry is never trusted: solve again
            else:
                return dataclasses.replace(cached, cache="hit", result_cls=_result_cls(src, name),
                                           solve_seconds=time.perf_counter() - t0)
        status = cache.last_status
    else:
        status = "off"

    c = compile_passes(src, name, facts, ablation=ablation, debug=debug)
    prog, dg, tainted, vra, template = c.prog, c.graph, c.taint, c.vra, c.template
    result = SolveResult(
        family=family, program=name, filename=src.filename, ablation=ablation, num_values=dg.num_values,
        selection_points=tuple(prog.outputs), batch_dependent_points=tainted.leaking_points,
        pins=tuple(SolvedPin(p.name, p.line, p.candidates, p.legal_values) for p in vra.pins),
        knobs=vra.knobs, candidate_count=vra.candidate_count, legal_count=vra.legal_count,
        legal_groups=vra.groups, default=vra.default, points_tried=vra.points_tried,
        exhaustive=vra.exhaustive, template=template.to_json(), constants=tuple(c.folded),
        solve_seconds=time.perf_counter() - t0)
    if cache is not None:
        cache.put(key, result.to_json())
    return dataclasses.replace(result, cache=status, result_cls=prog.result_cls)


@dataclass(frozen=True, slots=True)
class Compilation:
    """Every artifact of the passes, for tests and debugging."""

    prog: IRProgram
    domains: dict[str, Interval]
    graph: DependenceGraph
    taint: cut_pass.Taint
    cut: cut_pass.Cut
    pin_names: list[str]
    vra: VraResult
    template: SelectorTemplate
    folded: list[FoldedConstant] = field(default_factory=list)  # one-candidate pins, substituted as constants

    @property
    def pins(self) -> tuple[Node, ...]:
        return self.cut.pins


def compile_passes(src: Source, name: str, facts: object, *, ablation: str | None = None,
                   debug: bool | None = None) -> Compilation:
    """The passes, in order, without the cache; with `debug` the IR checker runs after every pass."""
    debug = debug_enabled() if debug is None else debug
    # parse: the grammar of the program (helpers are checked when inlined)
    if name in src.functions:
        check_grammar(src, src.functions[name])
    # inline: resolve the helpers the program calls; refuse recursion before expanding anything
    _check_call_graph(src, name)
    # partial evaluation: fold facts, prune branches, unroll loops, look up tables, inline helpers
    prog = partial_evaluate(src, name, facts)
    _checked(debug, prog, "partial evaluation")
    domains = input_domains(prog)
    # simplify: range-based folding of comparisons, selects, min/max and lookups; dead code
    ranges = ablation != "constant-folding-only"
    prog = simplify(prog, domains, ranges=ranges)
    _checked(debug, prog, "simplify")
    folded: list[FoldedConstant] = []
    while True:
        # dependence graph: SSA values, data and control-dependence edges
        dg = build_graph(prog)
        if debug:
            dg.check_integrity()
        # taint: values reachable from batch-dependent inputs
        tainted = cut_pass.taint(dg)
        # cut: the fewest pins nearest the selection points (or, ablated, the selection points themselves)
        cut = (cut_pass.pin_selection_points(dg, tainted) if ablation == "no-cut"
               else cut_pass.min_cut(dg, tainted, _checked_inputs(prog)))
        pins = list(cut.pins)
        pin_names = _unique_names(pins)
        # VRA: candidates and legal assignments
        vra = analyse(prog, pins, domains, pin_names)
        # fold: a pin with one candidate is a constant; substitute it, simplify, cut again
        single = {p.node_id: p for p in vra.pins if len(p.candidates) == 1}
        if not single:
            break
        folded += [FoldedConstant(p.name, p.line, p.candidates[0]) for p in single.values()]
        prog = simplify(prog, domains, fixed={i: p.candidates[0] for i, p in single.items()}, ranges=ranges)
        _checked(debug, prog, "constant pins")
    # codegen: the selector template with pins and knobs as placeholders
    template = make_template(prog, pins, pin_names)
    return Compilation(prog, domains, dg, tainted, cut, pin_names, vra, template, folded)


def _checked(debug: bool, prog: IRProgram, after: str) -> None:
    if debug:
        check_program(prog, after)


def _checked_inputs(prog: IRProgram) -> frozenset[int]:
    """Inputs a require/assume (other than a domain bound) depends on: the check must see them as they are."""
    domain = set(domain_checks(prog))
    roots = [c.cond for i, c in enumerate(prog.checks) if i not in domain and isinstance(c.cond, Node)]
    return frozenset(n.id for n in toposort(roots) if n.op is Op.INPUT)


def _result_cls(src: Source, name: str) -> type:
    fn = src.functions[name]
    ann = fn.returns
    if isinstance(ann, ast.Constant) and isinstance(ann.value, str):
        ann = ast.parse(ann.value, mode="eval").body
    cls = src.namespace.get(ann.id) if isinstance(ann, ast.Name) else None
    if not isinstance(cls, type):
        raise SelIRError(f"program `{name}` must annotate its @record return type")
    return cls


def _check_call_graph(src: Source, root: str) -> None:
    functions = src.functions
    visiting: list[str] = []
    done: set[str] = set()

    def visit(name: str) -> None:
        if name in done:
            return
        visiting.append(name)
        for node in ast.walk(functions[name]):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in functions:
                callee = node.func.id
                if callee in visiting:
                    raise src.error(node, f"helper `{callee}` is recursive: SelIR inlines helpers")
                check_grammar(src, functions[callee])
                visit(callee)
        visiting.pop()
        done.add(name)

    if root not in functions:
        raise SelIRError(f"no function `{root}` in {src.filename}")
    visit(root)


def _unique_names(pins: list[Node]) -> list[str]:
    labels = [p.label for p in pins]
    names = []
    for p, label in zip(pins, labels):
        names.append(label if labels.count(label) == 1 else f"{label}@{p.line}")
    if len(set(names)) != len(names):
        names = [f"{n}#{p.id}" for n, p in zip(names, pins)]
    return names
