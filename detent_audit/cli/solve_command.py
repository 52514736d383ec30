"""`detent-audit solve`: every selection program of a deployment solved, as a table or JSON."""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import typer

from detent_audit.cli.options import CACHE_DIR, JSON
from detent_audit.cli.output import emit_json

if TYPE_CHECKING:
    from detent_audit.selection.compiler import SolveResult


def solve(
    deployment: Path = typer.Option(..., "--deployment", "-d", help="Deployment-facts TOML file."),
    family: list[str] = typer.Option(None, "--family", "-f", help="Only these families (repeatable)."),
    ablate: str = typer.Option(None, "--ablate", help="constant-folding-only | no-cut"),
    as_json: bool = JSON, cache_dir: Path = CACHE_DIR,
) -> None:
    """Solve every selection program of a deployment: pins, legal values, compiled selectors. Exit 3 when a
    family the deployment runs is not transcribed."""
    from detent_audit.selection.solve_deployment import solve_deployment

    results = solve_deployment(deployment, families=family or None, ablation=ablate, cache_dir=cache_dir)
    if as_json:
        emit_json(json.dumps({"deployment": str(deployment), "families": [r.report() for r in results]},
                              indent=2, sort_keys=True))
        return
    _print_table(deployment, results)


def _print_table(deployment: Path, results: list[SolveResult]) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(file=sys.stdout, width=160)
    table = Table(title=f"detent-audit solve: {deployment.name}", show_lines=True)
    for col in ("family", "program", "values", "sel. points", "batch-dep. points",
                "pins (name@line: candidates)", "legal values per pin", "constants (one candidate)",
                "candidates", "legal", "solve", "cache"):
        table.add_column(col, overflow="fold")
    for r in results:
        pins = "\n".join(f"{p.name}@{p.line}: {len(p.candidates)}" for p in r.pins) or "-"
        legal_vals = "\n".join(_short(p.legal_values) for p in r.pins) or "-"
        constants = "\n".join(f"{c.name}@{c.line} = {c.value!r}" for c in r.constants) or "-"
        table.add_row(r.family, r.program, str(r.num_values), str(len(r.selection_points)),
                      ", ".join(r.batch_dependent_points) or "-", pins, legal_vals, constants,
                      str(r.candidate_count), str(r.legal_count), f"{r.solve_seconds * 1000:.1f} ms", r.cache)
    console.print(table)


def _short(values: Sequence[object], limit: int = 12) -> str:
    shown = ", ".join(map(str, values[:limit]))
    return f"{{{shown}{', ...' if len(values) > limit else ''}}} ({len(values)})"
