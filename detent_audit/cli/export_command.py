"""export: receipts and run manifests as in-toto Statements or sigstore bundles (`manifests/intoto.py`)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import typer

from detent_audit.cli.options import JSON, PASSPHRASE_ENV, passphrase
from detent_audit.cli.output import emit_json


def export(
    path: Path = typer.Argument(..., help="A receipt or run-manifest file, or a folder (each one under it)."),
    form: str = typer.Option("intoto", "--format", help="intoto (an in-toto Statement v1; in a DSSE envelope "
                                                        "with --signing-key) | sigstore-bundle (needs "
                                                        "--signing-key; no transparency-log entry)."),
    out: Path = typer.Option(None, "--out", help="Output file (one input file) or folder [default: beside "
                             "each input, named FILE.intoto.json or FILE.sigstore.json]."),
    signing_key: Path = typer.Option(None, "--signing-key", help="The exporter's Ed25519 key (keygen), which "
                                                                 "signs the Statement's envelope; the node's "
                                                                 "own signature is carried unchanged."),
    passphrase_env: str = PASSPHRASE_ENV,
    as_json: bool = JSON,
) -> None:
    """Export receipts and run manifests losslessly (the node's signed envelope inside); `verify` reads the
    exported files as it reads the node's. A file that does not decode is named and not exported (exit 2)."""
    from detent_audit.errors import BadInput, ExitCode
    from detent_audit.manifests.dsse import Envelope, read_envelope_bytes
    from detent_audit.manifests.errors import InvalidReceipt
    from detent_audit.manifests.intoto import FORMATS, SUFFIXES, exported_name
    from detent_audit.manifests.intoto import export as export_file
    from detent_audit.manifests.keys import load_private_key
    from detent_audit.verifier.plan import collect

    if form not in FORMATS:
        raise BadInput(f"--format: expected one of {', '.join(FORMATS)}, got {form!r}")
    if form == "sigstore-bundle" and signing_key is None:
        raise BadInput("a sigstore bundle carries a signed envelope: pass --signing-key",
                       remedy="create one with `detent-audit keygen` (the node's own key works too)")
    key = None if signing_key is None else load_private_key(signing_key, passphrase(passphrase_env))
    files = collect([path])
    if files.bad:
        raise BadInput(files.bad[0].message)
    sources = [p for p in (*files.receipts, *files.manifests) if exported_name(p.name) is None]
    if not sources:
        raise BadInput(f"{path}: no receipt or run-manifest file to export (an exported file is not exported "
                       "again)")
    if out is not None and path.is_file():
        targets = {sources[0]: out}
    else:
        targets = {p: (p if out is None else out / p.relative_to(path)).with_name(p.name + SUFFIXES[form])
                   for p in sources}
    written, refused = [], []
    for source, target in sorted(targets.items()):
        try:
            data = export_file(Envelope.from_bytes(read_envelope_bytes(source)), form, key)
        except InvalidReceipt as exc:  # a file no Statement can describe: named, the others still exported
            refused.append({"source": str(source), "error": exc.message})
            continue
        target.parent.mkdir(parents=True, exist_ok=True)
        temporary = target.with_name(f".{target.name}.tmp")
        temporary.write_bytes(data)
        os.replace(temporary, target)
        written.append({"source": str(source), "written": str(target)})
    if as_json:
        emit_json(json.dumps({"format": form, "files": written, "refused": refused}, indent=2))
    else:
        for entry in written:
            typer.echo(f"OK: {entry['written']} ({form} of {entry['source']})")
        for entry in refused:
            typer.echo(f"FAIL: {entry['source']}: not exported: {entry['error']}", err=True)
    if refused:
        raise typer.Exit(ExitCode.BAD_INPUT)
