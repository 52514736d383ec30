"""The `detent-audit` command line: the app (app.py) with every command registered, in the order `--help`
lists them. The command modules never import the app: it imports them, here."""

from __future__ import annotations

import sys

from detent_audit import isa
from detent_audit.cli import (
    audit_commands,
    engine_commands,
    export_command,
    serve_command,
    sglang_command,
    solve_command,
)
from detent_audit.cli.app import app, register, version
from detent_audit.errors import DetentError

register([
    ("version", version),
    ("solve", solve_command.solve),
    ("info", engine_commands.info),
    ("battery", engine_commands.battery),
    ("generate", engine_commands.generate),
    ("tune", engine_commands.tune),
    ("import-gguf", engine_commands.import_gguf),
    ("keygen", audit_commands.keygen),
    ("inspect", audit_commands.inspect),
    ("verify", audit_commands.verify),
    ("verify-eval", audit_commands.verify_eval),
    ("verify-response", audit_commands.verify_response),
    ("export", export_command.export),
    ("serve", serve_command.serve),
    ("sglang-config", sglang_command.sglang_config),
])


def main() -> None:
    """The entry point: the ISA cap (`--isa`, `$DETENT_AUDIT_ISA`) pinned before the command imports torch
    (the libraries read it once, when they initialise), then the app."""
    try:
        isa.pin(isa.requested(sys.argv[1:]))
    except DetentError as exc:
        print(f"FAIL: {exc.diagnostics()}", file=sys.stderr)
        sys.exit(int(exc.exit_code))
    app()


__all__ = ["app", "main"]
