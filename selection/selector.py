"""Compiled selectors: generated Python with the pins (and knobs) as literal constants.

A selector is called at every kernel launch with the call's runtime inputs and returns the program's result
record. Each new combination of inputs is evaluated once: its require/assume checks run, and the result is
memoised; a violation raises `SelectionViolation` (and is never memoised), so the engine stops rather than
launch a kernel the solve did not cover. A new batch never recompiles; `repin` swaps constants by
regenerating the source from the template, without solving.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from detent_audit.selection.codegen import builtins_namespace, compile_function, emit, literal
from detent_audit.selection.errors import IllegalAssignment, SelectionViolation
from detent_audit.selection.ir import Node
from detent_audit.selection.pe_values import IRProgram, Table
from detent_audit.selection.simplify import domain_checks

MEMO_LIMIT = 1 << 16


@dataclass(frozen=True)
class SelectorTemplate:
    """Everything needed to build a selector without the IR: stored in the JIT cache."""

    program: str
    source: str                       # with __PIN_i__ / __KNOB_j__ placeholders
    consts: dict[str, str]            # name -> repr of a static value
    inputs: tuple[str, ...]
    pin_names: tuple[str, ...]
    knob_names: tuple[str, ...]
    checks: tuple[tuple[str, str, int], ...]  # (kind, message, line)

    def to_json(self) -> dict:
        return {"program": self.program, "source": self.source, "consts": dict(sorted(self.consts.items())),
                "inputs": list(self.inputs), "pin_names": list(self.pin_names),
                "knob_names": list(self.knob_names), "checks": [list(c) for c in self.checks]}

    @classmethod
    def from_json(cls, d: dict) -> SelectorTemplate:
        return cls(d["program"], d["source"], dict(d["consts"]), tuple(d["inputs"]), tuple(d["pin_names"]),
                   tuple(d["knob_names"]), tuple((k, m, int(ln)) for k, m, ln in d["checks"]))


def make_template(prog: IRProgram, pins: Sequence[Node], pin_names: Sequence[str]) -> SelectorTemplate:
    """Pass: codegen of the pinned program."""
    inputs = tuple(i.name for i in prog.inputs)
    knob_names = tuple(sorted(prog.knobs))
    domain = set(domain_checks(prog))
    bounds = [c for i, c in enumerate(prog.checks) if i in domain]
    checks = bounds + [c for i, c in enumerate(prog.checks) if i not in domain and isinstance(c.cond, Node)]
    outputs = {k: v for k, v in prog.outputs.items() if isinstance(v, Node)}
    consts: dict[str, object] = {}
    # the domain bounds read the real inputs, even an input the cut pinned
    dom = emit([c.node for c in bounds], input_names={n: n for n in inputs}, knob_names={}, pin_names={},
               consts=consts, prefix="d")
    em = emit([*outputs.values(), *(c.node for c in checks[len(bounds):])],
              input_names={n: n for n in inputs},
              knob_names={k: f"__KNOB_{j}__" for j, k in enumerate(knob_names)},
              pin_names={p.id: f"__PIN_{i}__" for i, p in enumerate(pins)}, consts=consts)
    key = f"({', '.join(inputs)}{',' if len(inputs) == 1 else ''})"
    lines = [f"def _selector({', '.join(inputs)}):",
             f"    _key = {key}",
             "    _hit = _memo.get(_key)",
             "    if _hit is not None:",
             "        return _hit"]
    lines += [f"    {ln}" for ln in dom.lines + em.lines]
    for i, c in enumerate(checks):
        name = (dom if i < len(bounds) else em).names[c.node.id]
        lines += [f"    if _failed({name}):", f"        _violation({i}, _key)"]
    for k, v in outputs.items():
        if em.names[v.id].startswith("v"):  # a computed value (pins and constants are literals)
            lines += [f"    if {em.names[v.id]} is _POISON:", f"        _undefined({k!r}, _key)"]
    fields = ", ".join(f"{k}={em.names[v.id] if isinstance(v, Node) else literal(v, consts)}"
                       for k, v in prog.outputs.items())
    lines += [f"    _r = _Result({fields})",
              f"    if len(_memo) >= {MEMO_LIMIT}:",
              "        _memo.clear()",
              "    _memo[_key] = _r",
              "    return _r"]
    return SelectorTemplate(prog.name, "\n".join(lines) + "\n", {k: repr(v) for k, v in consts.items()},
                            inputs, tuple(pin_names), knob_names,
                            tuple((c.kind, c.msg, c.line) for c in checks))


def _restore(text: str) -> object:
    return eval(text, {"__builtins__": {}}, {"Table": Table, "inf": math.inf, "nan": math.nan})  # noqa: S307


class CompiledSelector:
    """A program's selector with every pin and knob fixed. Call it with the runtime inputs."""

    def __init__(self, template: SelectorTemplate, result_cls: type, pins: Mapping[str, object],
                 knobs: Mapping[str, object], family: str = "") -> None:
        self.template, self.result_cls, self.family = template, result_cls, family
        self.pins, self.knobs = dict(pins), dict(knobs)
        source = template.source
        for i, name in enumerate(template.pin_names):
            source = source.replace(f"__PIN_{i}__", _spell(self.pins[name]))
        for j, name in enumerate(template.knob_names):
            source = source.replace(f"__KNOB_{j}__", _spell(self.knobs[name]))
        self.source = source
        self._memo: dict[tuple, object] = {}
        ns = {**builtins_namespace(), **{k: _restore(v) for k, v in template.consts.items()},
              "_Result": result_cls, "_memo": self._memo, "_violation": self._violation,
              "_undefined": self._undefined}
        self._fn = compile_function(source, "_selector", ns, f"<selector {template.program}>")

    def __call__(self, *args: object, **kwargs: object) -> object:
        return self._fn(*args, **kwargs)

    @property
    def fn(self) -> Callable[..., object]:
        """The raw generated function (positional inputs in program order), for hot paths."""
        return self._fn

    def _violation(self, index: int, key: tuple) -> None:
        kind, msg, line = self.template.checks[index]
        raise SelectionViolation(self.template.program, f"{kind}: {msg}", line,
                                 dict(zip(self.template.inputs, key)), {**self.pins, **self.knobs})

    def _undefined(self, field: str, key: tuple) -> None:
        raise SelectionViolation(self.template.program, f"selection point `{field}` is undefined (its "
                                 "computation raised)", 0, dict(zip(self.template.inputs, key)),
                                 {**self.pins, **self.knobs})

    def repin(self, pins: Mapping[str, object] | None = None, knobs: Mapping[str, object] | None = None,
              legal: Callable[[dict, dict], bool] | None = None) -> CompiledSelector:
        """A selector with some pins/knobs replaced (no solving); `legal` vetoes illegal assignments."""
        new_pins = {**self.pins, **(pins or {})}
        new_knobs = {**self.knobs, **(knobs or {})}
        unknown = sorted(set(new_pins) - set(self.pins)) + sorted(set(new_knobs) - set(self.knobs))
        if unknown:
            raise IllegalAssignment(f"{self.template.program}: no pin or knob named {unknown}")
        if legal is not None and not legal(new_pins, new_knobs):
            raise IllegalAssignment(f"{self.template.program}: the assignment {new_pins | new_knobs} is not "
                                    "legal", remedy="choose values from `detent-audit solve`'s legal values")
        return CompiledSelector(self.template, self.result_cls, new_pins, new_knobs, self.family)


def _spell(value: object) -> str:
    text = literal(value, {})
    if text.startswith("_c"):
        raise IllegalAssignment(f"pin value {value!r} has no literal form")
    return text
