"""DSSE-style signed envelopes: the exact payload bytes, their type, and one Ed25519 signature over PAE.

Follows DSSE v1.0 (secure-systems-lab/dsse, protocol.md and envelope.md), stored as canonical msgpack instead
of JSON + base64 (the payload travels as raw bin):

    envelope  = {"payload": bin, "payloadType": str, "signatures": [{"keyid": str, "sig": bin(64)}]}
    signature = Ed25519(PAE(payloadType, payload))
    PAE(t, b) = "DSSEv1" SP len(t) SP t SP len(b) SP b     (len: ASCII decimal byte count, no leading 0)

Rules of this format (version 1):
- exactly one signature (as in a Sigstore bundle); the serving node signs its own receipts;
- keyid = lowercase hex SHA-256 of the raw public key: a hint that selects the trusted key to try, never a
  reason to accept (a signature is accepted only when it verifies under a trusted key whose own keyid is
  the hint);
- the signature is checked before the payload is parsed; the payload type after the signature;
- the envelope must be canonical msgpack (re-encoding it gives the input bytes), so no bit of the file is
  free to change.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from detent_audit.manifests import decoding as dec
from detent_audit.manifests import encoding as enc
from detent_audit.manifests.errors import BadSignature, InvalidReceipt, UntrustedKey
from detent_audit.manifests.keys import keyid as keyid_of

RECEIPT_PAYLOAD_TYPE = "application/vnd.detent-audit.receipt.v2+msgpack"
RUN_MANIFEST_PAYLOAD_TYPE = "application/vnd.detent-audit.run-manifest.v2+msgpack"
MAX_PAYLOAD_BYTES = 64 * 1024 * 1024
MAX_ENVELOPE_BYTES = MAX_PAYLOAD_BYTES + 1024  # the payload plus its type, one signature and the headers
MAX_PAYLOAD_TYPE_LEN = 256
SIGNATURE_LEN = 64
_LIMITS = dec.Limits(max_bytes=MAX_ENVELOPE_BYTES, max_str_len=MAX_PAYLOAD_TYPE_LEN,
                     max_bin_len=MAX_PAYLOAD_BYTES, max_array_len=16, max_map_len=16, max_objects=64)
_ENVELOPE_FIELDS = ("payload", "payloadType", "signatures")
_SIGNATURE_FIELDS = ("keyid", "sig")


def pae(payload_type: str, payload: bytes) -> bytes:
    """DSSE's pre-authentication encoding: the bytes a signature covers (type and payload, unambiguously)."""
    kind = payload_type.encode("utf-8")
    return b"DSSEv1 %d %b %d %b" % (len(kind), kind, len(payload), payload)


