"""Receipts: round trip, every bit flip rejected, bounded decoding, strict schema, canonical bytes, trust."""

from __future__ import annotations

import functools
import hashlib
import json
import os
import random
import struct
import subprocess
import sys
import tracemalloc
import zlib
from collections import Counter

import msgpack
import pytest
import receipt_samples
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from detent_audit.errors import DetentError
from detent_audit.manifests import encoding as enc
from detent_audit.manifests.dsse import (
    MAX_ENVELOPE_BYTES,
    RECEIPT_PAYLOAD_TYPE,
    RUN_MANIFEST_PAYLOAD_TYPE,
    Envelope,
    pae,
    read_envelope_bytes,
    sign_envelope,
)
from detent_audit.manifests.errors import BadSignature, InvalidReceipt, UntrustedKey
from detent_audit.manifests.keys import keyid
from detent_audit.manifests.receipt import (
    OUTPUT_DIGEST_TAG,
    OutputRecord,
    Receipt,
    RequestRecord,
    SamplingRecord,
    sign_receipt,
    verify_envelope,
)

KEY = Ed25519PrivateKey.generate()
TRUSTED = {keyid(KEY.public_key()): KEY.public_key()}


# a receipt of fresh random content that KEY signs
random_receipt = functools.partial(receipt_samples.random_receipt, key=KEY)


def wire(receipt: Receipt) -> dict:
    return msgpack.unpackb(receipt.to_bytes(), raw=False)


def sorted_pack(value: object) -> bytes:
    """Canonical layout (sorted keys, shortest headers) that, unlike `enc.pack`, lets floats and bad types
    through."""
    def sort(v: object) -> object:
        if isinstance(v, dict):
            return {k: sort(v[k]) for k in sorted(v)}
        return [sort(x) for x in v] if isinstance(v, list) else v
    return msgpack.packb(sort(value), use_bin_type=True)


def signed(payload: bytes, payload_type: str = RECEIPT_PAYLOAD_TYPE, key: Ed25519PrivateKey = KEY) -> bytes:
    """An envelope with a valid signature over arbitrary payload bytes."""
    return sign_envelope(payload_type, payload, key).to_bytes()


def test_round_trip_is_bit_exact() -> None:
    rng = random.Random(0x5EC0)
    for _ in range(50):
        receipt = random_receipt(rng)
        data = sign_receipt(receipt, KEY)
        got, signer = verify_envelope(data, TRUSTED)
        assert got == receipt and signer == keyid(KEY.public_key())
        assert got.to_bytes() == receipt.to_bytes() and sign_receipt(got, KEY) == data
        assert Receipt.from_bytes(receipt.to_bytes()) == receipt
        assert got.output.logprobs_f32le == receipt.output.logprobs_f32le
        for name in ("temperature", "top_p"):
            want = enc.f64_to_bits(getattr(receipt.request.sampling, name))
            assert enc.f64_to_bits(getattr(got.request.sampling, name)) == want
        assert Envelope.from_bytes(data).to_bytes() == data


def test_output_digest_follows_its_definition() -> None:
    rng = random.Random(7)
    receipt = random_receipt(rng)
    out = receipt.output
    n = len(out.token_ids)
    text = out.text.encode("utf-8")
    by_hand = hashlib.sha256(OUTPUT_DIGEST_TAG + struct.pack("<Q", n)
                             + b"".join(struct.pack("<I", t) for t in out.token_ids)
                             + out.logprobs_f32le + struct.pack("<Q", out.top_k)
                             + b"".join(struct.pack("<I", t) for t in out.top_token_ids)
                             + out.top_logprobs_f32le
                             + struct.pack("<Q", len(text)) + text).hexdigest()
    assert out.digest == by_hand == wire(receipt)["output"]["digest"]
    assert receipt.digest == hashlib.sha256(receipt.to_bytes()).hexdigest()
    floats = [-rng.expovariate(1.0) for _ in range(n)]
    rebuilt = OutputRecord.from_floats(out.token_ids, floats, "stop")
    assert rebuilt.logprobs == tuple(struct.unpack(f"<{n}f", struct.pack(f"<{n}f", *floats)))


def test_pae_matches_the_dsse_test_vector() -> None:
    assert pae("http://example.com/HelloWorld",
               b"hello world") == b"DSSEv1 29 http://example.com/HelloWorld 11 hello world"


