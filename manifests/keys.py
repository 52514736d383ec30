"""Ed25519 signing keys: key ids, key-pair files, and the trusted keys a verifier loads.

Files `generate_key(out)` writes:
- `out`: the private key as PKCS#8 PEM, `-----BEGIN ENCRYPTED PRIVATE KEY-----` (the best encryption
  `cryptography` offers) when a passphrase is given, else `-----BEGIN PRIVATE KEY-----`; mode 0600.
- `out.pub`: the public key as SubjectPublicKeyInfo PEM (`-----BEGIN PUBLIC KEY-----`), mode 0644.

Both are created exclusively and atomically: each is written to a temporary file in the same directory,
fsynced, then hard-linked to its name (`link` fails if the name exists, so nothing is ever overwritten) and
the temporary name removed; a reader never sees a partial key. If `out.pub` cannot be created, the `out`
this call created is removed again.

keyid = lowercase hex SHA-256 of the raw 32-byte Ed25519 public key. It is a hint that names a key; trust
comes only from the key files a verifier is given (`load_trusted_keys`), never from a keyid.
"""

from __future__ import annotations

import os
import stat
import tempfile
from pathlib import Path
from typing import NamedTuple

from cryptography.exceptions import UnsupportedAlgorithm
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from detent_audit.manifests.decoding import open_regular
from detent_audit.manifests.encoding import sha256_hex
from detent_audit.manifests.errors import KeyFileError, WrongPassphrase

MAX_KEY_FILE_BYTES = 64 * 1024
PUBLIC_SUFFIX = ".pub"


class GeneratedKey(NamedTuple):
    """What `generate_key` wrote."""

    private_path: Path
    public_path: Path
    keyid: str


def keyid(public_key: Ed25519PublicKey) -> str:
    """Lowercase hex SHA-256 of the raw 32-byte public key: a name for the key, never a reason to trust it."""
    return sha256_hex(public_key.public_bytes_raw())


def generate_key(out_path: str | Path, passphrase: bytes | None = None) -> GeneratedKey:
    """Create a fresh Ed25519 key pair at `out_path` (private, 0600) and `out_path.pub` (public).

    Raises `KeyFileError` if either file exists (nothing is overwritten or left behind), the directory is
    missing or not writable, or the passphrase is empty (pass None for an unencrypted key).
    """
    private_path = Path(out_path)
    public_path = private_path.with_name(private_path.name + PUBLIC_SUFFIX)
    if passphrase is not None and (not isinstance(passphrase, bytes) or not passphrase):
        raise KeyFileError("the passphrase must be non-empty bytes",
                           remedy="give a non-empty passphrase, or none for an unencrypted key")
    for path in (private_path, public_path):
        if os.path.lexists(path):
            raise KeyFileError(f"{path} already exists; keygen never overwrites a key",
                               remedy="choose another output path, or move the old key away yourself")
    key = Ed25519PrivateKey.generate()
    encryption = (serialization.BestAvailableEncryption(passphrase) if passphrase
                  else serialization.NoEncryption())
    private_pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, encryption)
    public_pem = key.public_key().public_bytes(serialization.Encoding.PEM,
                                               serialization.PublicFormat.SubjectPublicKeyInfo)
    _create_exclusive(private_path, private_pem, 0o600)
    try:
        _create_exclusive(public_path, public_pem, 0o644)
    except BaseException:
        private_path.unlink()
        raise
    return GeneratedKey(private_path, public_path, keyid(key.public_key()))


def _create_exclusive(path: Path, data: bytes, mode: int) -> None:
    """Write `data` to a new file `path` with `mode`, atomically; raise `KeyFileError` if `path` exists."""
    directory = path.parent
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=directory)  # O_EXCL, mode 0600
    except OSError as exc:
        raise KeyFileError(f"cannot create a file in {directory}: {exc.strerror or exc}",
                           remedy="create the directory, or choose a writable one") from None
    try:
        with os.fdopen(fd, "wb") as f:
            os.fchmod(f.fileno(), mode)
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        try:
            os.link(tmp, path)  # atomic, and fails rather than replace an existing name
        except FileExistsError:
            raise KeyFileError(f"{path} already exists; keygen never overwrites a key",
                               remedy="choose another output path, or move the old key away") from None
        except OSError as exc:
            raise KeyFileError(f"cannot create {path}: {exc.strerror or exc}",
                               remedy="write the key to a local file system with hard links") from None
    finally:
        os.unlink(tmp)
    dir_fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(dir_fd)  # the new name survives a crash
    finally:
        os.close(dir_fd)


