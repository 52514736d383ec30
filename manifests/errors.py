"""Errors of receipts, run manifests and keys: each a `DetentError` with a remedy.

Exit codes follow docs/design.md section 7: 2 for a file that is malformed or unusable (bad input), 1 for a
verification failure (the file is well formed but is not what a trusted node signed, or a run does not match
its manifest).

| error | raised when | exit |
|---|---|---|
| `InvalidReceipt` | an envelope or receipt payload is unreadable, malformed, not canonical, off schema | 2 |
| `InvalidManifest` | the same for a run manifest (an `InvalidReceipt`, so one `except` catches both) | 2 |
| `UntrustedKey` | the envelope is signed by a key that is not among the trusted keys | 1 |
| `BadSignature` | the signature does not verify, or the payload names another key than the signer's | 1 |
| `ManifestMismatch` | the receipts present do not reproduce a run manifest's digests, root or counts | 1 |
| `KeyFileError` | a key file is missing, not a key, the wrong type, too open, or would be overwritten | 2 |
| `WrongPassphrase` | an encrypted private key does not decrypt with the passphrase given | 2 |
"""

from __future__ import annotations

from detent_audit.enums import ExitCode
from detent_audit.errors import BadInput, DetentError


class InvalidReceipt(BadInput):
    """A receipt file (envelope or payload) is malformed: every decode problem ends here, never elsewhere."""

    exit_code = ExitCode.BAD_INPUT
    remedy = ("the file is not a well-formed detent-audit receipt v2: it may be truncated, made by another "
              "version, or modified; obtain the original file from the serving node")


class InvalidManifest(InvalidReceipt):
    """A run-manifest file (envelope or payload) is malformed."""

    remedy = ("the file is not a well-formed detent-audit run manifest v2: it may be truncated, produced by "
              "another version, or modified; obtain the original file from the serving node")


class UntrustedKey(DetentError):
    """No trusted key matches the envelope's signer (a keyid is a hint: trust comes from key files only)."""

    exit_code = ExitCode.MISMATCH
    remedy = ("pass the serving node's public key (its `.pub` file, or a directory of them) as trusted; "
              "get it from the node's operator over a channel you trust, never from the receipt itself")


class BadSignature(DetentError):
    """The signature does not verify under the trusted key: the payload or its type changed after signing."""

    exit_code = ExitCode.MISMATCH
    remedy = ("the file was modified after the node signed it, or signed by another key than it names; "
              "obtain the original file from the serving node")


class ManifestMismatch(DetentError):
    """The receipts present do not reproduce a run manifest: some are missing, extra, or from another run.

    `missing` and `extra` hold the hex digests (sorted) of receipts listed but absent, and present but
    unlisted.
    """

    exit_code = ExitCode.MISMATCH
    remedy = "verify the manifest with the complete set of the run's receipt files, and nothing else"

    def __init__(self, message: str, *, missing: tuple[str, ...] = (), extra: tuple[str, ...] = (),
                 remedy: str | None = None) -> None:
        super().__init__(message, remedy=remedy)
        self.missing, self.extra = missing, extra


class KeyFileError(BadInput):
    """A key file cannot be used: missing, not a key, not Ed25519, too open, or already there."""

    exit_code = ExitCode.BAD_INPUT
    remedy = "create a key pair with `detent-audit keygen --out FILE` (writes FILE and FILE.pub)"


class WrongPassphrase(KeyFileError):
    """An encrypted private key did not decrypt with the passphrase given."""

    remedy = "pass the passphrase the key was created with (keys cannot be recovered without it)"
