"""`detent-audit serve`: a signed receipt for every response, over HTTP or for a file of requests."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import typer

if TYPE_CHECKING:
    from detent_audit.runtime.contract import Engine
    from detent_audit.server.node import ServingNode

from detent_audit.cli.engines import open_engine
from detent_audit.cli.options import (
    ATTENTION_STREAMING,
    CACHE_DIR,
    DEVICE,
    DTYPE,
    ENGINE,
    MAX_MODEL_LEN,
    MODE,
    MODEL,
    PASSPHRASE_ENV,
    TENSOR_PARALLEL,
    THREADS,
    TUPLE,
    passphrase,
)


def serve(
    model: str = MODEL, tuple_file: Path = TUPLE,
    signing_key: Path = typer.Option(None, "--signing-key", show_default=False,
                                     help="The node's private signing key (PKCS#8 PEM, mode 0600): it signs "
                                          "every receipt. Never give it to a client."),
    old_key: Path = typer.Option(None, "--key", hidden=True, help="Deprecated: --signing-key."),
    api_key: str = typer.Option(None, "--api-key", envvar="DETENT_API_KEY", show_default=False,
                                help="Clients must send 'Authorization: Bearer <this>' to the /v1/ routes "
                                     "(401 otherwise), as vLLM's --api-key; /health, /metrics and the "
                                     "tokenizer routes stay open. Not the signing key."),
    passphrase_env: str = PASSPHRASE_ENV,
    manifest_out: Path = typer.Option(..., "--manifest-out", help="Folder for receipts/ and manifests/."),
    rotate: int = typer.Option(None, "--rotate", help="Write a run manifest every N receipts (and on exit)."),
    mode: str = MODE, dtype: str = DTYPE, threads: int = THREADS, max_model_len: int = MAX_MODEL_LEN,
    device: str = DEVICE, attention_streaming: bool = ATTENTION_STREAMING, cache_dir: Path = CACHE_DIR,
    host: str = typer.Option("127.0.0.1", "--host", help="Address to listen on."),
    port: int = typer.Option(8000, "--port", help="Port to listen on."),
    served_model_name: str = typer.Option(None, "--served-model-name",
                                          help="Model name clients ask for "
                                               "(default: the model folder's name)."),
    max_queued: int = typer.Option(256, "--max-queued",
                                   help="Requests queued or running at most (then 503)."),
    engine: str = ENGINE, tensor_parallel_size: int = TENSOR_PARALLEL,
    input_path: Path = typer.Option(None, "--input",
                                    help="Serve this JSONL file of requests offline, then exit."),
    output_path: Path = typer.Option(None, "--output", help="Where --input writes its results (JSONL)."),
    publish_deployment: Path = typer.Option(None, "--publish-deployment",
                                            help="Write the deployment (facts and hash) to this file, for "
                                                 "verifiers' --deployment."),
) -> None:
    """Serve with a signed receipt for every response: an OpenAI-compatible HTTP server (default) or a file of
    requests (--input). On SIGTERM/SIGINT the server stops accepting, finishes the responses under way (for up
    to 60 s: what is still running then is cut off, without a receipt), writes the run manifest and exits."""
    from detent_audit.errors import BadInput
    from detent_audit.manifests.keys import load_private_key

    if old_key is not None:
        typer.echo("detent-audit: serve --key is deprecated: pass the private signing key as --signing-key",
                   err=True)
        if signing_key is not None and signing_key != old_key:
            raise BadInput("--signing-key and the deprecated --key name different files", remedy="pass one")
        signing_key = old_key
    if signing_key is None:
        raise BadInput("serve needs the node's private signing key: --signing-key FILE",
                       remedy="make one with `detent-audit keygen --out node.key`")
    if api_key is not None and not api_key.strip():
        raise BadInput("--api-key is empty",
                       remedy="give a token clients send as 'Authorization: Bearer <token>'")
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
        raise BadInput(f"--manifest-out {manifest_out} is a file",
                       remedy="name a folder (it is created if new)")
    private_key = load_private_key(signing_key, passphrase(passphrase_env))
    llm = open_engine(model, mode, dtype, threads, tuple_file, cache_dir, device=device,
                      attention_streaming=attention_streaming, max_model_len=max_model_len, engine=engine,
                      tensor_parallel_size=tensor_parallel_size)
    try:
        _serve_with(llm, private_key, manifest_out, rotate, publish_deployment, input_path, output_path,
                    max_model_len, served_model_name, host, port, max_queued, api_key)
    finally:  # a tensor-parallel engine's other ranks stop with it, however serving ended
        llm.shutdown()


def _serve_with(llm: Engine, private_key: Any, manifest_out: Path, rotate: int | None,
                publish_deployment: Path | None, input_path: Path | None, output_path: Path | None,
                max_model_len: int | None, served_model_name: str | None, host: str, port: int,
                max_queued: int, api_key: str | None) -> None:
    from detent_audit.errors import BadInput
    from detent_audit.server.node import ServingNode

    positions = llm.model_positions
    if max_model_len is not None and max_model_len > positions:
        raise BadInput(f"--max-model-len {max_model_len} exceeds the model's {positions} positions",
                       remedy=f"pass --max-model-len {positions} or less")
    node = ServingNode(llm, private_key, manifest_out, rotate)
    if publish_deployment is not None:
        digest = node.publish(publish_deployment)
        typer.echo(f"published deployment {digest} to {publish_deployment}", err=True)
    if input_path is not None and output_path is not None:
        _serve_file(llm, node, input_path, output_path, manifest_out)
        return
    _serve_http(llm, node, served_model_name or llm.model_name, host, port, max_queued, api_key)


def _serve_file(llm: Engine, node: ServingNode, input_path: Path, output_path: Path,
                manifest_out: Path) -> None:
    """`--input`: every request of the file answered and signed, in order; the run manifest written."""
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


def _serve_http(llm: Engine, node: ServingNode, model_name: str, host: str, port: int, max_queued: int,
                api_key: str | None) -> None:
    """Run uvicorn until SIGTERM/SIGINT; the app's shutdown stops the engine and writes the run manifest."""
    import uvicorn

    from detent_audit.server.app import create_app
    from detent_audit.server.async_engine import AsyncEngine

    engine = AsyncEngine(llm, max_queued=max_queued)
    config = uvicorn.Config(create_app(engine, node, model_name, api_key=api_key), host=host, port=port,
                            log_level="warning",
                            timeout_graceful_shutdown=60, lifespan="on")
    typer.echo(f"serving {model_name} on http://{host}:{port}/v1 (receipts in {node.out / 'receipts'})",
               err=True)
    try:
        uvicorn.Server(config).run()  # re-raises a captured SIGINT/SIGTERM after a graceful shutdown
    finally:
        engine.shutdown(drain=False)  # no-ops after a clean shutdown; else nothing answers these any more
        node.close()
