"""The `detent-audit` app and its one error handler.

Errors a user can cause are `DetentError`s: caught here once, printed as one `FAIL:` line with a remedy,
exit code 2 for bad input (1 for a mismatch, 3 for not comparable). `--verbose` re-raises with the traceback.
The commands live in modules by concept; the package's `__init__` registers them on `app`.
"""

from __future__ import annotations

import functools
import logging
import os
import warnings
from collections.abc import Callable
from typing import Any

import typer
from typer.core import TyperCommand

from detent_audit.cli.output import json_command
from detent_audit.errors import DetentError

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="Batch-invariant LLM serving at near-stock speed, "
                       "with signed receipts anyone can verify.")
_state = {"verbose": False}


@app.callback()
def _main(verbose: bool = typer.Option(False, "--verbose", "-v",
                                       help="Show tracebacks on errors, and what the engines' libraries log "
                                            "(vLLM's INFO and WARNING lines, their warnings)."),
          isa: str = typer.Option("native", "--isa", envvar="DETENT_AUDIT_ISA",
                                  help="portable: torch, MKL and oneDNN capped at AVX2 (x86-64-v3), receipts "
                                       "that verify on any x86-64 CPU with AVX2; native: the CPU's widest "
                                       "(receipts checked on its class only). "
                                       "Set before torch loads.")) -> None:
    _state["verbose"] = verbose
    if not verbose:
        quiet_libraries()


def quiet_libraries() -> None:
    """What the libraries under the engines say at start and per request kept out of the user's way (errors
    still show): vLLM's log below ERROR (and its loading bars, `VllmEngine`), torch's C++ warnings, Python
    warnings raised outside detent_audit. A variable the user set wins; `--verbose` skips this."""
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")  # read when vLLM configures its logger
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")  # read when torch loads (later, in the command)
    # vLLM logs a line or two on import before its logger is configured: Python's last-resort handler
    logging.getLogger("vllm").setLevel(os.environ["VLLM_LOGGING_LEVEL"].upper())
    warnings.filterwarnings("ignore")
    warnings.filterwarnings("default", module=r"detent_audit(\.|$)")


def handles_errors(fn: Callable[..., Any]) -> Callable[..., Any]:
    """`fn` with its `DetentError`s printed (`FAIL:` and the remedy) and turned into their exit code; with
    `--json`, run as `json_command` (one JSON document on stdout)."""
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            if kwargs.get("as_json") is True:  # one JSON document on stdout, everything else on stderr
                with json_command():
                    return fn(*args, **kwargs)
            return fn(*args, **kwargs)
        except DetentError as exc:
            if _state["verbose"]:
                raise
            lines = exc.diagnostics().splitlines()
            typer.echo(f"FAIL: {lines[0]}", err=True)
            for line in lines[1:]:
                typer.echo(line, err=True)
            raise typer.Exit(exc.exit_code) from None

    return wrapper


try:  # the click that parses typer's commands: its own copy since typer 0.2x, else click
    from typer._click.exceptions import NoSuchOption
except ImportError:  # pragma: no cover (older typer)
    from click.exceptions import NoSuchOption  # type: ignore[assignment]

# parameters that name a private key: never offered for a mistyped option (a user typing `--api-key` where it
# does not exist must not be steered to paste the node's signing key)
SECRET_PARAMS = frozenset({"signing_key", "old_key"})


class _Command(TyperCommand):
    """A command whose "did you mean" suggestions leave out the options of `SECRET_PARAMS`."""

    def parse_args(self, ctx: Any, args: list[str]) -> list[str]:
        try:
            return super().parse_args(ctx, args)
        except NoSuchOption as exc:
            secret = {opt for p in self.params if p.name in SECRET_PARAMS for opt in p.opts}
            exc.possibilities = sorted(set(exc.possibilities or ()) - secret)
            raise


def register(commands: list[tuple[str, Callable[..., Any]]]) -> None:
    """Each (name, function) as a command of `app`, in this order (the order `--help` lists them)."""
    for name, fn in commands:
        app.command(name, cls=_Command)(handles_errors(fn))


def version() -> None:
    """Print the version."""
    from detent_audit import __version__

    typer.echo(__version__)
