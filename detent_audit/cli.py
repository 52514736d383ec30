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
    """Solve every selection program of a deployment: pins, legal values, compiled selectors."""
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
    for col in ("family", "program", "values", "sel. points", "batch-dep. points", "pins (name@line)",
                "legal values per pin", "candidates", "legal", "solve", "cache"):
        table.add_column(col, overflow="fold")
    for r in results:
        pins = "\n".join(f"{p['name']}@{p['line']}" for p in r.pins) or "-"
        legal_vals = "\n".join(_short(p["legal_values"]) for p in r.pins) or "-"
        table.add_row(r.family, r.program, str(r.num_values), str(len(r.selection_points)),
                      ", ".join(r.batch_dependent_points) or "-", pins, legal_vals, str(r.candidate_count),
                      str(r.legal_count), f"{r.solve_seconds * 1000:.1f} ms", r.cache)
    console.print(table)


def _short(values: list, limit: int = 12) -> str:
    shown = ", ".join(map(str, values[:limit]))
    return f"{{{shown}{', ...' if len(values) > limit else ''}}} ({len(values)})"


def main() -> None:
    app()


# ---- the embedded engine

_MODEL_HELP = "HF checkpoint folder (default: the embedded default model, generated on first use)."


def _engine(model: Path | None, mode: str, dtype: str, threads: int, tuple_file: Path | None = None,
            cache_dir: Path | None = None, **extra: Any):
    from detent_audit.engine.llm import LLM, EngineConfig

    committed = None
    if tuple_file is not None:
        from detent_audit.engine.tuples import load_tuple

        committed = load_tuple(tuple_file)
    config = EngineConfig(model=str(model) if model else None, mode=mode, dtype=dtype, num_threads=threads,
                          tuple=committed, cache_dir=str(cache_dir) if cache_dir else None, **extra)
    return LLM(config)


@app.command()
@handles_errors
def info(
    model: Path = typer.Option(None, "--model", "-m", help=_MODEL_HELP),
    mode: str = typer.Option("detent", "--mode", help="detent | stock | det"),
    dtype: str = typer.Option("float32", "--dtype", help="float32 | bfloat16"),
    threads: int = typer.Option(1, "--threads", help="CPU threads (a bit-relevant fact)."),
    tuple_file: Path = typer.Option(None, "--tuple", help="Committed tuple file (detent mode)."),
    as_json: bool = typer.Option(False, "--json", help="Machine-readable output."),
) -> None:
    """Print the running engine's deployment facts and their hash."""
    from detent_audit.engine.facts import collect_facts, facts_hash

    llm = _engine(model, mode, dtype, threads, tuple_file)
    facts = collect_facts(llm)
    digest = facts_hash(facts)
    if as_json:
        typer.echo(json.dumps({"facts": facts, "facts_hash": digest}, indent=2, sort_keys=True))
        return
    typer.echo(json.dumps(facts, indent=2, sort_keys=True))
    typer.echo(f"facts hash: {digest}")


@app.command()
@handles_errors
def battery(
    model: Path = typer.Option(None, "--model", "-m", help=_MODEL_HELP),
    mode: str = typer.Option("detent", "--mode", help="detent | stock | det"),
    dtype: str = typer.Option("float32", "--dtype", help="float32 | bfloat16"),
    threads: int = typer.Option(1, "--threads", help="CPU threads."),
    seed: int = typer.Option(0, "--seed", help="Seed of the target and neighbour prompts."),
    as_json: bool = typer.Option(False, "--json", help="Machine-readable output."),
) -> None:
    """Run the 35-cell invariance battery; exit 1 if any cell fails."""
    from rich.console import Console
    from rich.progress import Progress
    from rich.table import Table

    from detent_audit.engine.battery import cells, run_battery

    llm = _engine(model, mode, dtype, threads)
    with Progress(console=Console(stderr=True), transient=True, disable=as_json) as progress:
        task = progress.add_task("battery", total=len(cells()))
        results = run_battery(llm, seed=seed, progress=lambda name: progress.advance(task))
    failed = [r for r in results if not r.passed]
    if as_json:
        typer.echo(json.dumps({"mode": mode, "dtype": dtype, "passed": len(results) - len(failed),
                               "total": len(results), "cells": [r.to_json() for r in results]}, indent=2))
    else:
        table = Table(title=f"invariance battery: mode {mode}, {dtype}")
        for col in ("cell", "group", "what changes", "result", "first diff", "expected bits", "got bits"):
            table.add_column(col)
        for r in results:
            table.add_row(r.name, r.group, r.description, "PASS" if r.passed else "FAIL",
                          "-" if r.first_diff is None else str(r.first_diff), r.expected_bits or "-",
                          r.got_bits or "-")
        Console(file=sys.stdout, width=150).print(table)
        typer.echo(f"{len(results) - len(failed)}/{len(results)} cells pass")
    if failed:
        raise typer.Exit(1)


@app.command()
@handles_errors
def generate(
    prompt: list[str] = typer.Argument(..., help="Prompts (submitted together)."),
    model: Path = typer.Option(None, "--model", "-m", help=_MODEL_HELP),
    mode: str = typer.Option("detent", "--mode", help="detent | stock | det"),
    dtype: str = typer.Option("float32", "--dtype"),
    threads: int = typer.Option(1, "--threads"),
    max_tokens: int = typer.Option(16, "--max-tokens"),
    temperature: float = typer.Option(0.0, "--temperature"),
    top_p: float = typer.Option(1.0, "--top-p"),
    top_k: int = typer.Option(0, "--top-k"),
    seed: int = typer.Option(0, "--seed"),
    as_json: bool = typer.Option(False, "--json"),
) -> None:
    """Generate completions offline."""
    from detent_audit.engine.sampling_params import SamplingParams

    llm = _engine(model, mode, dtype, threads)
    params = SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k, max_tokens=max_tokens, seed=seed)
    outs = llm.generate(prompt, params)
    if as_json:
        typer.echo(json.dumps([{"prompt": p, "text": o.text, "token_ids": o.token_ids,
                                "logprobs": o.logprobs, "finish_reason": o.finish_reason}
                               for p, o in zip(prompt, outs)], indent=2))
        return
    for p, o in zip(prompt, outs):
        typer.echo(f"{p!r} -> {o.text!r} ({len(o.token_ids)} tokens, {o.finish_reason})")
