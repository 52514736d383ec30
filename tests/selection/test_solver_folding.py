"""The solver folds what the facts and the input domains decide: booleans from either operand, `%` of a
smaller value, pins with one candidate; the IR checker runs after every pass (DETENT_AUDIT_DEBUG=1 in the
tests, tests/conftest.py)."""

from __future__ import annotations

import pytest

from detent_audit.selection import compiler
from detent_audit.selection.compiler import compile_passes, solve
from detent_audit.selection.frontend import source_from_text
from detent_audit.selection.intervals import Interval, interval_of
from detent_audit.selection.ir import Builder, Op
from detent_audit.selection.lang import SelectionFailure
from detent_audit.selection.pe_values import check_program

HEADER = '''from __future__ import annotations
from detent_audit.selection.lang import Runtime, Request, assume, require, record

@record
class Facts:
    head_dim: int
    paged_kv: bool
    page_size: int

@record
class Choice:
    is_causal: bool
    block_n: int
'''

# flash_api.cpp mha_fwd's causal drop and the tile it moves, reduced to the two selection points
CAUSAL_DROP = HEADER + '''
def prog(d: Facts, max_seqlen_q: Runtime[int]) -> Choice:
    assume(1 <= max_seqlen_q <= 4096, "bounded")
    causal = True
    if max_seqlen_q == 1 and (d.head_dim <= 64 or d.head_dim > 128 or not d.paged_kv):
        causal = False
    return Choice(is_causal=causal, block_n=128 if causal else 176)
'''


def _solve(text: str, **facts):
    src = source_from_text(text, filename="<test>")
    return solve((src, "prog"), src.namespace["Facts"](**facts))


@pytest.mark.parametrize("head_dim", [96, 128])
def test_and_false_folds_the_causal_drop(head_dim: int) -> None:
    # head dim 96/128 with paged KV: the second operand is False, so causal never drops
    r = _solve(CAUSAL_DROP, head_dim=head_dim, paged_kv=True, page_size=16)
    assert r.batch_dependent_points == [] and r.pins == []
    assert r.selector()(1) == r.selector()(4096) == r.result_cls(is_causal=True, block_n=128)


def test_causal_drop_stays_live_where_it_can_happen() -> None:
    r = _solve(CAUSAL_DROP, head_dim=64, paged_kv=True, page_size=16)
    assert r.batch_dependent_points == ["is_causal", "block_n"]
    assert len(r.pins) == 1 and len(r.pins[0]["candidates"]) == 2


def test_or_true_folds() -> None:
    text = HEADER + '''
def prog(d: Facts, n: Runtime[int]) -> Choice:
    assume(1 <= n <= 100, "bounded")
    wide = n > 1 or d.paged_kv
    return Choice(is_causal=wide, block_n=128 if wide else 64)
'''
    assert _solve(text, head_dim=64, paged_kv=True, page_size=1).pins == []
    assert len(_solve(text, head_dim=64, paged_kv=False, page_size=1).pins) == 1


def test_a_second_operand_decided_by_ranges_decides_and_or() -> None:
    # m >= 1 everywhere: `n > 1 and m < 1` is False, `n > 1 or m >= 1` is True (the first operand undecided)
    for cond, want in (("n > 1 and m < 1", False), ("n > 1 or m >= 1", True)):
        text = HEADER + f'''
def prog(d: Facts, n: Runtime[int], m: Runtime[int]) -> Choice:
    assume(1 <= n <= 100, "bounded")
    assume(1 <= m <= 100, "bounded")
    c = {cond}
    return Choice(is_causal=c, block_n=128 if c else 64)
'''
        r = _solve(text, head_dim=64, paged_kv=True, page_size=1)
        assert r.pins == [] and r.batch_dependent_points == [], cond
        assert r.selector()(7, 3).is_causal is want


