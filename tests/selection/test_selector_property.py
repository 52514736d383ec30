"""Property: for every legal assignment, the compiled selector's selection points are the same at every
runtime input, never raise, and equal the unpinned program (run as plain Python) wherever the unpinned
program's pinned values equal the assignment. Programs are generated at random."""

from __future__ import annotations

import itertools

from hypothesis import HealthCheck, event, given, reject, settings
from hypothesis import strategies as st

from detent_audit.selection.codegen import builtins_namespace, compile_function, emit
from detent_audit.selection.compiler import compile_passes, solve
from detent_audit.selection.errors import SelIRError
from detent_audit.selection.frontend import source_from_text
from detent_audit.selection.lang import SelectionFailure

HEADER = '''from __future__ import annotations
from detent_audit.selection.lang import Runtime, Request, knob, require, assume, cdiv, clamp, record

@record
class Facts:
    a: int
    b: int

@record
class Choice:
{fields}
'''


@st.composite
def programs(draw: st.DrawFn) -> tuple[str, int]:
    num_inputs = draw(st.integers(1, 3))
    inputs = [f"r{i}" for i in range(num_inputs)]
    hi = draw(st.integers(3, 9))
    names = list(inputs) + ["d.a", "d.b"]
    body = [f"    assume(1 <= {r} <= {hi}, 'bounded')" for r in inputs]
    has_knob = draw(st.booleans())
    if has_knob:
        body.append("    kn = knob('stride', (1, 2, 4), 2)")
        names.append("kn")

    def atom() -> str:
        return draw(st.sampled_from(names + [str(draw(st.integers(0, 6)))]))

    for i in range(draw(st.integers(2, 7))):
        kind = draw(st.sampled_from(["arith", "minmax", "cdiv", "ifexp", "if", "clamp"]))
        x, y = atom(), atom()
        if kind == "arith":
            expr = f"{x} {draw(st.sampled_from(['+', '-', '*']))} {y}"
        elif kind == "minmax":
            expr = f"{draw(st.sampled_from(['min', 'max']))}({x}, {y})"
        elif kind == "cdiv":
            expr = f"cdiv({x}, max(1, {y}))"
        elif kind == "clamp":
            expr = f"clamp({x}, 1, {draw(st.integers(2, 8))})"
        elif kind == "ifexp":
            expr = f"{x} if {y} {draw(st.sampled_from(['<', '>=', '==']))} {atom()} else {atom()}"
        if kind == "if":
            c = f"{x} {draw(st.sampled_from(['<', '>=', '!=']))} {y}"
            body += [f"    if {c}:", f"        v{i} = {atom()}", "    else:", f"        v{i} = {atom()} + 1"]
        else:
            body.append(f"    v{i} = {expr}")
        names.append(f"v{i}")
        if draw(st.integers(0, 4)) == 0:
            body.append(f"    require(v{i} <= {draw(st.integers(3, 30))}, 'limit {i}')")
    num_fields = draw(st.integers(1, 3))
    produced = [n for n in names if n.startswith("v")]
    fields = [draw(st.sampled_from(produced)) for _ in range(num_fields)]
    body.append("    return Choice(" + ", ".join(f"f{j}={v}" for j, v in enumerate(fields)) + ")")
    params = ", ".join(["d: Facts"] + [f"{r}: Runtime[int]" for r in inputs])
    text = (HEADER.format(fields="\n".join(f"    f{j}: int" for j in range(num_fields)))
            + f"\ndef prog({params}) -> Choice:\n" + "\n".join(body) + "\n")
    return text, hi


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(programs(), st.integers(1, 5), st.integers(1, 5))
def test_pinned_selector_is_constant_and_agrees_with_the_program(prog_and_hi: tuple[str, int], a: int,
                                                                  b: int) -> None:
    text, hi = prog_and_hi
    src = source_from_text(text, filename="<random>")
    facts = src.namespace["Facts"](a=a, b=b)
    python_prog = src.namespace["prog"]
    try:
        comp = compile_passes(src, "prog", facts)
    except SelIRError as exc:  # a require on facts alone that these facts break: a valid refusal
        assert "never holds for this deployment" in str(exc)
        reject()
    result = solve((src, "prog"), facts)
    event(f"pins={len(comp.pins)} legal={min(result.legal_count, 5)}")
    assert result.legal_count == sum(1 for _ in result.legal_assignments())
    inputs = [i.name for i in comp.prog.inputs]
    points = list(itertools.product(range(1, hi + 1), repeat=len(inputs)))
    # the unpinned values of the pins at each point, from the IR (the pins' own nodes)
    knob_names = sorted(comp.prog.knobs)
    em = emit(comp.pins, input_names={n: n for n in inputs}, knob_names={k: k for k in knob_names},
              pin_names={})
    pin_exprs = ", ".join(em.names[p.id] for p in comp.pins)
    pin_fn = compile_function(
        f"def _pins({', '.join(inputs + knob_names)}):\n    " + ("\n    ".join(em.lines) or "pass")
        + f"\n    return ({pin_exprs}{',' if comp.pins else ''})\n", "_pins",
        {**builtins_namespace(), **em.consts}, "<pins>")
    from detent_audit.selection.lang import knob_settings

    for assignment in result.legal_assignments():
        sel = result.selector(assignment)
        outputs = {sel(*pt) for pt in points}  # never raises: the assignment is legal
        if not result.batch_dependent_points:
            continue
        # with only Runtime inputs, a pinned selector is constant over the whole domain
        assert len(outputs) == 1, (text, assignment, outputs)
        knob_values = {k: assignment[k] for k in knob_names}
        pins_wanted = tuple(assignment[n] for n in result.axes[: len(comp.pins)])
        for pt in points:
            if pin_fn(*pt, *(knob_values[k] for k in knob_names)) != pins_wanted:
                continue
            with knob_settings(knob_values):
                try:
                    expected = python_prog(facts, *pt)
                except SelectionFailure:
                    continue
            assert sel(*pt) == expected, (text, assignment, pt)
