"""The verification steps are one list: `Step` in verifier/steps.py, numbered and named the same in
docs/design.md section 7 and in manifests/receipt.py's docstring, with one error class per step under one
root."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from detent_audit.errors import BadInput, DetentError
from detent_audit.manifests import receipt as receipt_module
from detent_audit.manifests.errors import BadSignature, InvalidReceipt
from detent_audit.verifier.reconstruct import NotComparable
from detent_audit.verifier.report import Outcome
from detent_audit.verifier.steps import (
    ERRORS,
    DeploymentError,
    PayloadError,
    ReadError,
    SignatureError,
    Step,
    VerificationError,
    at,
)

ROOT = Path(__file__).parents[2]


def _design_steps() -> dict[int, str]:
    text = (ROOT / "docs" / "design.md").read_text()
    section = text[text.index("## 7. Verification"):text.index("## 8.")]
    return {int(n): name for n, name in re.findall(r"^(\d+)\. \*\*([\w ]+)\*\*", section, flags=re.M)}


def _receipt_doc_steps() -> dict[int, str]:
    doc = receipt_module.__doc__
    return {int(n): name for n, name in re.findall(r"\((\d+)\) ([\w ]+?)(?: and|:)", doc)}


def test_design_and_the_receipt_docstring_number_the_steps_as_the_code() -> None:
    code = {int(s): s.name.lower() for s in Step}
    assert list(code) == list(range(1, len(Step) + 1))
    for where, steps in (("docs/design.md section 7", _design_steps()),
                         ("manifests/receipt.py", _receipt_doc_steps())):
        assert sorted(steps) == sorted(code), (where, steps)
        for number, name in steps.items():
            assert name.lower().replace(" ", "_").endswith(code[number]), (where, number, name, code[number])


def test_each_step_has_its_own_error_class_under_one_root() -> None:
    assert sorted(ERRORS) == list(Step)
    assert len(set(ERRORS.values())) == len(Step)
    for step, cls in ERRORS.items():
        assert issubclass(cls, VerificationError) and issubclass(cls, DetentError) and cls.step is step
    assert issubclass(NotComparable, DeploymentError) and NotComparable(["runtime.dtype"]).exit_code == 3


def test_a_step_turns_the_errors_raised_inside_into_its_own_and_keeps_message_remedy_and_exit() -> None:
    with pytest.raises(SignatureError) as err:
        with at(Step.SIGNATURE, request_id="r1"):
            raise BadSignature("the signature does not verify")
    assert err.value.exit_code == 1 and err.value.message == "the signature does not verify"
    assert err.value.remedy == BadSignature.remedy and err.value.request_id == "r1"
    assert isinstance(err.value.__cause__, BadSignature)
    with pytest.raises(ReadError) as err:
        with at(Step.READ):
            raise InvalidReceipt("envelope: truncated")
    assert err.value.exit_code == 2
    with pytest.raises(PayloadError):  # another step's error passes through unchanged
        with at(Step.READ):
            raise PayloadError("deployment hash does not match")
    with pytest.raises(KeyError):  # not a user-facing error: the caller's to report
        with at(Step.READ):
            raise KeyError("x")


@pytest.mark.parametrize(("error", "status"), [(SignatureError("s"), "FAIL"), (ReadError("r"), "BAD"),
                                               (NotComparable(["runtime.dtype"]), "NOT_COMPARABLE"),
                                               (DeploymentError("d", exit_code=2), "BAD")])
def test_an_outcome_names_the_step_and_takes_its_status_from_the_exit_code(error, status) -> None:
    o = Outcome.refuted("x.receipt", "receipt", error, "r1")
    assert o.status == status and o.step is error.step and o.request_id == "r1"
    assert o.to_json()["step"] == {"number": int(error.step), "name": error.step.name.lower()}
    assert Outcome("x", "receipt", "OK").to_json()["step"] is None
    assert not issubclass(BadInput, VerificationError)