def test_mod_of_a_smaller_value_is_the_value() -> None:
    b = Builder()
    a, m = b.make(Op.INPUT, ("a", "Runtime")), b.make(Op.INPUT, ("m", "Runtime"))
    node = b.make(Op.BINARY, "%", (a, m))
    domains = {"a": Interval(0, 16), "m": Interval(128, 192)}
    assert interval_of(node, {a.id: domains["a"], m.id: domains["m"]}, domains) == Interval(0, 16)
    # not smaller: the general bound
    assert interval_of(node, {a.id: Interval(0, 300), m.id: Interval(128, 192)}, domains) == Interval(0, 191)


def test_page_size_mod_tile_is_decided_for_head_dim_64() -> None:
    # get_pagedkv_tma: page_size % kBlockN == 0 with kBlockN in {128, 192} and 16-token pages: never
    text = HEADER + '''
def prog(d: Facts, max_seqlen_q: Runtime[int]) -> Choice:
    assume(1 <= max_seqlen_q <= 4096, "bounded")
    probe_n = 128 if max_seqlen_q == 1 else 192
    tma = d.page_size % probe_n == 0 and max_seqlen_q > 192
    return Choice(is_causal=tma, block_n=128 if tma else 192)
'''
    r = _solve(text, head_dim=64, paged_kv=True, page_size=16)
    assert r.pins == [] and r.selector()(1).block_n == 192


PARITY = HEADER + '''
def prog(d: Facts, n: Runtime[int]) -> Choice:
    assume(1 <= n <= 50, "bounded")
    same = (n * n) % 2 == n % 2
    return Choice(is_causal=same, block_n=128 if same else 64)
'''


def test_a_pin_with_one_candidate_is_a_constant_not_a_pin() -> None:
    # n*n and n have the same parity: no interval proves it, the value analysis sees one value
    r = _solve(PARITY, head_dim=64, paged_kv=True, page_size=1)
    assert r.pins == [] and r.legal_count == 1
    assert [(c["name"], c["value"]) for c in r.constants] == [("same", True)]
    sel = r.selector()
    assert {sel(n) for n in range(1, 51)} == {r.result_cls(is_causal=True, block_n=128)}


def test_ir_checker_runs_after_every_pass(monkeypatch) -> None:
    assert compiler.debug_enabled(), "tests/conftest.py sets DETENT_AUDIT_DEBUG=1"
    seen: list[str] = []
    monkeypatch.setattr(compiler, "check_program", lambda prog, after: seen.append(after))
    src = source_from_text(PARITY, filename="<test>")
    compile_passes(src, "prog", src.namespace["Facts"](head_dim=64, paged_kv=True, page_size=1))
    assert seen == ["partial evaluation", "simplify", "constant pins"]


def test_ir_checker_refuses_a_broken_pass(monkeypatch) -> None:
    src = source_from_text(CAUSAL_DROP, filename="<test>")
    facts = src.namespace["Facts"](head_dim=64, paged_kv=True, page_size=1)
    real = compiler.simplify

    def broken(prog, domains, **kw):
        out = real(prog, domains, **kw)
        node = next(v for v in out.outputs.values() if hasattr(v, "key"))
        node.key = "0" * 64  # a node whose content no longer matches its hash
        return out

    monkeypatch.setattr(compiler, "simplify", broken)
    with pytest.raises(AssertionError, match="after simplify"):
        compile_passes(src, "prog", facts)


def test_ir_checker_names_a_later_argument() -> None:
    src = source_from_text(CAUSAL_DROP, filename="<test>")
    prog = compile_passes(src, "prog", src.namespace["Facts"](head_dim=64, paged_kv=True, page_size=1)).prog
    check_program(prog, "test")
    node = next(v for v in prog.outputs.values() if hasattr(v, "src") and v.src)
    node.id = -5
    with pytest.raises(AssertionError, match="reads a later node"):
        check_program(prog, "test")


def test_unpinned_program_still_agrees() -> None:
    src = source_from_text(CAUSAL_DROP, filename="<test>")
    facts = src.namespace["Facts"](head_dim=128, paged_kv=True, page_size=16)
    fn = src.namespace["prog"]
    sel = solve((src, "prog"), facts).selector()
    for q in (1, 2, 4096):
        assert sel(q) == fn(facts, q)
    with pytest.raises(SelectionFailure):
        fn(facts, 0)
