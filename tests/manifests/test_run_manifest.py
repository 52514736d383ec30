"""Run manifests: RFC 6962 Merkle root, round trip, bit flips, strict decoding, checking a run's receipts."""

from __future__ import annotations

import functools
import hashlib
import random

import msgpack
import pytest
import receipt_samples
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from hypothesis import given, settings
from hypothesis import strategies as st

from detent_audit.manifests.dsse import RUN_MANIFEST_PAYLOAD_TYPE, sign_envelope
from detent_audit.manifests.errors import (
    BadSignature,
    InvalidManifest,
    InvalidReceipt,
    ManifestMismatch,
    UntrustedKey,
)
from detent_audit.manifests.keys import keyid
from detent_audit.manifests.receipt import (
    Receipt,
    sign_receipt,
    verify_envelope,
)
from detent_audit.manifests.run_manifest import (
    RunManifest,
    check_run,
    merkle_root,
    sign_run_manifest,
    verify_run_manifest,
)

KEY = Ed25519PrivateKey.generate()
NODE = keyid(KEY.public_key())
TRUSTED = {NODE: KEY.public_key()}


def rfc6962_root(leaves: list[bytes]) -> bytes:
    """RFC 6962 section 2.1, literally: split at the largest power of two smaller than n."""
    if not leaves:
        return hashlib.sha256(b"").digest()
    if len(leaves) == 1:
        return hashlib.sha256(b"\x00" + leaves[0]).digest()
    k = 1
    while 2 * k < len(leaves):
        k *= 2
    return hashlib.sha256(b"\x01" + rfc6962_root(leaves[:k]) + rfc6962_root(leaves[k:])).digest()


# receipts of one run that KEY signs
random_run = functools.partial(receipt_samples.random_run, key=KEY)


def make_run(seed: int, n: int) -> tuple[RunManifest, list[Receipt]]:
    rng = random.Random(seed)
    deployment, tuple_hash = rng.randbytes(32).hex(), rng.randbytes(32).hex()
    receipts = random_run(rng, n, run_id=f"eval-{seed}", deployment_hash=deployment, tuple_hash=tuple_hash)
    manifest = RunManifest.for_receipts(receipts, run_id=f"eval-{seed}", node_keyid=NODE,
                                        deployment_hash=deployment, tuple_hash=tuple_hash,
                                        time_unix_ns=rng.getrandbits(63))
    return manifest, receipts


def test_merkle_root_is_rfc6962() -> None:
    rng = random.Random(1)
    for n in list(range(0, 34)) + [100, 257]:
        digests = [rng.randbytes(32) for _ in range(n)]
        assert merkle_root(digests) == rfc6962_root(digests), n
    a, b, c = (rng.randbytes(32) for _ in range(3))
    assert merkle_root([a, b, c]) != merkle_root([a, b, c, c])  # the odd node is promoted, not duplicated
    assert merkle_root([a, b]) != merkle_root([b, a]) and merkle_root([a]) != a


def test_round_trip_is_bit_exact() -> None:
    for seed in range(6):
        manifest, receipts = make_run(seed, n=seed * 3 + 1)
        data = sign_run_manifest(manifest, KEY)
        got, signer = verify_run_manifest(data, TRUSTED)
        assert got == manifest and signer == NODE
        assert got.to_bytes() == manifest.to_bytes() and sign_run_manifest(got, KEY) == data
        assert got.receipt_count == len(receipts)
        assert got.merkle_root == rfc6962_root(sorted(bytes.fromhex(r.digest) for r in receipts)).hex()
        check_run(got, reversed(receipts))  # order does not matter
        assert RunManifest.from_bytes(manifest.to_bytes()).to_json() == manifest.to_json()


def test_check_run_recomputes_the_root_from_the_receipts_present() -> None:
    manifest, receipts = make_run(7, n=9)
    rng = random.Random(8)
    rng.shuffle(receipts)
    check_run(manifest, receipts)
    hashes = {"deployment_hash": manifest.deployment_hash, "tuple_hash": manifest.tuple_hash}
    with pytest.raises(ManifestMismatch, match="1 missing, 0 not in the manifest") as err:
        check_run(manifest, receipts[1:])
    assert err.value.missing == (receipts[0].digest,) and err.value.extra == ()
    stranger = random_run(rng, 1, run_id=manifest.run_id, first=3, **hashes)[0]
    with pytest.raises(ManifestMismatch, match="0 missing, 1 not in the manifest") as err:
        check_run(manifest, receipts + [stranger])
    assert err.value.extra == (stranger.digest,)
    with pytest.raises(ManifestMismatch, match="given twice"):
        check_run(manifest, receipts + receipts[:1])
    other = random_run(rng, 1, run_id=manifest.run_id, deployment_hash="0" * 64,
                       tuple_hash=manifest.tuple_hash)[0]
    with pytest.raises(ManifestMismatch, match="deployment_hash"):
        check_run(manifest, receipts[1:] + [other])
    outside = random_run(rng, 1, run_id=manifest.run_id, first=9, **hashes)[0]
    with pytest.raises(ManifestMismatch, match="outside this manifest's 0-8"):
        check_run(manifest, receipts + [outside])
    with pytest.raises(InvalidManifest, match="a rotation manifest of 2 receipts cannot cover"):
        RunManifest.for_receipts([receipts[0], outside], run_id=manifest.run_id, node_keyid=NODE,
                                 deployment_hash=manifest.deployment_hash, tuple_hash=manifest.tuple_hash,
                                 time_unix_ns=1, kind="rotation")
    assert RunManifest.for_receipts([receipts[0], outside], run_id=manifest.run_id, node_keyid=NODE,
                                    deployment_hash=manifest.deployment_hash, tuple_hash=manifest.tuple_hash,
                                    time_unix_ns=1, kind="recovery").seq_last == 9
    with pytest.raises(InvalidManifest, match="another run, node, deployment or tuple"):
        RunManifest.for_receipts(receipts + [other], run_id="r", node_keyid=NODE,
                                 deployment_hash=manifest.deployment_hash, tuple_hash=manifest.tuple_hash,
                                 time_unix_ns=1)


