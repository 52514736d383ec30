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


# ---- keys, receipts and verification

@app.command()
@handles_errors
def keygen(
    out: Path = typer.Option(..., "--out", help="Private key file to create (the public key goes to OUT.pub)."),
    passphrase_env: str = typer.Option(None, "--passphrase-env", help="Encrypt with the passphrase in this "
                                                                      "environment variable."),
) -> None:
    """Create an Ed25519 signing key (PKCS#8, mode 0600, never overwriting) and its public key."""
    from detent_audit.manifests.keys import generate_key

    key = generate_key(out, _passphrase(passphrase_env))
    typer.echo(f"OK: private key {key.private_path}\nOK: public key {key.public_path}\nkeyid {key.keyid}")


def _passphrase(env: str | None) -> bytes | None:
    if env is None:
        return None
    import os

    value = os.environ.get(env)
    if value is None:
        from detent_audit.errors import BadInput

        raise BadInput(f"environment variable {env} is not set", remedy=f"export {env}=... or drop --passphrase-env")
    return value.encode()


@app.command()
@handles_errors
def inspect(
    path: Path = typer.Argument(..., help="A receipt or run-manifest file."),
    as_json: bool = typer.Option(False, "--json", help="Machine-readable output."),
) -> None:
    """Show a receipt or run manifest (decoded, NOT verified: use `verify` for that)."""
    from detent_audit.manifests.dsse import RUN_MANIFEST_PAYLOAD_TYPE, Envelope, read_envelope_bytes
    from detent_audit.manifests.receipt import Receipt
    from detent_audit.manifests.run_manifest import RunManifest

    env = Envelope.from_bytes(read_envelope_bytes(path))
    body = (RunManifest.from_bytes(env.payload) if env.payload_type == RUN_MANIFEST_PAYLOAD_TYPE
            else Receipt.from_bytes(env.payload))
    doc = json.loads(body.to_json())
    doc = {"unverified": True, "payload_type": env.payload_type, "signer_keyid_hint": env.keyid, "payload": doc}
    if as_json:
        typer.echo(json.dumps(doc, indent=2, sort_keys=True))
    else:
        typer.echo(f"{path}: {env.payload_type} (NOT verified; signer hint {env.keyid})")
        typer.echo(json.dumps(doc["payload"], indent=2, sort_keys=True))


@app.command()
@handles_errors
def verify(
    paths: list[Path] = typer.Argument(..., help="Receipts, folders of receipts, run manifests."),
    key: Path = typer.Option(None, "--key", help="Trusted public key file."),
    trusted_keys: Path = typer.Option(None, "--trusted-keys", help="Folder of trusted public keys (*.pub)."),
    model: Path = typer.Option(None, "--model", "-m", help=_MODEL_HELP),
    mode: str = typer.Option("rescore", "--mode", help="rescore (one teacher-forced prefill) | replay"),
    sample: float = typer.Option(None, "--sample", help="Verify a seeded sample: this fraction of receipts."),
    seed: int = typer.Option(0, "--seed", help="Seed of --sample."),
    cache_dir: Path = typer.Option(None, "--cache-dir", help="JIT cache directory."),
    threads: int = typer.Option(None, "--threads", help="Run with this many CPU threads (default: the "
                                                        "receipt's); a different count is not comparable."),
    tuple_file: Path = typer.Option(None, "--tuple", help="Verify as this tuple (default: the receipt's)."),
    as_json: bool = typer.Option(False, "--json", help="Machine-readable output."),
) -> None:
    """Verify receipts: signature, deployment, tuple, re-execution, bits. Exit 0 pass, 1 mismatch, 2 bad input,
    3 not comparable."""
    from rich.console import Console
    from rich.progress import Progress

    from detent_audit.errors import BadInput
    from detent_audit.manifests.keys import load_trusted_keys
    from detent_audit.verifier.verify import verify as run_verify

    if (key is None) == (trusted_keys is None):
        raise BadInput("give exactly one of --key FILE or --trusted-keys DIR")
    if sample is not None and not 0 < sample <= 1:
        raise BadInput(f"--sample must be in (0, 1], got {sample}")
    trusted = load_trusted_keys(key or trusted_keys)
    override = None
    if tuple_file is not None:
        from detent_audit.engine.tuples import load_tuple

        override = load_tuple(tuple_file)
    with Progress(console=Console(stderr=True), transient=True, disable=as_json) as progress:
        task = progress.add_task("re-executing", total=None)
        report = run_verify(paths, trusted, model=model, mode=mode, sample=sample, seed=seed,
                            cache_dir=str(cache_dir) if cache_dir else None, threads=threads,
                            tuple_override=override,
                            progress=lambda done, total: progress.update(task, completed=done, total=total))
    if as_json:
        typer.echo(json.dumps({"mode": mode, "exit_code": report.exit_code, "counts": report.counts(),
                               "outcomes": [o.to_json() for o in report.outcomes]}, indent=2))
    else:
        for o in report.outcomes:
            tag = "OK" if o.status == "OK" else "FAIL"
            extra = "" if o.status in ("OK", "FAIL") else f" [{o.status.lower().replace('_', ' ')}]"
            typer.echo(f"{tag}: {o.path}{extra}: {o.message}")
        c = report.counts()
        typer.echo(f"{c['OK']} ok, {c['FAIL']} failed, {c['BAD']} bad input, {c['NOT_COMPARABLE']} not comparable "
                   f"({mode})")
    raise typer.Exit(report.exit_code)


