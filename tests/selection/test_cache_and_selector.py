"""JIT cache behaviour, repin, and compiled-selector checks."""

from __future__ import annotations

import dataclasses
import json
import time
from dataclasses import astuple

import pytest

from detent_audit.manifests.encoding import canonical_json, sha256_hex
from detent_audit.selection.cache import JitCache
from detent_audit.selection.compiler import FoldedConstant, SolvedPin, SolveResult, solve
from detent_audit.selection.errors import IllegalAssignment, SelectionViolation, SelIRError
from detent_audit.selection.frontend import source_from_text
from detent_audit.selection.vra import KnobInfo, LegalGroup

PROGRAM = '''from __future__ import annotations
from detent_audit.selection.lang import Runtime, knob, require, assume, cdiv, record

@record
class Facts:
    num_sms: int
    limit: int

@record
class Choice:
    splits: int
    tile: int

def prog(d: Facts, num_seqs: Runtime[int], max_len: Runtime[int]) -> Choice:
    assume(1 <= num_seqs <= 32, "batch within the scheduler's limit")
    assume(1 <= max_len <= 2048, "context within the model's limit")
    tile = knob("tile", (64, 128), 128)
    blocks = cdiv(max_len, tile)
    splits = max(1, min(blocks, cdiv(d.num_sms, num_seqs)))
    require(splits * num_seqs <= d.limit, "the combine kernel's limit")
    return Choice(splits=splits, tile=tile)
'''


def _solve(tmp_path, text=PROGRAM, num_sms=16, limit=4096):
    src = source_from_text(text, filename="prog.py")
    return solve((src, "prog"), src.namespace["Facts"](num_sms=num_sms, limit=limit),
                 cache=JitCache(tmp_path))


def test_hit_after_miss_and_same_answer(tmp_path) -> None:
    first = _solve(tmp_path)
    second = _solve(tmp_path)
    assert (first.cache, second.cache) == ("miss", "hit")
    assert first.to_json() | {"cache": None, "solve_seconds": None} == second.to_json() | {
        "cache": None, "solve_seconds": None}
    assert astuple(second.selector()(3, 100)) == astuple(first.selector()(3, 100))


def test_cached_result_is_the_same_typed_value(tmp_path) -> None:
    first = _solve(tmp_path)
    second = _solve(tmp_path)
    # the hit is read back from JSON: the same tuples and records, not lists and dicts
    assert second == dataclasses.replace(first, cache="hit", solve_seconds=second.solve_seconds)
    assert all(type(p) is SolvedPin for p in second.pins) and all(type(k) is KnobInfo for k in second.knobs)
    assert all(type(g) is LegalGroup and all(type(r) is tuple for r in g.rows) for g in second.legal_groups)
    assert all(type(c) is FoldedConstant for c in second.constants)
    again = SolveResult.from_json(json.loads(json.dumps(first.to_json())))
    assert again == first and json.dumps(again.report(),
                                         sort_keys=True) == json.dumps(first.report(), sort_keys=True)
    with pytest.raises(dataclasses.FrozenInstanceError):
        first.pins = ()  # type: ignore[misc]
    with pytest.raises(SelIRError, match="no @record class"):
        again.selector()  # from_json alone has no record class to build


@pytest.mark.parametrize("change", ["extra", "missing"])
def test_from_json_refuses_a_body_of_other_fields(tmp_path, change) -> None:
    body = _solve(tmp_path).to_json()
    if change == "extra":
        body["legal"] = []
    else:
        body.pop("constants")
    with pytest.raises(SelIRError, match="out of place") as info:
        SolveResult.from_json(body)
    assert "JIT cache" in (info.value.remedy or "")


def test_legal_assignment_values_must_keep_their_type(tmp_path) -> None:
    result = _solve(tmp_path)
    good = next(result.legal_assignments())
    assert result.is_legal(good)
    pin = result.pins[0].name
    assert not result.is_legal({**good, pin: float(good[pin])})  # 2.0 == 2, but not the pinned int
    assert not result.is_legal({**good, "extra": 1}) and not result.is_legal({pin: good[pin]})


