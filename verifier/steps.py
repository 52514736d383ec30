"""The verification steps, numbered as `manifests/receipt.py` and docs/design.md section 7 number them, and
one error class per step under one root, `VerificationError`.

A step's error says where a receipt or manifest was refuted; its exit code says how: 1 refuted (FAIL), 2
unreadable or unusable (BAD), 3 not comparable on this machine. `at(step)` turns any `DetentError` raised
inside a step (a decoder's `InvalidReceipt`, a key's `UntrustedKey`) into that step's error, message, remedy
and exit code kept.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from enum import IntEnum
from typing import ClassVar

from detent_audit.enums import ExitCode
from detent_audit.errors import DetentError
from detent_audit.verifier.compare import Divergence


class Step(IntEnum):
    # a bounded read of a regular file; the envelope decoded (bounded, canonical)
    READ = 1
    # PAE(payloadType, payload) signed by a trusted key, before the payload is parsed; its type
    SIGNATURE = 2
    # bounded decode, v2 schema, canonical; it names its signer; its facts and tuple hash as stated
    PAYLOAD = 3
    # named after its request; signed at a time a node could have; its deployment published
    CLAIMS = 4
    # a run manifest's (1)-(3); its receipts reproduce its root; none omitted, none after a final
    MANIFESTS = 5
    # a folder's receipts covered by verified manifests; a run's numbers and request ids unique
    COVERAGE = 6
    # the engine rebuilt from the facts, equal field by field; the tuple legal, the facts' own
    DEPLOYMENT = 7
    # ids within the vocabulary; the finish the scheduler's rule gives (stop tokens and strings)
    OUTPUT = 8
    # the client's bound body, reparsed by the node's parser, is the request run; the text
    REQUEST = 9
    # re-executed (rescore or replay): token ids, logprob bits, alternatives, prompt scores
    BITS = 10


class VerificationError(DetentError):
    """A receipt, manifest or run refuted at one step (`step`), with what an outcome reports of it."""

    step: ClassVar[Step]
    exit_code = ExitCode.MISMATCH

    def __init__(self, message: str, *, exit_code: ExitCode | int | None = None, remedy: str | None = None,
                 request_id: str | None = None) -> None:
        super().__init__(message, remedy=remedy)
        if exit_code is not None:
            self.exit_code = ExitCode(exit_code)
        self.request_id = request_id


class ReadError(VerificationError):
    step = Step.READ
    exit_code = ExitCode.BAD_INPUT


class SignatureError(VerificationError):
    step = Step.SIGNATURE


class PayloadError(VerificationError):
    step = Step.PAYLOAD
    exit_code = ExitCode.BAD_INPUT


class ClaimError(VerificationError):
    step = Step.CLAIMS


class ManifestError(VerificationError):
    step = Step.MANIFESTS

    def __init__(self, message: str, *, missing: tuple[str, ...] = (), **kwargs) -> None:
        super().__init__(message, **kwargs)
        self.missing = list(missing)  # digests of the manifest's receipts not found


class CoverageError(VerificationError):
    step = Step.COVERAGE


class DeploymentError(VerificationError):
    step = Step.DEPLOYMENT

    def __init__(self, message: str, *, fields: list[str] | None = None, **kwargs) -> None:
        super().__init__(message, **kwargs)
        self.fields = list(fields or [])  # the facts that differ


class OutputError(VerificationError):
    step = Step.OUTPUT


class RequestError(VerificationError):
    step = Step.REQUEST


class BitsError(VerificationError):
    step = Step.BITS

    def __init__(self, message: str, *, divergence: Divergence | None = None, **kwargs) -> None:
        super().__init__(message, **kwargs)
        self.divergence = divergence  # the first position where the bits differ


ERRORS: dict[Step, type[VerificationError]] = {cls.step: cls for cls in (
    ReadError, SignatureError, PayloadError, ClaimError, ManifestError, CoverageError, DeploymentError,
    OutputError, RequestError, BitsError)}


@contextmanager
def at(step: Step, request_id: str | None = None) -> Iterator[None]:
    """Run a step: a `DetentError` raised inside becomes the step's error (a `VerificationError` of another
    step passes through)."""
    try:
        yield
    except VerificationError:
        raise
    except DetentError as exc:
        raise ERRORS[step](exc.message, exit_code=exc.exit_code, remedy=exc.remedy or None,
                           request_id=request_id) from exc
