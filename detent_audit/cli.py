"""The `detent-audit` command line."""

from __future__ import annotations

import typer

app = typer.Typer(add_completion=False, no_args_is_help=True, help="Batch-invariant serving, signed receipts, verification.")


@app.command()
def version() -> None:
    """Print the version."""
    from detent_audit import __version__

    typer.echo(__version__)