def test_miss_on_program_change(tmp_path) -> None:
    _solve(tmp_path)
    changed = _solve(tmp_path, PROGRAM.replace("cdiv(d.num_sms, num_seqs)", "cdiv(d.num_sms, num_seqs) + 0"))
    assert changed.cache == "miss"


def test_miss_on_facts_change(tmp_path) -> None:
    _solve(tmp_path)
    assert _solve(tmp_path, num_sms=17).cache == "miss"
    assert _solve(tmp_path, num_sms=16).cache == "hit"


@pytest.mark.parametrize("damage",
                         ["truncate", "flip", "garbage", "wrong_key", "empty", "reshaped", "mistyped"])
def test_corrupt_entry_is_detected_and_solved_again(tmp_path, damage: str) -> None:
    good = _solve(tmp_path)
    (entry,) = list(tmp_path.rglob("*.json"))
    raw = entry.read_bytes()
    if damage == "truncate":
        entry.write_bytes(raw[: len(raw) // 2])
    elif damage == "flip":
        i = raw.index(b'"candidate_count":') + len(b'"candidate_count":')
        entry.write_bytes(raw[:i] + bytes([raw[i] ^ 0x01]) + raw[i + 1:])
    elif damage == "garbage":
        entry.write_bytes(b"\x00\xff not json")
    elif damage == "wrong_key":
        d = json.loads(raw)
        d["key"] = "0" * 64
        entry.write_text(json.dumps(d))
    elif damage in ("reshaped", "mistyped"):  # a well-formed, correctly hashed entry that is not a result
        d = json.loads(raw)
        if damage == "reshaped":
            d["body"]["legal"] = d["body"].pop("legal_groups")
        else:
            d["body"]["pins"] = 5
        d["sha256"] = sha256_hex(canonical_json(d["body"]))
        entry.write_bytes(canonical_json(d))
    else:
        entry.write_bytes(b"")
    again = _solve(tmp_path)
    assert again.cache == "corrupt"
    assert again == dataclasses.replace(good, cache="corrupt", solve_seconds=again.solve_seconds)
    assert _solve(tmp_path).cache == "hit"


def test_selector_checks_each_new_input_and_raises_on_violation(tmp_path) -> None:
    result = _solve(tmp_path, limit=4096)
    sel = result.selector()
    sel(4, 1000)
    with pytest.raises(SelectionViolation) as info:
        sel(33, 10)
    text = str(info.value)
    assert "assume: batch within the scheduler's limit" in text
    assert "num_seqs=33" in text and "max_len=10" in text
    for pin in result.pins:
        assert f"{pin.name}=" in text


def test_require_violation_names_condition_inputs_and_pins(tmp_path) -> None:
    result = _solve(tmp_path, limit=64)
    assert result.legal_count, "some split counts are legal"
    pin = result.pins[0].name
    illegal = max(result.pins[0].candidates)
    assert illegal not in result.pins[0].legal_values
    bad = result.selector().repin({pin: illegal})  # no legality callback: the selector itself must refuse
    with pytest.raises(SelectionViolation, match="require: the combine kernel's limit") as info:
        bad(32, 2048)
    assert f"{pin}={illegal}" in str(info.value)


def test_pinned_selector_is_constant_and_never_recompiles(tmp_path) -> None:
    result = _solve(tmp_path)
    sel = result.selector()
    fn = sel.fn
    outs = {sel(n, m) for n in range(1, 33) for m in (1, 7, 64, 65, 2048)}
    assert len(outs) == 1
    assert sel.fn is fn


def test_repin_is_legal_checked_and_fast(tmp_path) -> None:
    result = _solve(tmp_path)
    sel = result.selector()
    pin = result.pins[0].name
    other = [v for v in result.pins[0].legal_values if v != sel.pins[pin]][0]
    t0 = time.perf_counter()
    swapped = result.repin(sel, **{pin: other})
    assert time.perf_counter() - t0 < 0.05
    assert swapped(2, 100).splits == other
    with pytest.raises(IllegalAssignment):
        result.repin(sel, **{pin: 10_000})
    with pytest.raises(IllegalAssignment, match="no pin or knob named"):
        sel.repin({"nope": 1})
