"""Every construct outside the SelIR grammar is rejected at its exact location."""

from __future__ import annotations

import pytest

from detent_audit.selection.compiler import solve
from detent_audit.selection.errors import SelIRError
from detent_audit.selection.frontend import source_from_text

HEADER = '''from __future__ import annotations
from detent_audit.selection.lang import Runtime, Unpinnable, Request, knob, require, assume, cdiv, record

@record
class Facts:
    n: int
    table: tuple

@record
class Choice:
    a: int

def helper(x):
    return x + 1

def prog(d: Facts, m: Runtime[int]) -> Choice:
    assume(1 <= m <= 64, "bounded")
    x = m
'''
# the offending statement is line 19, indented 4 spaces: (statement, column of the caret, message part)
FORBIDDEN = [
    ("while x < 3:\n        x = x + 1", 4, "`while` loops are not SelIR"),
    ("try:\n        x = 1\n    except Exception:\n        x = 2", 4, "`try` is not SelIR"),
    ("with x:\n        pass", 4, "`with` is not SelIR"),
    ("f = lambda y: y", 8, "`lambda` is not SelIR"),
    ("def inner(y):\n        return y", 4, "nested functions are not SelIR"),
    ("class K:\n        pass", 4, "classes inside a program are not SelIR"),
    ("global y", 4, "`global` is not SelIR"),
    ("import math", 4, "imports inside a program are not SelIR"),
    ("del x", 4, "`del` is not SelIR"),
    ("assert x > 0", 4, "`assert` is not SelIR"),
    ("x = f'{m}'", 8, "f-strings are not SelIR"),
    ("x = (y := 3)", 9, "`:=` is not SelIR"),
    ("x = {k: 1 for k in range(3)}", 8, "dict comprehensions are not SelIR"),
    ("x = {1, 2}", 8, "set literals are not SelIR"),
    ("x = {1: 2}", 8, "dict literals are not SelIR"),
    ("raise ValueError('no')", 4, "`raise` is not SelIR"),
    ("x = m & 3", 8, "bitwise operators are not SelIR"),
    ("x = m << 1", 8, "shifts are not SelIR"),
    ("x = m is None", 8, "`is` is not SelIR"),
    ("x = m in (1, 2)", 8, "`in` is not SelIR"),
    ("x = m.bit_length()", 8, "method calls are not SelIR"),
    ("d.n = 3", 4, "assigning to an attribute is not SelIR"),
    ("x[0] = 3", 4, "assigning to an element is not SelIR"),
    ("x = helper(*[m])", 15, "star arguments are not SelIR"),
    ("for i in range(3):\n        x = i\n    else:\n        x = 0", 8, "`for ... else` is not SelIR"),
]


def _program(stmt: str) -> str:
    return HEADER + "    " + stmt + "\n    return Choice(a=x)\n"


@pytest.mark.parametrize(("stmt", "col", "message"), FORBIDDEN, ids=[f[2][:30] for f in FORBIDDEN])
def test_each_forbidden_construct_is_rejected_with_its_location(stmt: str, col: int, message: str) -> None:
    src = source_from_text(_program(stmt), filename="prog.py")
    with pytest.raises(SelIRError) as info:
        solve((src, "prog"), src.namespace["Facts"](n=3, table=(1, 2)))
    text = str(info.value)
    line = 19 + (3 if message.startswith("`for ... else`") else 0)  # the header is 18 lines
    assert text.startswith(f"prog.py:{line}:{col + 1}: {message}"), text
    src_line = _program(stmt).splitlines()[line - 1]
    assert f"\n    {src_line}\n    {' ' * col}^" in text


@pytest.mark.parametrize(("stmt", "message"), [
    ("for i in range(m):\n        x = i", "`range` needs a static argument"),
    ("for j in x:\n        x = j", "a SelIR loop runs over a static collection"),
    ("x = [i for i in range(4) if i < m]", "a comprehension filter must be static"),
    ("x = d.table[m] + d.missing", "Facts has no field `missing`"),
    ("x = undefined_name", "undefined name `undefined_name`"),
    ("require(m > 0, 'msg' + 'x')", "the message of require must be a string literal"),
    ("x = require(m > 0, 'msg')", "require is a statement, not a value"),
    ("m + 1", "an expression statement has no effect"),
    ("require(d.n > 5, 'n too small')", "require never holds for this deployment: n too small"),
])
def test_analysis_errors_are_located(stmt: str, message: str) -> None:
    src = source_from_text(_program(stmt), filename="prog.py")
    with pytest.raises(SelIRError) as info:
        solve((src, "prog"), src.namespace["Facts"](n=3, table=(1, 2)))
    assert message in str(info.value)
    assert str(info.value).startswith("prog.py:19:"), str(info.value)


def test_recursive_helper_is_rejected() -> None:
    text = HEADER.replace("return x + 1", "return helper(x)") + "    return Choice(a=helper(x))\n"
    src = source_from_text(text, filename="prog.py")
    with pytest.raises(SelIRError, match="helper `helper` is recursive"):
        solve((src, "prog"), src.namespace["Facts"](n=3, table=(1, 2)))


def test_unbounded_runtime_input_is_reported() -> None:
    text = HEADER.replace('    assume(1 <= m <= 64, "bounded")\n', "") + "    return Choice(a=x)\n"
    src = source_from_text(text, filename="prog.py")
    with pytest.raises(SelIRError, match="runtime input `m` has no bounds") as info:
        solve((src, "prog"), src.namespace["Facts"](n=3, table=(1, 2)))
    assert "assume(lo <= m <= hi" in info.value.diagnostics()


def test_syntax_error_is_a_selir_error() -> None:
    with pytest.raises(SelIRError, match=r"prog.py:19:\d+: syntax error"):
        source_from_text(_program("x = = 3"), filename="prog.py")


def test_an_unconditional_helper_assume_bounds_the_domain_a_conditional_one_does_not() -> None:
    bounded_helper = 'def helper(x):\n    assume(1 <= x <= 64, "bounded")\n    return x + 1'
    base = HEADER.replace('    assume(1 <= m <= 64, "bounded")\n', "").replace(
        "def helper(x):\n    return x + 1", bounded_helper)
    src = source_from_text(base + "    y = helper(m)\n    return Choice(a=y)\n", filename="prog.py")
    result = solve((src, "prog"), src.namespace["Facts"](n=3, table=(1, 2)))
    assert result.points_tried == 64 and result.exhaustive
    cond = source_from_text(base + "    y = helper(m) if m > 3 else 0\n    return Choice(a=y)\n",
                            filename="prog.py")
    with pytest.raises(SelIRError, match="runtime input `m` has no bounds"):
        solve((cond, "prog"), cond.namespace["Facts"](n=3, table=(1, 2)))