def load_private_key(path: str | Path, passphrase: bytes | None = None) -> Ed25519PrivateKey:
    """The Ed25519 private key in the PKCS#8 PEM file `path`.

    Raises `KeyFileError` when the file is missing, readable by group or others (like OpenSSH, the key is
    refused), a public key, not a PEM private key, not Ed25519, or encrypted while no passphrase is given;
    `WrongPassphrase` when it does not decrypt with `passphrase`.
    """
    path = Path(path)
    data = _read_key_file(path)
    if b"-----BEGIN PUBLIC KEY-----" in data:
        raise KeyFileError(f"{path} is a public key, not a private key",
                           remedy="pass the private key file (the one without .pub)")
    mode = stat.S_IMODE(os.stat(path).st_mode)
    if mode & 0o077:
        raise KeyFileError(f"{path}: permissions {mode:04o} are too open for a private key",
                           remedy=f"run `chmod 600 {path}`: whoever can read the key can sign as this node")
    encrypted = b"-----BEGIN ENCRYPTED PRIVATE KEY-----" in data
    if encrypted and passphrase is None:
        raise KeyFileError(f"{path} is encrypted and no passphrase was given",
                           remedy="give the passphrase the key was created with")
    if not encrypted and passphrase is not None:
        raise KeyFileError(f"{path} is not encrypted, but a passphrase was given",
                           remedy="give no passphrase for this key")
    try:
        key = serialization.load_pem_private_key(data, password=passphrase)
    except ValueError:
        if encrypted:
            raise WrongPassphrase(f"{path}: the passphrase does not decrypt this key") from None
        raise KeyFileError(f"{path} is not a PEM private key") from None
    except (TypeError, UnsupportedAlgorithm) as exc:
        raise KeyFileError(f"{path} cannot be loaded as a private key: {exc}") from None
    if not isinstance(key, Ed25519PrivateKey):
        raise KeyFileError(f"{path} holds a {type(key).__name__.lstrip('_')}, not an Ed25519 key",
                           remedy="detent-audit signs with Ed25519 only; `detent-audit keygen` makes one")
    return key


def load_public_key(path: str | Path) -> Ed25519PublicKey:
    """The Ed25519 public key in the SubjectPublicKeyInfo PEM file `path`; raises `KeyFileError`."""
    path = Path(path)
    data = _read_key_file(path)
    if b"PRIVATE KEY-----" in data:
        raise KeyFileError(f"{path} is a private key; a verifier trusts public keys only",
                           remedy=(f"pass {path}{PUBLIC_SUFFIX}" if path.suffix != PUBLIC_SUFFIX else
                                   "pass the public key keygen wrote beside it (FILE.pub)")
                           + ", and keep the private key on the serving node")
    blocks = data.count(b"-----BEGIN ")
    if blocks > 1:  # the PEM loader would read the first and drop the others in silence
        raise KeyFileError(f"{path} holds {blocks} PEM blocks; a .pub file holds one public key",
                           remedy="put each node's public key in a file of its own")
    try:
        key = serialization.load_pem_public_key(data)
    except (ValueError, UnsupportedAlgorithm):
        raise KeyFileError(f"{path} is not a PEM public key") from None
    if not isinstance(key, Ed25519PublicKey):
        raise KeyFileError(f"{path} holds a {type(key).__name__.lstrip('_')}, not an Ed25519 key",
                           remedy="pass the .pub file `detent-audit keygen` wrote")
    return key


def load_trusted_keys(path: str | Path, problems: list[str] | None = None) -> dict[str, Ed25519PublicKey]:
    """The trusted public keys as {keyid: key}: one `.pub` file, or every `*.pub` file in a directory.

    A directory is read non-recursively and in sorted order; other files in it (a private key, notes) are
    ignored. A `*.pub` entry that is not a regular file, or not a usable key, is skipped and described in
    `problems` when a list is given (so one junk file does not end a run, and nothing is skipped in silence);
    without the list it raises. Raises `KeyFileError` for a missing path, a directory without a usable key,
    or a bad key file named directly.
    """
    path = Path(path)
    if not path.is_dir():
        key = load_public_key(path)
        return {keyid(key): key}
    keys: dict[str, Ed25519PublicKey] = {}
    found: list[str] = []
    for entry in sorted(p for p in path.iterdir() if p.name.endswith(PUBLIC_SUFFIX)):
        try:
            if not entry.is_file():
                raise KeyFileError(f"{entry}: not a regular file, skipped")
            key = load_public_key(entry)
        except KeyFileError as exc:
            if problems is None:
                raise
            found.append(exc.message)
            continue
        keys[keyid(key)] = key
    if problems is not None:
        problems += found
    if not keys:
        raise KeyFileError(f"{path}: no usable *{PUBLIC_SUFFIX} public key files in this directory"
                           + (f" ({'; '.join(found[:3])})" if found else ""),
                           remedy="put the serving nodes' .pub files there, or pass one .pub file")
    return keys


def _read_key_file(path: Path) -> bytes:
    try:
        with open_regular(path) as f:
            data = f.read(MAX_KEY_FILE_BYTES + 1)
    except OSError as exc:
        raise KeyFileError(f"{path}: cannot read key file: {exc.strerror or exc}") from None
    if len(data) > MAX_KEY_FILE_BYTES:
        raise KeyFileError(f"{path} is larger than any key file ({MAX_KEY_FILE_BYTES} bytes at most)")
    return data
