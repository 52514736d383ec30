"""`detent-audit` commands of the audit: keygen, inspect, verify, serve."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import typer

from detent_audit.cli import _MODEL_HELP, app, handles_errors
from detent_audit.cli_engine import _engine


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
    from detent_audit.manifests.errors import InvalidReceipt
    from detent_audit.manifests.receipt import Receipt
    from detent_audit.manifests.run_manifest import RunManifest

    env = Envelope.from_bytes(read_envelope_bytes(path))
    try:
        body = (RunManifest.from_bytes(env.payload) if env.payload_type == RUN_MANIFEST_PAYLOAD_TYPE
                else Receipt.from_bytes(env.payload))
    except RecursionError:  # (the bounded decoder nests 32 levels at most; kept as a last guard)
        raise InvalidReceipt(f"{path}: nested too deeply to show") from None
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
    model: str = typer.Option(None, "--model", "-m", help=_MODEL_HELP + " Default: the model the receipt names "
                              "(if it is one of the names above), else the default model."),
    mode: str = typer.Option("rescore", "--mode", help="rescore (one teacher-forced prefill) | replay"),
    sample: float = typer.Option(None, "--sample", help="Verify a seeded sample: this fraction of receipts."),
    seed: int = typer.Option(None, "--seed", help="Seed of --sample, to repeat a sample (default: drawn at "
                                                  "random and reported, so a node cannot know the sample)."),
    cache_dir: Path = typer.Option(None, "--cache-dir", help="JIT cache directory."),
    threads: int = typer.Option(None, "--threads", help="Run with this many CPU threads (default: the "
                                                        "receipt's); a different count is not comparable."),
    tuple_file: Path = typer.Option(None, "--tuple", help="Verify as this tuple (default: the receipt's)."),
    workers: str = typer.Option("auto", "--workers", help="Processes that re-execute, each an engine of the "
                                                          "receipt's own deployment and threads: more cores "
                                                          "verify faster, the bits unchanged. auto: as many as "
                                                          "the cores, the receipts and the memory allow."),
    deployment: list[str] = typer.Option(None, "--deployment", help="A published deployment (the file `serve "
                                         "--publish-deployment` wrote, or its hash); repeatable. Every receipt's "
                                         "facts must be one of them; without it, facts are self-asserted."),
    as_json: bool = typer.Option(False, "--json", help="Machine-readable output."),
) -> None:
    """Verify receipts: signature, the client's request, deployment, tuple, re-execution, bits; folders: that
    run manifests cover every receipt. Exit 0 pass, 1 mismatch, 2 bad input, 3 not comparable."""
    _verify_cli(paths, key, trusted_keys, model, mode, sample, seed, cache_dir, threads, tuple_file, workers,
                deployment, as_json)


def _verify_cli(paths: list[Path], key: Path | None, trusted_keys: Path | None, model: Path | None, mode: str,
                sample: float | None, seed: int | None, cache_dir: Path | None, threads: int | None,
                tuple_file: Path | None, workers: str, deployment: list[str] | None, as_json: bool,
                response: tuple[Any, Any] | None = None) -> None:
    """`verify`, and `verify-response` (with `response` = (request, response) documents)."""
    from rich.console import Console
    from rich.progress import Progress

    from detent_audit.errors import BadInput
    from detent_audit.manifests.keys import load_trusted_keys
    from detent_audit.verifier.verify import CLOCK_SKEW_NS, EARLIEST_UNIX_NS, load_deployments
    from detent_audit.verifier.verify import verify as run_verify

    if (key is None) == (trusted_keys is None):
        raise BadInput("give exactly one of --key FILE or --trusted-keys DIR")
    if sample is not None and not 0 < sample <= 1:
        raise BadInput(f"--sample must be in (0, 1], got {sample}")
    if seed is not None and sample is None:
        raise BadInput("--seed chooses the receipts of --sample; without --sample every receipt is verified",
                       remedy="add --sample FRACTION, or drop --seed")
    if threads is not None and threads < 1:
        raise BadInput(f"--threads must be >= 1, got {threads}")
    if workers != "auto" and not (workers.isdigit() and int(workers) >= 1):
        raise BadInput(f"--workers must be a whole number >= 1 or auto, got {workers!r}")
    if key is not None and key.is_dir():
        raise BadInput(f"--key {key} is a folder; --key takes one public key file",
                       remedy="pass --trusted-keys DIR to trust every *.pub file in a folder")
    key_problems: list[str] = []
    trusted = load_trusted_keys(key or trusted_keys, key_problems)
    for problem in key_problems:  # a junk file is skipped, never in silence
        typer.echo(f"warning: trusted keys: {problem}", err=True)
    deployments = load_deployments(deployment) if deployment else None
    override = None
    if tuple_file is not None:
        from detent_audit.engine.tuples import load_tuple

        override = load_tuple(tuple_file)
    options = dict(model=model, mode=mode, sample=sample, seed=seed, cache_dir=str(cache_dir) if cache_dir else None,
                   threads=threads, tuple_override=override, workers=workers if workers == "auto" else int(workers),
                   deployments=deployments)
    with Progress(console=Console(stderr=True), transient=True, disable=as_json) as progress:
        task = progress.add_task("re-executing", total=None)
        show = lambda done, total: progress.update(task, completed=done, total=total)  # noqa: E731
        if response is None:
            report = run_verify(paths, trusted, progress=show, **options)
        else:
            from detent_audit.verifier.client import verify_response

            report = verify_response(response[0], response[1], paths[0], trusted, progress=show, **options)
    facts_note = ((f"facts checked against {len(report.published)} published deployment(s)" if report.published
                   else "facts are self-asserted by the node (no --deployment given): its limits and the tuple's "
                        "values where the bits do not refute them")
                  + f"; signing times are the node's clock, bounded to [2020-01-01, now + {CLOCK_SKEW_NS // 10**9} s]")
    cov = report.coverage
    if as_json:
        typer.echo(json.dumps({"mode": mode, "exit_code": report.exit_code, "counts": report.counts(),
                               "sample_seed": report.sample_seed, "published_deployments": report.published,
                               "facts_self_asserted": not report.published,
                               "times_self_asserted": {"earliest_unix_ns": EARLIEST_UNIX_NS,
                                                       "skew_ns": CLOCK_SKEW_NS}, "coverage": cov.to_json(),
                               "trusted_key_problems": key_problems,
                               "outcomes": [o.to_json() for o in report.outcomes]}, indent=2))
    else:
        for o in report.outcomes:
            tag = "OK" if o.status == "OK" else "FAIL"
            extra = "" if o.status in ("OK", "FAIL") else f" [{o.status.lower().replace('_', ' ')}]"
            rid = f" [request {o.request_id}]" if o.request_id and o.request_id not in o.message else ""
            typer.echo(f"{tag}: {o.path}{extra}{rid}: {o.message}")
        c = report.counts()
        typer.echo(f"{c['OK']} ok, {c['FAIL']} failed, {c['BAD']} bad input, {c['NOT_COMPARABLE']} not comparable "
                   f"({mode})" + (f"; a sample drawn with --seed {report.sample_seed}" if sample is not None else ""))
        typer.echo(f"{facts_note}; coverage: {cov.covered} of {cov.receipts} receipts in {cov.manifests} run "
                   f"manifest(s)" + (f", {len(cov.uncovered)} in none" if cov.uncovered else ""))
    raise typer.Exit(report.exit_code)


@app.command("verify-eval")
@handles_errors
def verify_eval(
    run: Path = typer.Argument(..., help="lm-eval's --output_path folder (or its results_*.json); the run "
                                         "was made with --log_samples."),
    receipts: list[Path] = typer.Option(..., "--receipts", help="The run's receipts folder (or files)."),
    key: Path = typer.Option(None, "--key", help="Trusted public key file."),
    trusted_keys: Path = typer.Option(None, "--trusted-keys", help="Folder of trusted public keys (*.pub)."),
    model: Path = typer.Option(None, "--model", "-m", help=_MODEL_HELP),
    include_path: list[Path] = typer.Option(None, "--include-path", help="Folder of the run's task YAML (as "
                                                                          "lm-eval's --include_path)."),
    cache_dir: Path = typer.Option(None, "--cache-dir", help="JIT cache directory."),
    workers: str = typer.Option("auto", "--workers", help="Processes that re-execute (as verify --workers)."),
    deployment: list[str] = typer.Option(None, "--deployment", help="A published deployment (the file `serve "
                                         "--publish-deployment` wrote, or its hash), as verify takes it; "
                                         "repeatable. A receipt whose facts are not among them does not cover "
                                         "its sample; without it, facts are self-asserted."),
    as_json: bool = typer.Option(False, "--json", help="Machine-readable output."),
) -> None:
    """Audit an lm-eval run: match every request it logged to its receipt, verify them, recompute each
    sample's metric from the verified outputs with lm-eval's own task code; print the reported score, the
    recomputed one and the coverage, and name every sample that differs and why. Exit 0 when every sample is
    covered and every score equal, 1 otherwise, 2 bad input."""
    from rich.console import Console
    from rich.progress import Progress

    from detent_audit.errors import BadInput
    from detent_audit.manifests.keys import load_trusted_keys
    from detent_audit.verifier.eval_audit import verify_eval as run_verify_eval
    from detent_audit.verifier.verify import load_deployments

    if (key is None) == (trusted_keys is None):
        raise BadInput("give exactly one of --key FILE or --trusted-keys DIR")
    if workers != "auto" and not (workers.isdigit() and int(workers) >= 1):
        raise BadInput(f"--workers must be a whole number >= 1 or auto, got {workers!r}")
    try:
        import lm_eval  # noqa: F401
    except ImportError:
        raise BadInput("verify-eval recomputes scores with lm-eval's own task code, and lm-eval is not installed",
                       remedy="pip install 'lm-eval[api]'") from None
    trusted = load_trusted_keys(key or trusted_keys)
    deployments = load_deployments(deployment) if deployment else None
    with Progress(console=Console(stderr=True), transient=True, disable=as_json) as progress:
        task = progress.add_task("verifying receipts", total=None)
        report = run_verify_eval(run, receipts, trusted, model=str(model) if model else None,
                                 deployments=deployments,
                                 include_path=[str(p) for p in include_path or []],
                                 workers=workers if workers == "auto" else int(workers),
                                 cache_dir=str(cache_dir) if cache_dir else None,
                                 progress=lambda done, total: progress.update(task, completed=done, total=total))
    if as_json:
        typer.echo(json.dumps(report.to_json(), indent=2))
        raise typer.Exit(report.exit_code)
    for s in report.scores:
        tag = "OK" if s.equal else "FAIL"
        typer.echo(f"{tag}: {s.task} {s.metric}: reported {s.reported}, recomputed from verified receipts "
                   f"{s.recomputed}, coverage {s.covered}/{s.total}")
    for d in report.docs:
        if not d.covered:
            typer.echo(f"FAIL: {d.task} doc {d.doc_id}: {'; '.join(d.reasons)}")
    covered = sum(d.covered for d in report.docs)
    c = report.receipt_counts
    typer.echo(f"{covered}/{len(report.docs)} samples covered; receipts: {c['OK']} ok, {c['FAIL']} failed, "
               f"{c['BAD'] + c['not_opened']} bad, {report.receipts_unmatched} matching no logged request; "
               + (f"facts checked against {len(report.published)} published deployment(s)" if report.published
                  else "facts are self-asserted by the node (no --deployment given)"))
    raise typer.Exit(report.exit_code)
@app.command("verify-response")
@handles_errors
def verify_response(
    request: Path = typer.Option(..., "--request", help="The request body the client sent (JSON)."),
    response: Path = typer.Option(..., "--response", help="The response it received (JSON, or the stream's "
                                                           "server-sent events)."),
    receipt: Path = typer.Option(..., "--receipt", help="The node's receipt of it."),
    key: Path = typer.Option(None, "--key", help="Trusted public key file."),
    trusted_keys: Path = typer.Option(None, "--trusted-keys", help="Folder of trusted public keys (*.pub)."),
    model: Path = typer.Option(None, "--model", "-m", help=_MODEL_HELP),
    mode: str = typer.Option("rescore", "--mode", help="rescore | replay"),
    cache_dir: Path = typer.Option(None, "--cache-dir", help="JIT cache directory."),
    deployment: list[str] = typer.Option(None, "--deployment", help="A published deployment (file or hash); "
                                                                    "repeatable."),
    as_json: bool = typer.Option(False, "--json", help="Machine-readable output."),
) -> None:
    """Check a request, the response received and the receipt against each other, then the receipt's bits.
    Exit 0 pass, 1 mismatch, 2 bad input, 3 not comparable."""
    from detent_audit.verifier.client import read_json_document

    documents = (read_json_document(request, "request"), read_json_document(response, "response"))
    _verify_cli([receipt], key, trusted_keys, model, mode, None, None, cache_dir, None, None, "1", deployment,
                as_json, response=documents)


# ---- serving

@app.command()
@handles_errors
def serve(
    model: str = typer.Option(None, "--model", "-m", help=_MODEL_HELP),
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
    max_model_len: int = typer.Option(None, "--max-model-len", help="Context length: prompt plus output tokens "
                                      "(default: the model's own, within the KV pool; reported by /v1/models)."),
    device: str = typer.Option("cpu", "--device", help="cpu | cuda (GPU kernels, CUDA graphs; a deployment fact)."),
    attention_streaming: bool = typer.Option(False, "--attention-streaming", help="GPU: the attention's streaming "
                                             "fold (small split strides stop costing prefill; a deployment fact)."),
    cache_dir: Path = typer.Option(None, "--cache-dir", help="JIT cache directory."),
    host: str = typer.Option("127.0.0.1", "--host", help="Address to listen on."),
    port: int = typer.Option(8000, "--port", help="Port to listen on."),
    served_model_name: str = typer.Option(None, "--served-model-name", help="Model name clients ask for "
                                                                            "(default: the model folder's name)."),
    max_queued: int = typer.Option(256, "--max-queued", help="Requests queued or running at most (then 503)."),
    engine: str = typer.Option("embedded", "--engine", help="embedded | vllm (vLLM's engine with the detent "
                                                            "plugin; the [vllm] extra)."),
    input_path: Path = typer.Option(None, "--input", help="Serve this JSONL file of requests offline, then exit."),
    output_path: Path = typer.Option(None, "--output", help="Where --input writes its results (JSONL)."),
    publish_deployment: Path = typer.Option(None, "--publish-deployment", help="Write the deployment (facts and "
                                            "hash) to this file, for verifiers' --deployment."),
) -> None:
    """Serve with a signed receipt for every response: an OpenAI-compatible HTTP server (default) or a file of
    requests (--input). On SIGTERM/SIGINT the server stops accepting, finishes the responses under way (for up
    to 60 s: what is still running then is cut off, without a receipt), writes the run manifest and exits."""
    from detent_audit.errors import BadInput
    from detent_audit.manifests.keys import load_private_key
    from detent_audit.server.node import ServingNode

    if rotate is not None and rotate < 1:
        raise BadInput(f"--rotate must be >= 1, got {rotate}")
    if (input_path is None) != (output_path is None):
        raise BadInput("--input and --output go together", remedy="give both, or neither to serve over HTTP")
    if max_queued < 1:
        raise BadInput(f"--max-queued must be >= 1, got {max_queued}")
    if max_model_len is not None and max_model_len < 2:
        raise BadInput(f"--max-model-len must be >= 2 (one prompt and one output token), got {max_model_len}")
    if output_path is not None and not output_path.parent.is_dir():
        raise BadInput(f"--output {output_path}: the folder {output_path.parent} does not exist")
    if output_path is not None and output_path.is_dir():
        raise BadInput(f"--output {output_path} is a folder", remedy="name the JSONL file to write")
    if manifest_out.exists() and not manifest_out.is_dir():
        raise BadInput(f"--manifest-out {manifest_out} is a file", remedy="name a folder (it is created if new)")
    private_key = load_private_key(key, _passphrase(passphrase_env))
    llm = _engine(model, mode, dtype, threads, tuple_file, cache_dir, device=device,
                  attention_streaming=attention_streaming, max_model_len=max_model_len, engine=engine)
    positions = (llm.model_config if engine == "vllm" else llm.model.config).max_position_embeddings
    if max_model_len is not None and max_model_len > positions:
        raise BadInput(f"--max-model-len {max_model_len} exceeds the model's {positions} positions",
                       remedy=f"pass --max-model-len {positions} or less")
    node = ServingNode(llm, private_key, manifest_out, rotate)
    if publish_deployment is not None:
        typer.echo(f"published deployment {node.publish(publish_deployment)} to {publish_deployment}", err=True)
    if input_path is not None:
        from rich.console import Console
        from rich.progress import Progress

        from detent_audit.server.offline import serve_offline

        try:
            with Progress(console=Console(stderr=True), transient=True) as progress:
                task = progress.add_task("serving", total=None)
                count = serve_offline(llm, node, input_path, output_path,
                                      progress=lambda done, total: progress.update(task, completed=done,
                                                                                  total=total))
        finally:
            manifest = node.close()
        typer.echo(f"OK: {count} requests served, receipts in {manifest_out / 'receipts'}"
                   + (f", run manifest {manifest}" if manifest else ""))
        return
    default_name = llm.model_name if engine == "vllm" else llm.config.resolved_model.name
    _serve_http(llm, node, served_model_name or default_name, host, port, max_queued)


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