@dataclass(frozen=True)
class Envelope:
    """One signed payload. An `Envelope` that exists is well formed; its signature is checked by `verify`.

    payload_type: a media type naming encoding and schema, e.g. `RECEIPT_PAYLOAD_TYPE`.
    payload: the exact signed bytes. keyid: the signer's key id (a hint). signature: 64 bytes of Ed25519.
    """

    payload_type: str
    payload: bytes
    keyid: str
    signature: bytes

    def __post_init__(self) -> None:
        dec.check_str(self.payload_type, "envelope.payloadType", MAX_PAYLOAD_TYPE_LEN)
        if not isinstance(self.payload, bytes) or len(self.payload) > MAX_PAYLOAD_BYTES:
            raise InvalidReceipt(f"envelope.payload: expected at most {MAX_PAYLOAD_BYTES} bytes")
        dec.check_digest(self.keyid, "envelope.signatures[0].keyid")
        if not isinstance(self.signature, bytes) or len(self.signature) != SIGNATURE_LEN:
            raise InvalidReceipt(f"envelope.signatures[0].sig: expected {SIGNATURE_LEN} signature bytes")

    def to_bytes(self) -> bytes:
        """The canonical msgpack file contents."""
        return enc.pack({"payload": self.payload, "payloadType": self.payload_type,
                         "signatures": [{"keyid": self.keyid, "sig": self.signature}]})

    @classmethod
    def from_bytes(cls, data: bytes, *, error: type[InvalidReceipt] = InvalidReceipt) -> Envelope:
        """Parse an envelope file's bytes; every problem (size, truncation, schema, non-canonical) is `error`.

        Does not check the signature: call `verify`.
        """
        wire = dec.unpack(data, _LIMITS, what="envelope", error=error)
        wire = dec.fields(wire, _ENVELOPE_FIELDS, "envelope", error=error)
        signatures = wire["signatures"]
        if not isinstance(signatures, list) or len(signatures) != 1:
            raise error("envelope.signatures: expected exactly one signature")
        signature = dec.fields(signatures[0], _SIGNATURE_FIELDS, "envelope.signatures[0]", error=error)
        try:
            envelope = cls(wire["payloadType"], wire["payload"], signature["keyid"], signature["sig"])
        except InvalidReceipt as exc:
            raise error(exc.message) from None
        if envelope.to_bytes() != bytes(data):
            raise error("envelope: not canonical msgpack (re-encoding it gives other bytes)")
        return envelope

    def verify(self, trusted_keys: Mapping[str, Ed25519PublicKey]) -> str:
        """Check the signature against the trusted keys; return the signer's keyid (computed from the key).

        The mapping's own keys are not trusted: keys are indexed by `keyid(key)` here. Raises `UntrustedKey`
        when no trusted key has this envelope's keyid, `BadSignature` when the signature does not verify.
        """
        by_keyid = {keyid_of(key): key for key in trusted_keys.values()}
        key = by_keyid.get(self.keyid)
        if key is None:
            known = ", ".join(k[:16] for k in sorted(by_keyid)) or "none"
            raise UntrustedKey(f"signed by key {self.keyid}, which is not among the {len(by_keyid)} trusted "
                               f"key(s) ({known})")
        try:
            key.verify(self.signature, pae(self.payload_type, self.payload))
        except InvalidSignature:
            raise BadSignature(f"the signature by key {self.keyid} does not verify over this payload "
                               f"({len(self.payload)} bytes of {self.payload_type!r})") from None
        return self.keyid

    def open(self, trusted_keys: Mapping[str, Ed25519PublicKey], payload_type: str, *,
             error: type[InvalidReceipt] = InvalidReceipt) -> OpenedEnvelope:
        """Step (2): the signature over PAE(payloadType, payload) by a trusted key, before the payload is
        parsed; then the payload type, once it is known to be signed. Raises `UntrustedKey`, `BadSignature`,
        `error` (another payload type)."""
        signer = self.verify(trusted_keys)
        if self.payload_type != payload_type:
            raise error(f"envelope.payloadType: expected {payload_type!r}, got {self.payload_type!r}",
                        remedy="this file is another kind of signed document: verify it with its own command")
        return OpenedEnvelope(self.payload, signer)


class OpenedEnvelope(NamedTuple):
    """The payload of an envelope whose signature verified under the trusted key `keyid`."""

    payload: bytes
    keyid: str


def open_envelope(data: bytes, trusted_keys: Mapping[str, Ed25519PublicKey], payload_type: str, *,
                  error: type[InvalidReceipt] = InvalidReceipt) -> OpenedEnvelope:
    """Steps (1)-(2) of verifying a signed file (docs/design.md section 7); the caller decodes the payload
    only after this returns.

    Raises `error` (malformed envelope, other payload type), `UntrustedKey`, `BadSignature`.
    """
    # (1): bounded, canonical decode of the envelope only
    envelope = Envelope.from_bytes(data, error=error)
    # (2): the signature, then the payload type
    return envelope.open(trusted_keys, payload_type, error=error)


def sign_envelope(payload_type: str, payload: bytes, private_key: Ed25519PrivateKey, *,
                  named_keyid: str | None = None, error: type[InvalidReceipt] = InvalidReceipt) -> Envelope:
    """Sign `payload` as `payload_type` (Ed25519 is deterministic: same key and input, same envelope).

    `named_keyid`: the keyid the payload names as its signer; raises `error` unless it is this key's.
    """
    signer = keyid_of(private_key.public_key())
    if named_keyid is not None and named_keyid != signer:
        raise error(f"node_keyid: the payload names key {named_keyid}, but the signing key is {signer}",
                    remedy="build it with node_keyid=keyid(key.public_key()) of the key that signs")
    return Envelope(payload_type, payload, signer, private_key.sign(pae(payload_type, payload)))


def read_envelope_bytes(path: str | Path, *, error: type[InvalidReceipt] = InvalidReceipt) -> bytes:
    """An envelope file's bytes, refused before reading when larger than `MAX_ENVELOPE_BYTES`."""
    return dec.read_bounded(path, MAX_ENVELOPE_BYTES, what="signed envelope", error=error)
