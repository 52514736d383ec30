"""Errors of the SelIR compiler and of compiled selectors."""

from __future__ import annotations

from detent_audit.enums import ExitCode
from detent_audit.errors import BadInput, DetentError


class SelIRError(BadInput):
    """A program outside the SelIR grammar, or one that cannot be analysed; shows file:line:col and a
    caret."""

    def __init__(self, message: str, *, filename: str = "<selir>", source: str | None = None,
                 line: int | None = None, col: int | None = None, remedy: str | None = None) -> None:
        self.filename, self.line, self.col, self.reason = filename, line, col, message
        text = message
        if line is not None:
            where = f"{filename}:{line}:{(col or 0) + 1}"
            text = f"{where}: {message}"
            if source is not None:
                lines = source.splitlines()
                if 1 <= line <= len(lines):
                    src_line = lines[line - 1]
                    text += f"\n    {src_line}\n    {' ' * (col or 0)}^"
        super().__init__(text, remedy=remedy)


class SelectionViolation(DetentError):
    """A compiled selector met runtime inputs for which a require/assume does not hold with the pinned values.

    The engine must stop serving rather than launch another kernel.
    """

    exit_code = ExitCode.MISMATCH
    remedy = "re-solve and re-tune for this workload, or raise the limit the condition names"

    def __init__(self, program: str, condition: str, line: int, inputs: dict, pins: dict) -> None:
        self.program, self.condition, self.inputs, self.pins = program, condition, dict(inputs), dict(pins)
        shown_inputs = ", ".join(f"{k}={v!r}" for k, v in inputs.items())
        shown_pins = ", ".join(f"{k}={v!r}" for k, v in pins.items()) or "none"
        super().__init__(f"{program}: selection violates `{condition}` (line {line}) at inputs "
                         f"({shown_inputs}) with pins ({shown_pins})")


class IllegalAssignment(BadInput):
    """A tuple gives a pin or knob a value outside its legal set."""


class NotTranscribed(DetentError):
    """A deployment runs a kernel family whose selection no program transcribes: its pins cannot be stated.

    Exit 3 (not comparable): `solve` has no answer rather than a wrong one (0 pins), and nothing serves it.
    """

    exit_code = ExitCode.NOT_COMPARABLE
