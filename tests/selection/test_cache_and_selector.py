"""JIT cache behaviour, repin, and compiled-selector checks."""

from __future__ import annotations

import json
import time
from dataclasses import astuple

import pytest

from detent_audit.selection.cache import JitCache
from detent_audit.selection.compiler import solve
from detent_audit.selection.errors import IllegalAssignment, SelectionViolation
from detent_audit.selection.frontend import source_from_text

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


def test_miss_on_program_change(tmp_path) -> None:
    _solve(tmp_path)
    changed = _solve(tmp_path, PROGRAM.replace("cdiv(d.num_sms, num_seqs)", "cdiv(d.num_sms, num_seqs) + 0"))
    assert changed.cache == "miss"


def test_miss_on_facts_change(tmp_path) -> None:
    _solve(tmp_path)
    assert _solve(tmp_path, num_sms=17).cache == "miss"
    assert _solve(tmp_path, num_sms=16).cache == "hit"


@pytest.mark.parametrize("damage", ["truncate", "flip", "garbage", "wrong_key", "empty"])
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
    else:
        entry.write_bytes(b"")
    again = _solve(tmp_path)
    assert again.cache == "corrupt"
    assert again.legal_groups == good.legal_groups and again.pins == good.pins
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
