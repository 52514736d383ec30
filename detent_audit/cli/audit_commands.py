"""Commands of the audit: keygen, inspect, verify, verify-response, verify-eval."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import typer

from detent_audit.cli.options import (
    CACHE_DIR,
    DEPLOYMENTS,
    JSON,
    MODEL,
    PASSPHRASE_ENV,
    RECEIPT_MODEL,
    TRUSTED_KEY,
    TRUSTED_KEYS,
    WORKERS,
    one_key_source,
    passphrase,
    workers_count,
)
from detent_audit.cli.output import Progress, emit_json


def keygen(
    out: Path = typer.Option(..., "--out",
                             help="Private key file to create (the public key goes to OUT.pub)."),
    passphrase_env: str = PASSPHRASE_ENV,
) -> None:
    """Create an Ed25519 signing key (PKCS#8, mode 0600, never overwriting) and its public key."""
    from detent_audit.manifests.keys import generate_key

    key = generate_key(out, passphrase(passphrase_env))
    typer.echo(f"OK: private key {key.private_path}\nOK: public key {key.public_path}\nkeyid {key.keyid}")


def inspect(
    path: Path = typer.Argument(..., help="A receipt or run-manifest file."),
    as_json: bool = JSON,
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
    doc = {"unverified": True, "payload_type": env.payload_type, "signer_keyid_hint": env.keyid,
           "payload": doc}
    if as_json:
        emit_json(json.dumps(doc, indent=2, sort_keys=True))
    else:
        typer.echo(f"{path}: {env.payload_type} (NOT verified; signer hint {env.keyid})")
        typer.echo(json.dumps(doc["payload"], indent=2, sort_keys=True))


def verify(
    paths: list[Path] = typer.Argument(..., help="Receipts, folders of receipts, run manifests."),
    key: Path = TRUSTED_KEY, trusted_keys: Path = TRUSTED_KEYS, model: str = RECEIPT_MODEL,
    mode: str = typer.Option("rescore", "--mode", help="rescore (one teacher-forced prefill) | replay"),
    sample: float = typer.Option(None, "--sample", help="Verify a seeded sample: this fraction of receipts."),
    seed: int = typer.Option(None, "--seed", help="Seed of --sample, to repeat a sample (default: drawn at "
                                                  "random and reported, so a node cannot know the sample)."),
    cache_dir: Path = CACHE_DIR,
    threads: int = typer.Option(None, "--threads", help="Run with this many CPU threads (default: the "
                                                        "receipt's); a different count is not comparable."),
    tuple_file: Path = typer.Option(None, "--tuple", help="Verify as this tuple (default: the receipt's)."),
    workers: str = WORKERS, deployment: list[str] = DEPLOYMENTS,
    tensor_parallel: int = typer.Option(None, "--tensor-parallel-size", "-tp", min=1, show_default=False,
                                        help="Re-execute tensor-parallel receipts natively, one process per "
                                             "rank (must be the receipt's size) [default: every rank "
                                             "emulated in one process, the same bits on fewer devices]."),
    as_json: bool = JSON,
) -> None:
    """Verify receipts: signature, the client's request, deployment, tuple, re-execution, bits; folders: that
    run manifests cover every receipt. Exit 0 pass, 1 mismatch, 2 bad input, 3 not comparable."""
    _verify(paths, key, trusted_keys, model, mode, sample, seed, cache_dir, threads, tuple_file, workers,
            deployment, as_json, tensor_parallel=tensor_parallel)


def verify_response(
    request: Path = typer.Option(..., "--request", help="The request body the client sent (JSON)."),
    response: Path = typer.Option(..., "--response", help="The response it received (JSON, or the stream's "
                                                           "server-sent events)."),
    receipt: list[Path] = typer.Option(..., "--receipt", help="The node's receipt of it (repeat: one per "
                                                               "prompt of a batch)."),
    endpoint: str = typer.Option(None, "--endpoint", help="The endpoint the client called: "
                                                         "/v1/chat/completions or /v1/completions "
                                                         "(default: the one its body is for)."),
    key: Path = TRUSTED_KEY, trusted_keys: Path = TRUSTED_KEYS, model: str = RECEIPT_MODEL,
    mode: str = typer.Option("rescore", "--mode", help="rescore | replay"),
    cache_dir: Path = CACHE_DIR, deployment: list[str] = DEPLOYMENTS, as_json: bool = JSON,
) -> None:
    """Check a request, the response received (as the client's OpenAI SDK shows it) and the receipts against
    each other, then the receipts' bits. Exit 0 pass, 1 mismatch, 2 bad input, 3 not comparable."""
    from detent_audit.verifier.client import read_json_document

    documents = (read_json_document(request, "request"), read_json_document(response, "response"), endpoint)
    _verify(receipt, key, trusted_keys, model, mode, None, None, cache_dir, None, None, "1", deployment,
            as_json, response=documents)


def _verify(paths: list[Path], key: Path | None, trusted_keys: Path | None, model: str | None, mode: str,
            sample: float | None, seed: int | None, cache_dir: Path | None, threads: int | None,
            tuple_file: Path | None, workers: str, deployment: list[str] | None, as_json: bool,
            response: tuple[Any, Any, str | None] | None = None, tensor_parallel: int | None = None) -> None:
    """`verify`, and `verify-response` (with `response` = the request and response documents and the
    endpoint called)."""

    from detent_audit.errors import BadInput
    from detent_audit.manifests.keys import load_trusted_keys
    from detent_audit.verifier.receipt_file import CLOCK_SKEW_NS, EARLIEST_UNIX_NS
    from detent_audit.verifier.verify import load_deployments
    from detent_audit.verifier.verify import verify as run_verify

    key_source = one_key_source(key, trusted_keys)
    if sample is not None and not 0 < sample <= 1:
        raise BadInput(f"--sample must be in (0, 1], got {sample}")
    if seed is not None and sample is None:
        raise BadInput("--seed chooses the receipts of --sample; without --sample every receipt is verified",
                       remedy="add --sample FRACTION, or drop --seed")
    if threads is not None and threads < 1:
        raise BadInput(f"--threads must be >= 1, got {threads}")
    worker_count = workers_count(workers)
    if key is not None and key.is_dir():
        raise BadInput(f"--key {key} is a folder; --key takes one public key file",
                       remedy="pass --trusted-keys DIR to trust every *.pub file in a folder")
    key_problems: list[str] = []
    trusted = load_trusted_keys(key_source, key_problems)
    for problem in key_problems:  # a junk file is skipped, never in silence
        typer.echo(f"warning: trusted keys: {problem}", err=True)
    deployments = load_deployments(deployment) if deployment else None
    override = None
    if tuple_file is not None:
        from detent_audit.runtime.tuples import load_tuple

        override = load_tuple(tuple_file)
    options: dict[str, Any] = dict(model=model, mode=mode, sample=sample, seed=seed,
                                   cache_dir=str(cache_dir) if cache_dir else None, threads=threads,
                                   tuple_override=override, workers=worker_count, deployments=deployments,
                                   tensor_parallel=tensor_parallel)
    with Progress("re-executing", "receipts") as progress:
        show = progress.update
        if response is None:
            report = run_verify(paths, trusted, progress=show, **options)
        else:
            from detent_audit.verifier.client import verify_response as run_verify_response

            report = run_verify_response(response[0], response[1], paths, trusted, endpoint=response[2],
                                         progress=show, **options)
    skew_s = CLOCK_SKEW_NS // 10**9
    facts_note = ((f"facts checked against {len(report.published)} published deployment(s)"
                   if report.published
                   else "facts are self-asserted by the node (no --deployment given): its limits and the "
                        "tuple's values where the bits do not refute them")
                  + f"; signing times are the node's clock, bounded to [2020-01-01, now + {skew_s} s]")
    cov = report.coverage
    if as_json:
        emit_json(json.dumps({"mode": mode, "exit_code": report.exit_code, "counts": report.counts(),
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
        sampled = f"; a sample drawn with --seed {report.sample_seed}" if sample is not None else ""
        typer.echo(f"{c['OK']} ok, {c['FAIL']} failed, {c['BAD']} bad input, "
                   f"{c['NOT_COMPARABLE']} not comparable ({mode}){sampled}"
                   + "".join(f"; coverage not shown: {gap}" for gap in cov.gaps))
        typer.echo(f"{facts_note}; coverage: {cov.covered} of {cov.receipts} receipts in {cov.manifests} run "
                   f"manifest(s)" + (f", {len(cov.uncovered)} in none" if cov.uncovered else ""))
    raise typer.Exit(report.exit_code)


def verify_eval(
    run: Path = typer.Argument(..., help="lm-eval's --output_path folder (or its results_*.json); the run "
                                         "was made with --log_samples."),
    receipts: list[Path] = typer.Option(..., "--receipts", help="The run's receipts folder (or files)."),
    key: Path = TRUSTED_KEY, trusted_keys: Path = TRUSTED_KEYS, model: str = MODEL,
    include_path: list[Path] = typer.Option(None, "--include-path", help="Folder of the run's task YAML (as "
                                                                          "lm-eval's --include_path)."),
    cache_dir: Path = CACHE_DIR, workers: str = WORKERS, deployment: list[str] = DEPLOYMENTS,
    attest: Path = typer.Option(None, "--attest", help="Write the verdict as an in-toto Statement "
                                "(test-result predicate: scores, coverage, every receipt's digest)."),
    attest_key: Path = typer.Option(None, "--attest-key", help="The verifier's own Ed25519 key (keygen): "
                                    "the Statement is written in a DSSE envelope it signs."),
    passphrase_env: str = PASSPHRASE_ENV,
    as_json: bool = JSON,
) -> None:
    """Audit an lm-eval run (against the published deployment with --deployment, as verify): rebuild every
    document and request from the task's own data with lm-eval's own code, match each request to the receipt
    of the body lm-eval sent, verify them, recompute each document's metrics from the verified outputs; print
    the reported score, the recomputed one and the coverage, and name every document, task or record of the
    run that is not the task's, and why. Exit 0 when every document is covered and every score equal, 1
    otherwise, 2 bad input, 3 when the task's data cannot be loaded here. `--attest FILE` writes the verdict
    as an in-toto test-result Statement (signed with `--attest-key`)."""

    from detent_audit.errors import BadInput
    from detent_audit.manifests.keys import load_trusted_keys
    from detent_audit.verifier.eval_audit import score_line
    from detent_audit.verifier.eval_audit import verify_eval as run_verify_eval
    from detent_audit.verifier.verify import load_deployments

    key_source = one_key_source(key, trusted_keys)
    worker_count = workers_count(workers)
    if attest_key is not None and attest is None:
        raise BadInput("--attest-key signs the attestation: pass --attest FILE too")
    signer = None
    if attest_key is not None:
        from detent_audit.manifests.keys import load_private_key

        signer = load_private_key(attest_key, passphrase(passphrase_env))
    try:
        import lm_eval  # noqa: F401
    except ImportError:
        raise BadInput("verify-eval recomputes scores with lm-eval's own task code, "
                       "and lm-eval is not installed",
                       remedy="pip install 'lm-eval[api]'") from None
    trusted = load_trusted_keys(key_source)
    deployments = load_deployments(deployment) if deployment else None
    with Progress("verifying receipts", "receipts") as progress:
        report = run_verify_eval(run, receipts, trusted, model=model or None, deployments=deployments,
                                 include_path=[str(p) for p in include_path or []], workers=worker_count,
                                 cache_dir=str(cache_dir) if cache_dir else None, progress=progress.update)
    if attest is not None:
        from detent_audit.verifier.eval_attestation import write_attestation

        write_attestation(report, attest, signer)
    if as_json:
        emit_json(json.dumps(report.to_json(), indent=2))
        raise typer.Exit(report.exit_code)
    for s in report.scores:
        typer.echo(score_line(s, report.docs))
    for d in report.docs:
        if not d.covered:
            typer.echo(f"FAIL: {d.task} doc {d.doc_id}: {'; '.join(d.reasons)}")
    for problem in report.problems:
        typer.echo(f"FAIL: {problem}")
    for task, n in report.documents.items():  # a run of a --limit prefix is a run of those documents only
        typer.echo(f"{task}: the run's documents are {n['run']} of the task's {n['task']}"
                   + (f" (--limit {n['limit']})" if n["limit"] is not None else ""))
    covered = sum(d.covered for d in report.docs)
    c = report.receipt_counts
    typer.echo(f"{covered}/{len(report.docs)} samples covered; receipts: {c['OK']} ok, {c['FAIL']} failed, "
               f"{c['BAD'] + c['not_opened']} bad, {report.receipts_unmatched} matching no logged request; "
               + (f"facts checked against {len(report.published)} published deployment(s)" if report.published
                  else "facts are self-asserted by the node (no --deployment given)"))
    raise typer.Exit(report.exit_code)
