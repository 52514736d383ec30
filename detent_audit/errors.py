"""The one error root. Every error a user can cause is a `DetentError` with a remedy.

The CLI catches `DetentError` once, prints its `diagnostics()` and exits with `exit_code`; anything else is a
bug and keeps its traceback.
"""

from __future__ import annotations

from detent_audit.enums import ExitCode


class DetentError(Exception):
    """Base of every user-facing error. `remedy` says what to do about it."""

    exit_code: ExitCode = ExitCode.BAD_INPUT
    remedy = ""

    def __init__(self, message: str, *, remedy: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        if remedy is not None:
            self.remedy = remedy

    def diagnostics(self) -> str:
        text = self.message
        if self.remedy:
            text += f"\n  remedy: {self.remedy}"
        return text


class BadInput(DetentError):
    """A file or argument the user gave is malformed, missing or inconsistent."""

    exit_code = ExitCode.BAD_INPUT