# ---- serving

@app.command()
@handles_errors
def serve(
    model: Path = typer.Option(None, "--model", "-m", help=_MODEL_HELP),
    tuple_file: Path = typer.Option(None, "--tuple", help="Committed tuple file (default: the preferred legal "
                                                          "tuple of detent mode)."),
    key: Path = typer.Option(..., "--key", help="The node's private signing key (PKCS#8 PEM, mode 0600)."),
    passphrase_env: str = typer.Option(None, "--passphrase-env", help="Environment variable holding the key's "
                                                                      "passphrase."),
    manifest_out: Path = typer.Option(..., "--manifest-out", help="Folder for receipts/ and manifests/."),
    rotate: int = typer.Option(None, "--rotate", help="Write a run manifest every N receipts (and on exit)."),
    mode: str = typer.Option("detent", "--mode", help="detent | stock | det"),
    dtype: str = typer.Option("float32", "--dtype", help="float32 | bfloat16"),
    threads: int = typer.Option(1, "--threads", help="CPU threads (a bit-relevant fact)."),
    cache_dir: Path = typer.Option(None, "--cache-dir", help="JIT cache directory."),
    host: str = typer.Option("127.0.0.1", "--host", help="Address to listen on."),
    port: int = typer.Option(8000, "--port", help="Port to listen on."),
    served_model_name: str = typer.Option(None, "--served-model-name", help="Model name clients ask for "
                                                                            "(default: the model folder's name)."),
    max_queued: int = typer.Option(256, "--max-queued", help="Requests queued or running at most (then 503)."),
    input_path: Path = typer.Option(None, "--input", help="Serve this JSONL file of requests offline, then exit."),
    output_path: Path = typer.Option(None, "--output", help="Where --input writes its results (JSONL)."),
) -> None:
    """Serve with a signed receipt for every response: an OpenAI-compatible HTTP server (default) or a file of
    requests (--input). On SIGTERM/SIGINT the server stops accepting, finishes the responses under way, writes
    the run manifest and exits."""
    from detent_audit.errors import BadInput
    from detent_audit.manifests.keys import load_private_key
    from detent_audit.server.node import ServingNode

    if rotate is not None and rotate < 1:
        raise BadInput(f"--rotate must be >= 1, got {rotate}")
    if (input_path is None) != (output_path is None):
        raise BadInput("--input and --output go together", remedy="give both, or neither to serve over HTTP")
    if max_queued < 1:
        raise BadInput(f"--max-queued must be >= 1, got {max_queued}")
    private_key = load_private_key(key, _passphrase(passphrase_env))
    llm = _engine(model, mode, dtype, threads, tuple_file, cache_dir)
    node = ServingNode(llm, private_key, manifest_out, rotate)
    if input_path is not None:
        from detent_audit.server.offline import serve_offline

        try:
            count = serve_offline(llm, node, input_path, output_path)
        finally:
            manifest = node.close()
        typer.echo(f"OK: {count} requests served, receipts in {manifest_out / 'receipts'}"
                   + (f", run manifest {manifest}" if manifest else ""))
        return
    _serve_http(llm, node, served_model_name or llm.config.model_path.name, host, port, max_queued)


def _serve_http(llm: Any, node: Any, model_name: str, host: str, port: int, max_queued: int) -> None:
    """Run uvicorn until SIGTERM/SIGINT; the app's shutdown stops the engine and writes the run manifest."""
    import uvicorn

    from detent_audit.server.app import create_app
    from detent_audit.server.async_engine import AsyncEngine

    engine = AsyncEngine(llm, max_queued=max_queued)
    config = uvicorn.Config(create_app(engine, node, model_name), host=host, port=port, log_level="warning",
                            timeout_graceful_shutdown=60, lifespan="on")
    typer.echo(f"serving {model_name} on http://{host}:{port}/v1 (receipts in {node.out / 'receipts'})", err=True)
    try:
        uvicorn.Server(config).run()  # re-raises a captured SIGINT/SIGTERM after a graceful shutdown
    finally:
        engine.shutdown(drain=False)  # no-ops after a clean shutdown; else nothing answers these any more
        node.close()


if __name__ == "__main__":
    main()
