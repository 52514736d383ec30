"""The closed sets of values the project names: engine modes, verdicts and exit codes.

Each is an enum whose values are the strings (or integers) of the wire formats and command lines that carry
them (receipts' facts, `--mode`, verify's JSON report, the process's exit status), so a member compares equal
to its value and serializes as it.
"""

from __future__ import annotations

import enum


class _Named(str, enum.Enum):
    """A str enum that prints as its value (`f"{Mode.DETENT}"` is `detent`, as on the wire)."""

    def __str__(self) -> str:
        return str(self.value)

    def __format__(self, spec: str) -> str:
        return format(str(self.value), spec)


class Mode(_Named):
    """How an engine selects its kernels."""

    STOCK = "stock"    # vendor selection reads the batch
    DET = "det"        # one conservative setting per family
    DETENT = "detent"  # the solved selectors with the committed tuple's pins


class Verdict(_Named):
    """One receipt's or manifest's outcome in `verify`."""

    OK = "OK"                          # signature, binding and bits all check
    FAIL = "FAIL"                      # a check failed: the receipt or manifest is wrong
    BAD = "BAD"                        # the input is malformed or unreadable
    NOT_COMPARABLE = "NOT_COMPARABLE"  # this verifier cannot rebuild the deployment it names


class ExitCode(enum.IntEnum):
    """The process's exit status."""

    OK = 0
    MISMATCH = 1        # a verification failed
    BAD_INPUT = 2       # a malformed file or argument
    NOT_COMPARABLE = 3  # a deployment this verifier cannot rebuild

    @classmethod
    def of(cls, verdicts: set[Verdict] | set[str]) -> ExitCode:
        """The run's exit status from its verdicts: a mismatch first, then bad input, then not comparable."""
        values = {Verdict(v).value for v in verdicts}
        for verdict, code in ((Verdict.FAIL, cls.MISMATCH), (Verdict.BAD, cls.BAD_INPUT),
                              (Verdict.NOT_COMPARABLE, cls.NOT_COMPARABLE)):
            if verdict.value in values:
                return code
        return cls.OK