def _flip(data: bytes, bit: int) -> bytes:
    flipped = bytearray(data)
    flipped[bit // 8] ^= 1 << (bit % 8)
    return bytes(flipped)


def test_every_single_bit_flip_of_one_file_is_rejected() -> None:
    data = sign_receipt(random_receipt(random.Random(11), max_prompt=8), KEY)
    outcomes: Counter[str] = Counter()
    for bit in range(len(data) * 8):
        with pytest.raises((InvalidReceipt, BadSignature, UntrustedKey)) as err:
            verify_envelope(_flip(data, bit), TRUSTED)
        outcomes[type(err.value).__name__] += 1
    assert sum(outcomes.values()) == len(data) * 8
    assert set(outcomes) == {"InvalidReceipt", "BadSignature", "UntrustedKey"}


def test_random_bit_flips_across_random_receipts_are_all_rejected() -> None:
    tried: Counter[str] = Counter()
    files = [sign_receipt(random_receipt(random.Random(seed)), KEY) for seed in range(16)]

    @settings(max_examples=1000, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @given(st.integers(0, len(files) - 1), st.floats(0, 1, exclude_max=True))
    def flip_is_rejected(which: int, where: float) -> None:
        data = files[which]
        tried["flips"] += 1
        try:
            verify_envelope(_flip(data, int(where * len(data) * 8)), TRUSTED)
        except DetentError as exc:
            assert isinstance(exc, (InvalidReceipt, BadSignature, UntrustedKey))
            tried["rejected"] += 1

    flip_is_rejected()
    assert tried["flips"] >= 1000 and tried["rejected"] == tried["flips"]


PAYLOADS = [random_receipt(random.Random(100 + seed)).to_bytes() for seed in range(8)]


@settings(max_examples=400, deadline=None, database=None)
@given(st.sampled_from(PAYLOADS), st.lists(st.floats(0, 1, exclude_max=True), min_size=1, max_size=3),
       st.integers(0, 1 << 16))
def test_the_payload_decoder_fails_only_with_invalid_receipt(
        payload: bytes, flips: list[float], cut: int) -> None:
    """Unsigned payload bytes, damaged anywhere: `from_bytes` gives InvalidReceipt or a receipt of exactly
    them."""
    for where in flips:
        payload = _flip(payload, int(where * len(payload) * 8))
    payload = payload[:cut] if cut < len(payload) else payload
    try:
        receipt = Receipt.from_bytes(payload)
    except InvalidReceipt:
        return
    assert receipt.to_bytes() == payload  # a flip inside a prompt token id, say, is a different valid payload


@settings(max_examples=300, deadline=None, database=None)
@given(st.binary(max_size=512))
def test_arbitrary_bytes_give_invalid_receipt(data: bytes) -> None:
    for decode in (Envelope.from_bytes, Receipt.from_bytes, lambda d: verify_envelope(d, TRUSTED)):
        with pytest.raises(InvalidReceipt):
            decode(data)


def test_every_truncation_and_any_trailing_bytes_are_invalid() -> None:
    data = sign_receipt(random_receipt(random.Random(3)), KEY)
    for end in range(len(data)):
        with pytest.raises(InvalidReceipt):
            verify_envelope(data[:end], TRUSTED)
    with pytest.raises(InvalidReceipt, match="trailing bytes"):
        verify_envelope(data + b"\x00", TRUSTED)
    with pytest.raises(InvalidReceipt, match="expected bytes"):
        verify_envelope("not bytes", TRUSTED)  # type: ignore[arg-type]


@pytest.mark.parametrize("header", [b"\xc6\xff\xff\xff\xff", b"\xdb\xff\xff\xff\xff", b"\xdd\xff\xff\xff\xff",
                                    b"\xdf\xff\xff\xff\xff"], ids=["bin32", "str32", "array32", "map32"])
def test_a_4_gib_declared_length_is_refused_without_allocating_it(header: bytes) -> None:
    payload_rest = os.urandom(64)
    crafted_envelope = b"\x83\xa7payload" + header + payload_rest
    # valid signature, hostile payload
    crafted_payload = signed(b"\x88\xaadeployment" + header + payload_rest)
    tracemalloc.start()
    try:
        for data in (crafted_envelope, header + payload_rest, crafted_payload):
            with pytest.raises(InvalidReceipt):
                verify_envelope(data, TRUSTED)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20


def test_a_file_over_the_size_cap_is_refused_before_reading(tmp_path) -> None:
    path = tmp_path / "huge.msgpack"
    with open(path, "wb") as f:
        f.truncate(MAX_ENVELOPE_BYTES + 1)  # sparse: costs no disk
    with pytest.raises(InvalidReceipt, match="larger than any signed envelope"):
        read_envelope_bytes(path)
    data = sign_receipt(random_receipt(random.Random(5)), KEY)
    (tmp_path / "r.msgpack").write_bytes(data)
    assert read_envelope_bytes(tmp_path / "r.msgpack") == data
    with pytest.raises(InvalidReceipt, match="cannot read"):
        read_envelope_bytes(tmp_path / "absent.msgpack")


def _set(path: tuple, value: object):
    def mutate(w: dict) -> None:
        for key in path[:-1]:
            w = w[key]
        w[path[-1]] = value
    return mutate


def _delete(path: tuple):
    def mutate(w: dict) -> None:
        for key in path[:-1]:
            w = w[key]
        del w[path[-1]]
    return mutate


def _u32(*ids: int) -> bytes:
    return struct.pack(f"<{len(ids)}I", *ids)


BAD_PAYLOADS = {
    "seed_is_text": (_set(("request", "seed"), "7"), "request.seed"),
    "seed_over_64_bits": (_set(("request", "seed"), -1), "request.seed"),
    "prompt_ids_not_whole_words": (_set(("request", "prompt_token_ids_u32le"), b"\x01\x02\x03"),
                                   "prompt_token_ids_u32le"),
    "token_ids_as_an_array": (_set(("output", "token_ids_u32le"), [1, 2]), "output.token_ids_u32le"),
    "empty_prompt": (_set(("request", "prompt_token_ids_u32le"), b""), "request.prompt_token_ids"),
    "token_list_is_map": (_set(("request", "prompt_token_ids_u32le"), {"a": 1}), "request.prompt_token_ids"),
    "float_temperature": (_set(("request", "sampling", "temperature_f64_bits"), 0.5),
                          "floats are not allowed"),
    "float_in_facts": (_set(("deployment", "facts", "gpu", "arch"), 9.0), "floats are not allowed"),
    "bytes_in_facts": (_set(("deployment", "facts", "gpu", "uuid"), b"\x00" * 16),
                       "binary data is not a fact"),
    "bool_ignore_eos_is_int": (_set(("request", "sampling", "ignore_eos"), 1), "ignore_eos"),
    "nan_temperature": (_set(("request", "sampling", "temperature_f64_bits"), 0x7FF8000000000000),
                        "temperature"),
    "top_p_above_one": (_set(("request", "sampling", "top_p_f64_bits"), enc.f64_to_bits(1.5)), "top_p"),
    "version_1": (_set(("version",), 1), "schema version 1"),
    "unknown_finish_reason": (_set(("output", "finish_reason"), "abort"), "finish_reason"),
    "logprobs_short": (_set(("output", "logprobs_f32le"), b"\x00\x00\x80\xbf"), "logprobs_f32le"),
    "logprobs_as_text": (_set(("output", "logprobs_f32le"), "x"), "logprobs_f32le"),
    "wrong_output_digest": (_set(("output", "digest"), "0" * 64), "output.digest"),
    "text_changed": (_set(("output", "text"), "another answer"), "output.digest"),
    "top_ids_not_k_per_token": (_set(("output", "top_token_ids_u32le"), _u32(5)), "top_token_ids"),
    "uppercase_keyid": (_set(("node_keyid",), "A" * 64), "node_keyid"),
    "short_hash": (_set(("deployment", "hash"), "ab"), "deployment.hash"),
    "empty_request_id": (_set(("request", "id"), ""), "request.id"),
    "empty_facts": (_set(("deployment", "facts"), {}), "deployment.facts"),
    "int_key_in_facts": (_set(("tuple", "values", "x"), {1: 2}), "map key must be a string"),
    "more_output_than_max_tokens": (_set(("request", "sampling", "max_tokens"), 1), "max_tokens"),
    "client_body_digest_wrong": (_set(("request", "client", "body_sha256"), "0" * 64), "body_sha256"),
    "client_api_unknown": (_set(("request", "client", "api"), "grpc"), "request.client.api"),
    "run_seq_negative": (_set(("run", "seq"), -1), "run.seq"),
    "missing_run": (_delete(("run",)), "missing run"),
    "extra_top_level_field": (_set(("comment",), "hi"), "unknown comment"),
    "extra_nested_field": (_set(("request", "sampling", "min_p_f64_bits"), 0), "unknown min_p_f64_bits"),
    "missing_field": (_delete(("output", "finish_reason")), "missing finish_reason"),
    "payload_not_a_map": (lambda w: w.clear() or w.update({"x": 1}), "missing"),
}


@pytest.mark.parametrize("defect", sorted(BAD_PAYLOADS))
def test_a_validly_signed_payload_with_a_defect_is_invalid(defect: str) -> None:
    mutate, message = BAD_PAYLOADS[defect]
    rng = random.Random(zlib.crc32(defect.encode()))
    w = wire(random_receipt(rng))
    tokens = (rng.getrandbits(32), rng.getrandbits(32))  # two tokens, within max_tokens
    out = OutputRecord(tokens, rng.randbytes(8), "stop", "ab", tokens + tokens, rng.randbytes(16))
    w["output"] = out._to_wire()
    w["request"]["sampling"]["max_tokens"] = rng.randint(2, 10)
    mutate(w)
    with pytest.raises(InvalidReceipt, match=message):
        verify_envelope(signed(sorted_pack(w)), TRUSTED)


def test_a_valid_signature_over_a_non_canonical_encoding_is_refused() -> None:
    payload = random_receipt(random.Random(13)).to_bytes()
    assert payload.endswith(b"\xa7version\x02") and payload[0] == 0x88
    variants = {
        "uint8_for_a_fixint": payload[:-1] + b"\xcc\x02",
        "str8_for_a_fixstr": payload[:-9] + b"\xd9\x07version\x02",
        "map16_for_a_fixmap": b"\xde\x00\x08" + payload[1:],
        "unsorted_keys": msgpack.packb(dict(reversed(list(msgpack.unpackb(payload).items()))),
                                       use_bin_type=True),
    }
    for name, data in variants.items():
        assert msgpack.unpackb(data, raw=False) == msgpack.unpackb(payload, raw=False), name
        with pytest.raises(InvalidReceipt, match="not canonical"):
            verify_envelope(signed(data), TRUSTED)
    with pytest.raises(InvalidReceipt, match="appears twice"):  # a repeated key is refused as it is decoded
        verify_envelope(signed(b"\x89" + payload[1:] + b"\xa7version\x02"), TRUSTED)
    envelope = msgpack.unpackb(sign_receipt(random_receipt(random.Random(14)), KEY))
    reordered = msgpack.packb(dict(reversed(list(envelope.items()))), use_bin_type=True)
    with pytest.raises(InvalidReceipt, match="envelope: not canonical"):
        verify_envelope(reordered, TRUSTED)


def test_trust_comes_from_the_key_never_from_the_keyid() -> None:
    receipt = random_receipt(random.Random(17))
    data = sign_receipt(receipt, KEY)
    other = Ed25519PrivateKey.generate()
    with pytest.raises(UntrustedKey, match="not among the 1 trusted"):
        verify_envelope(data, {keyid(other.public_key()): other.public_key()})
    with pytest.raises(UntrustedKey):
        verify_envelope(data, {})
    # a mapping that lies about keyids changes nothing: keys are re-indexed by their own keyid
    assert verify_envelope(data, {keyid(other.public_key()): KEY.public_key()}).receipt == receipt
    # a trusted key signing a receipt that names another trusted node is refused
    forged = signed(receipt.to_bytes(), key=other)
    with pytest.raises(BadSignature, match="names node key"):
        verify_envelope(forged, {**TRUSTED, keyid(other.public_key()): other.public_key()})
    with pytest.raises(InvalidReceipt, match="signing key"):
        sign_receipt(receipt, other)


def test_a_receipt_payload_under_another_type_is_refused() -> None:
    data = signed(random_receipt(random.Random(19)).to_bytes(), RUN_MANIFEST_PAYLOAD_TYPE)
    with pytest.raises(InvalidReceipt, match="payloadType"):
        verify_envelope(data, TRUSTED)


def test_constructors_validate() -> None:
    rng = random.Random(23)
    good = random_receipt(rng)
    with pytest.raises(InvalidReceipt, match="floats are not allowed"):
        Receipt({"x": [1, 0.5]}, good.deployment_hash, good.tuple_values, good.tuple_hash, good.request,
                good.output, good.run, good.node_keyid, good.time_unix_ns)
    with pytest.raises(InvalidReceipt, match="binary data is not a fact"):
        Receipt({"x": b"\x00"}, good.deployment_hash, good.tuple_values, good.tuple_hash, good.request,
                good.output, good.run, good.node_keyid, good.time_unix_ns)
    with pytest.raises(InvalidReceipt, match="temperature"):
        SamplingRecord(float("inf"), 0, 1.0, 4)
    with pytest.raises(InvalidReceipt, match="top_p"):
        SamplingRecord(1.0, 0, 0.0, 4)
    with pytest.raises(InvalidReceipt, match="4 per output token"):
        OutputRecord((1, 2), b"\x00" * 4, "stop")
    with pytest.raises(InvalidReceipt, match="request.seed"):
        RequestRecord("r", good.request.client, (1,), good.request.sampling, 2**64)
    with pytest.raises(InvalidReceipt, match="same number of alternatives"):
        OutputRecord.from_floats((1, 2), (-1.0, -2.0), "stop", "x", [[(1, -1.0)], [(1, -1.0), (2, -3.0)]])
    assert isinstance(good.deployment_facts["model"]["shape"], tuple)
    with pytest.raises(TypeError):
        good.deployment_facts["model"]["name"] = "changed"  # type: ignore[index]

    class Params:  # the engine's SamplingParams, by attribute
        temperature, top_k, top_p, max_tokens = 0, 5, 0.9, 8
        stop_token_ids, ignore_eos, logprobs = [3], True, 2
    assert SamplingRecord.from_params(Params) == SamplingRecord(0.0, 5, 0.9, 8, (3,), True, 2)


def test_json_view_shows_bits_beside_values() -> None:
    receipt = random_receipt(random.Random(29))
    view = json.loads(receipt.to_json())
    sampling = view["request"]["sampling"]
    for name in ("temperature", "top_p"):
        value = getattr(receipt.request.sampling, name)
        assert int(sampling[name]["f64_bits_hex"], 16) == enc.f64_to_bits(value)
    logprobs = view["output"]["logprobs"]
    assert bytes.fromhex(logprobs["f32le_hex"]) == receipt.output.logprobs_f32le
    assert len(logprobs["values"]) == len(receipt.output.token_ids)
    assert view["deployment"]["facts"]["gpu"]["uuid"] == receipt.deployment_facts["gpu"]["uuid"]
    assert view["output"]["text"] == receipt.output.text and view["run"]["seq"] == receipt.run.seq
    assert view["request"]["client"]["body_sha256"] == receipt.request.client.body_sha256
    assert view["time"]["unix_ns"] == receipt.time_unix_ns and view["time"]["utc_rfc3339"].endswith("Z")
    assert view["digest_sha256"] == receipt.digest


def test_manifests_import_neither_torch_nor_the_engine() -> None:
    code = ("import sys, detent_audit.manifests.receipt, detent_audit.manifests.run_manifest, "
            "detent_audit.manifests.keys; bad = [m for m in sys.modules if m == 'torch' or "
            "m.startswith('detent_audit.engine')]; assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_open_regular_reads_files_and_refuses_the_rest_with_or_without_o_nonblock(
        tmp_path, monkeypatch) -> None:
    """POSIX opens without blocking (a FIFO would wait for a writer); where O_NONBLOCK does not exist
    (Windows, whose set_blocking takes pipes only) a regular file still reads and set_blocking is never
    called."""
    from detent_audit.manifests.decoding import read_bounded

    data = os.urandom(300)
    (tmp_path / "f.receipt").write_bytes(data)
    os.mkfifo(tmp_path / "fifo.receipt")
    assert read_bounded(tmp_path / "f.receipt", 1000, what="receipt") == data
    with pytest.raises(InvalidReceipt, match="not a regular file"):
        read_bounded(tmp_path / "fifo.receipt", 1000, what="receipt")
    with pytest.raises(InvalidReceipt, match="not a regular file"):
        read_bounded(tmp_path, 1000, what="receipt")
    monkeypatch.delattr(os, "O_NONBLOCK")

    def pipes_only(fd, blocking):
        raise OSError(22, "The parameter is incorrect")

    monkeypatch.setattr(os, "set_blocking", pipes_only)
    assert read_bounded(tmp_path / "f.receipt", 1000, what="receipt") == data
