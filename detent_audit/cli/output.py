"""What a `--json` command writes: one JSON document on stdout, everything else on stderr.

While such a command runs (`json_command`), what anything else writes to stdout goes to stderr: Python's
`sys.stdout` (prints), the logging handlers that write to it (vLLM's logger writes to stdout), and file
descriptor 1 itself (C extensions, and the engine processes a command starts, which inherit it). The command
hands its document to `emit_json`, which writes it to the real stdout once the command is done.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from collections.abc import Iterator

import typer

_documents: list[list[str]] = []  # the documents of the --json commands running (innermost last)


def emit_json(text: str) -> None:
    """The command's JSON document: held for the real stdout while a --json command runs, else printed."""
    if _documents:
        _documents[-1].append(text)
    else:
        typer.echo(text)


def _stdout_handlers(stream: object) -> list[logging.StreamHandler]:
    loggers = [logging.getLogger(), *(logging.getLogger(name) for name in list(logging.root.manager.loggerDict))]
    return [h for lg in loggers for h in getattr(lg, "handlers", ())
            if isinstance(h, logging.StreamHandler) and h.stream is stream]


@contextlib.contextmanager
def json_command() -> Iterator[None]:
    """Run a --json command: stdout (Python's, logging's and descriptor 1) goes to stderr until it ends; then
    its document (`emit_json`) goes to the real stdout, also when it ends by raising (an exit code)."""
    real = sys.stdout
    try:
        fd = real.fileno()
    except (AttributeError, OSError, ValueError):  # a test runner's buffer: no descriptor to move
        fd = None
    saved = None
    if fd == 1:
        real.flush()
        saved = os.dup(1)
        os.dup2(sys.stderr.fileno(), 1)
    handlers = _stdout_handlers(real)
    for handler in handlers:
        handler.setStream(sys.stderr)
    _documents.append([])
    try:
        with contextlib.redirect_stdout(sys.stderr):
            yield
    finally:
        documents = _documents.pop()
        sys.stderr.flush()
        for handler in handlers:
            handler.setStream(real)
        if saved is not None:
            os.dup2(saved, 1)
            os.close(saved)
        for text in documents:
            real.write(text + "\n")
        real.flush()