def test_every_single_bit_flip_of_a_manifest_is_rejected() -> None:
    manifest, _ = make_run(9, n=3)
    data = sign_run_manifest(manifest, KEY)
    rejected = 0
    for bit in range(len(data) * 8):
        flipped = bytearray(data)
        flipped[bit // 8] ^= 1 << (bit % 8)
        with pytest.raises((InvalidManifest, BadSignature, UntrustedKey)):
            verify_run_manifest(bytes(flipped), TRUSTED)
        rejected += 1
    assert rejected == len(data) * 8
    for end in range(len(data)):
        with pytest.raises(InvalidManifest):
            verify_run_manifest(data[:end], TRUSTED)


@settings(max_examples=300, deadline=None, database=None)
@given(st.integers(0, 3), st.lists(st.floats(0, 1, exclude_max=True), min_size=1, max_size=3),
       st.binary(max_size=16))
def test_the_payload_decoder_fails_only_with_invalid_manifest(
        seed: int, flips: list[float], tail: bytes) -> None:
    payload = make_run(seed, n=seed + 1)[0].to_bytes()
    for where in flips:
        bit = int(where * len(payload) * 8)
        payload = payload[: bit // 8] + bytes([payload[bit // 8] ^ (1 << (bit % 8))]) + payload[bit // 8 + 1:]
    try:
        manifest = RunManifest.from_bytes(payload + tail)
    except InvalidManifest:
        return
    assert manifest.to_bytes() == payload + tail


def _signed_wire(mutate) -> bytes:
    manifest, _ = make_run(10, n=4)
    w = msgpack.unpackb(manifest.to_bytes(), raw=False)
    mutate(w)
    return sign_envelope(RUN_MANIFEST_PAYLOAD_TYPE,
                         msgpack.packb({k: w[k] for k in sorted(w)}, use_bin_type=True), KEY).to_bytes()


BAD_MANIFESTS = {
    "unsorted_digests": (lambda w: w["receipt_digests"].reverse(), "sorted ascending and unique"),
    "duplicate_digest": (lambda w: w["receipt_digests"].__setitem__(1, w["receipt_digests"][0]),
                         "sorted ascending"),
    "wrong_root": (lambda w: w.__setitem__("merkle_root", "1" * 64), "not the root of the listed digests"),
    "wrong_count": (lambda w: w.__setitem__("receipt_count", 5), "receipt_count"),
    "extra_field": (lambda w: w.__setitem__("signer", "me"), "unknown signer"),
    "missing_field": (lambda w: w.pop("run_id"), "missing run_id"),
    "float_tokens": (lambda w: w.__setitem__("output_tokens", 3.0), "floats are not allowed"),
    "version_1": (lambda w: w.__setitem__("version", 1), "schema version 1"),
    "digest_as_bytes": (lambda w: w["receipt_digests"].__setitem__(0, b"\x00" * 32), "longer than the limit"),
    "kind_unknown": (lambda w: w.__setitem__("kind", "partial"), "kind"),
    "range_too_wide": (lambda w: w.__setitem__("seq_last", 7), "cannot cover that range"),
    # found by the fuzz: the range was checked before the digests were known to be a list
    "digests_not_a_list": (lambda w: w.__setitem__("receipt_digests", True), "receipt_digests: expected"),
    "digest_as_int": (lambda w: w["receipt_digests"].__setitem__(0, 7), r"receipt_digests\[0\]"),
}


@pytest.mark.parametrize("defect", sorted(BAD_MANIFESTS))
def test_a_validly_signed_manifest_with_a_defect_is_invalid(defect: str) -> None:
    mutate, message = BAD_MANIFESTS[defect]
    with pytest.raises(InvalidManifest, match=message):
        verify_run_manifest(_signed_wire(mutate), TRUSTED)


def test_receipts_and_manifests_are_not_interchangeable() -> None:
    manifest, receipts = make_run(11, n=2)
    with pytest.raises(InvalidReceipt, match="payloadType"):
        verify_envelope(sign_run_manifest(manifest, KEY), TRUSTED)
    with pytest.raises(InvalidManifest, match="payloadType"):
        verify_run_manifest(sign_receipt(receipts[0], KEY), TRUSTED)
    other = Ed25519PrivateKey.generate()
    with pytest.raises(UntrustedKey):
        verify_run_manifest(sign_run_manifest(manifest, KEY), {keyid(other.public_key()): other.public_key()})
    with pytest.raises(InvalidManifest, match="signing key"):
        sign_run_manifest(manifest, other)
