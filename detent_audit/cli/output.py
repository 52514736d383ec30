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
import time
from collections.abc import Iterator
from typing import Any

import typer

_documents: list[list[str]] = []  # the documents of the --json commands running (innermost last)


def emit_json(text: str) -> None:
    """The command's JSON document: held for the real stdout while a --json command runs, else printed."""
    if _documents:
        _documents[-1].append(text)
    else:
        typer.echo(text)


def _stdout_handlers(stream: object) -> list[logging.StreamHandler]:
    names = list(logging.root.manager.loggerDict)
    loggers = [logging.getLogger(), *(logging.getLogger(name) for name in names)]
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


PIPED_LINES = 10   # lines a run of known length prints when stderr is no terminal (about one per tenth)
PIPED_EVERY = 50   # items between lines when the length is not known


class Progress:
    """A long run's progress on stderr: a bar on a terminal; elsewhere (a pipe, a log file) a line every N
    items with the rate (`label: done/total (x.x items/s)`), N a tenth of the run, and one at the end."""

    def __init__(self, label: str, unit: str = "items", *, terminal: bool | None = None) -> None:
        self.label, self.unit = label, unit
        self.terminal = sys.stderr.isatty() if terminal is None else terminal
        self.done, self._printed = 0, 0
        self.total: int | None = None
        self._start = time.monotonic()
        self._bar: Any = None
        self._task: Any = None

    def __enter__(self) -> Progress:
        if self.terminal:
            from rich.console import Console
            from rich.progress import Progress as Bar

            self._bar = Bar(console=Console(stderr=True), transient=True)
            self._bar.__enter__()
            self._task = self._bar.add_task(self.label, total=None)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._bar is not None:
            self._bar.__exit__(*exc)
        elif self.done > self._printed and exc[0] is None:
            self._line()

    def update(self, done: int, total: int | None = None) -> None:
        """`done` of `total` items (None: not known yet)."""
        self.done, self.total = done, total if total is not None else self.total
        if self._bar is not None:
            self._bar.update(self._task, completed=done, total=self.total)
            return
        if self.total:  # a line as each tenth of the run is crossed (the last at its end)
            tenth = done * PIPED_LINES // self.total > self._printed * PIPED_LINES // self.total
            if tenth or done >= self.total > self._printed:
                self._line()
        elif done - self._printed >= PIPED_EVERY:
            self._line()

    def advance(self, _: object = None) -> None:
        self.update(self.done + 1)

    def _line(self) -> None:
        seconds = max(time.monotonic() - self._start, 1e-9)
        of = f"/{self.total}" if self.total is not None else ""
        rate = f"{self.done / seconds:.1f} {self.unit}/s"
        sys.stderr.write(f"{self.label}: {self.done}{of} {self.unit} ({rate})\n")
        sys.stderr.flush()
        self._printed = self.done
