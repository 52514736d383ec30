"""Key files: mode 0600, exclusive and atomic creation, encryption, clear load errors, trusted-key loading."""

from __future__ import annotations

import hashlib
import os
import random
import stat

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from detent_audit.manifests import keys as keys_module
from detent_audit.manifests.errors import KeyFileError, WrongPassphrase
from detent_audit.manifests.keys import (
    generate_key,
    keyid,
    load_private_key,
    load_public_key,
    load_trusted_keys,
)

RNG = random.Random(0xC0FFEE)


def passphrase() -> bytes:
    return RNG.randbytes(RNG.randint(1, 40))


def mode_of(path: os.PathLike) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def test_encrypted_key_pair_round_trip(tmp_path) -> None:
    secret = passphrase()
    made = generate_key(tmp_path / "node.key", secret)
    assert made.private_path == tmp_path / "node.key" and made.public_path == tmp_path / "node.key.pub"
    assert mode_of(made.private_path) == 0o600
    assert made.private_path.read_bytes().startswith(b"-----BEGIN ENCRYPTED PRIVATE KEY-----")
    assert made.public_path.read_bytes().startswith(b"-----BEGIN PUBLIC KEY-----")
    key = load_private_key(made.private_path, secret)
    public = load_public_key(made.public_path)
    assert key.public_key() == public
    raw = public.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    assert len(raw) == 32 and made.keyid == keyid(public) == hashlib.sha256(raw).hexdigest()
    message = RNG.randbytes(100)
    public.verify(key.sign(message), message)  # raises if the pair does not match
    # no temporary files left
    assert sorted(p.name for p in tmp_path.iterdir()) == ["node.key", "node.key.pub"]


def test_unencrypted_key_and_mode_under_a_permissive_umask(tmp_path) -> None:
    old = os.umask(0)
    try:
        made = generate_key(tmp_path / "plain.key", None)
    finally:
        os.umask(old)
    assert mode_of(made.private_path) == 0o600 and mode_of(made.public_path) == 0o644
    assert made.private_path.read_bytes().startswith(b"-----BEGIN PRIVATE KEY-----")
    assert keyid(load_private_key(made.private_path).public_key()) == made.keyid


def test_wrong_or_missing_passphrase_is_a_clear_error(tmp_path) -> None:
    secret = passphrase()
    made = generate_key(tmp_path / "k", secret)
    with pytest.raises(WrongPassphrase, match="does not decrypt"):
        load_private_key(made.private_path, secret + b"!")
    with pytest.raises(KeyFileError, match="encrypted and no passphrase"):
        load_private_key(made.private_path, None)
    plain = generate_key(tmp_path / "p", None)
    with pytest.raises(KeyFileError, match="not encrypted, but a passphrase"):
        load_private_key(plain.private_path, secret)
    with pytest.raises(KeyFileError, match="non-empty"):
        generate_key(tmp_path / "e", b"")


def test_keygen_never_overwrites_and_leaves_the_first_key_intact(tmp_path) -> None:
    first = generate_key(tmp_path / "node.key", None)
    before = (first.private_path.read_bytes(), first.public_path.read_bytes())
    with pytest.raises(KeyFileError, match="already exists"):
        generate_key(tmp_path / "node.key", passphrase())
    assert (first.private_path.read_bytes(), first.public_path.read_bytes()) == before
    # a stale .pub alone also stops keygen, before a private key is written
    (tmp_path / "other.key.pub").write_bytes(b"stale")
    with pytest.raises(KeyFileError, match="already exists"):
        generate_key(tmp_path / "other.key", None)
    assert not (tmp_path / "other.key").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["node.key", "node.key.pub", "other.key.pub"]


def test_creation_is_exclusive_even_when_the_name_appears_after_the_check(tmp_path, monkeypatch) -> None:
    """The existence check is only for a friendly message: the hard link itself refuses to replace a file."""
    target = tmp_path / "race.key"
    target.write_bytes(b"someone else's key")
    monkeypatch.setattr(keys_module.os.path, "lexists", lambda path: False)
    with pytest.raises(KeyFileError, match="already exists"):
        generate_key(target, None)
    assert target.read_bytes() == b"someone else's key"
    assert not (tmp_path / "race.key.pub").exists()
    # the public name taken: the private key this call created is removed again
    (tmp_path / "pub-race.key.pub").write_bytes(b"taken")
    with pytest.raises(KeyFileError, match="already exists"):
        generate_key(tmp_path / "pub-race.key", None)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["pub-race.key.pub", "race.key"]


def test_load_errors_name_the_problem(tmp_path) -> None:
    made = generate_key(tmp_path / "k", None)
    os.chmod(made.private_path, 0o644)
    with pytest.raises(KeyFileError, match="permissions 0644 are too open"):
        load_private_key(made.private_path)
    os.chmod(made.private_path, 0o600)
    with pytest.raises(KeyFileError, match="is a public key"):
        load_private_key(made.public_path)
    with pytest.raises(KeyFileError, match="is a private key"):
        load_public_key(made.private_path)
    junk = tmp_path / "junk"
    junk.write_bytes(RNG.randbytes(300))
    junk.chmod(0o600)
    with pytest.raises(KeyFileError, match="not a PEM private key"):
        load_private_key(junk)
    with pytest.raises(KeyFileError, match="not a PEM public key"):
        load_public_key(junk)
    ec_key = ec.generate_private_key(ec.SECP256R1())
    ec_private = tmp_path / "ec.key"
    ec_private.write_bytes(ec_key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                                serialization.NoEncryption()))
    ec_private.chmod(0o600)
    with pytest.raises(KeyFileError, match="not an Ed25519 key"):
        load_private_key(ec_private)
    ec_public = tmp_path / "ec.pub"
    ec_public.write_bytes(ec_key.public_key().public_bytes(serialization.Encoding.PEM,
                                                           serialization.PublicFormat.SubjectPublicKeyInfo))
    with pytest.raises(KeyFileError, match="not an Ed25519 key"):
        load_public_key(ec_public)
    with pytest.raises(KeyFileError, match="cannot read"):
        load_private_key(tmp_path / "absent")
    with pytest.raises(KeyFileError, match="cannot create a file"):
        generate_key(tmp_path / "no-such-dir" / "k", None)


def test_trusted_keys_from_a_file_or_a_directory(tmp_path) -> None:
    made = [generate_key(tmp_path / f"node{i}.key", passphrase() if i % 2 else None) for i in range(3)]
    (tmp_path / "README.txt").write_text("notes")
    trusted = load_trusted_keys(tmp_path)  # the private keys beside the .pub files are ignored
    assert sorted(trusted) == sorted(m.keyid for m in made)
    assert all(keyid(key) == kid for kid, key in trusted.items())
    single = load_trusted_keys(made[1].public_path)
    assert list(single) == [made[1].keyid]
    (tmp_path / "empty").mkdir()
    with pytest.raises(KeyFileError, match="no usable \\*.pub public key files"):
        load_trusted_keys(tmp_path / "empty")
    with pytest.raises(KeyFileError, match="is a private key"):
        load_trusted_keys(made[0].private_path)


def test_keyid_is_the_sha256_of_the_raw_public_key() -> None:
    for _ in range(20):
        seed = RNG.randbytes(32)
        public = Ed25519PrivateKey.from_private_bytes(seed).public_key()
        assert keyid(public) == hashlib.sha256(public.public_bytes_raw()).hexdigest()
