"""The closed sets of values keep their wire values, and a run's exit status ranks its verdicts."""

from __future__ import annotations

import json

from detent_audit.enums import ExitCode, Mode, Verdict
from detent_audit.errors import BadInput
from detent_audit.manifests.errors import BadSignature


def test_members_are_their_wire_values() -> None:
    assert [m.value for m in Mode] == ["stock", "det", "detent"] and Mode("det") == "det"
    assert json.dumps({"status": Verdict.NOT_COMPARABLE, "code": ExitCode.MISMATCH}) == \
        '{"status": "NOT_COMPARABLE", "code": 1}'
    assert (BadInput("x").exit_code, BadSignature("x").exit_code) == (2, 1)


def test_the_exit_status_ranks_mismatch_over_bad_input_over_not_comparable() -> None:
    assert ExitCode.of(set()) is ExitCode.OK and ExitCode.of({"OK"}) is ExitCode.OK
    assert ExitCode.of({"OK", "NOT_COMPARABLE"}) is ExitCode.NOT_COMPARABLE
    assert ExitCode.of({Verdict.NOT_COMPARABLE, "BAD"}) is ExitCode.BAD_INPUT
    assert ExitCode.of({"BAD", Verdict.FAIL, "OK"}) is ExitCode.MISMATCH
