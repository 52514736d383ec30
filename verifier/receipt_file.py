"""Steps (1)-(4) of verification: a receipt file read, its signature checked, its payload decoded, and what
its own content claims checked, before any engine runs."""

from __future__ import annotations

from pathlib import Path

from detent_audit.manifests.dsse import RECEIPT_PAYLOAD_TYPE, Envelope, read_envelope_bytes
from detent_audit.manifests.encoding import facts_hash, tuple_hash
from detent_audit.manifests.errors import InvalidReceipt
from detent_audit.manifests.intoto import check_outer, check_statement, exported_name, read_export
from detent_audit.manifests.receipt import Receipt, open_payload
from detent_audit.verifier.plan import RECEIPT_SUFFIX
from detent_audit.verifier.steps import ClaimError, Step, at

EARLIEST_UNIX_NS = 1_577_836_800 * 10**9  # 2020-01-01T00:00:00Z: no receipt is older than this release line
CLOCK_SKEW_NS = 600 * 10**9  # a receipt may be dated this far after the verifier's clock


def open_receipt(path: Path, trusted: dict) -> Receipt:
    """Steps (1)-(3): the receipt in the file at `path`, signed by one of the `trusted` keys. Raises the
    step's error (`ReadError`, `SignatureError`, `PayloadError`), the manifests layer's error as its cause.

    An exported file (`manifests/intoto.py`) is read for the node's envelope it carries, which is checked as
    the node's own file is; its Statement must then be the one that envelope's payload gives."""
    exported = exported_name(path.name) is not None
    with at(Step.READ):  # (1): bounded read (regular files only), the envelope decoded
        export = read_export(path) if exported else None
        envelope = (Envelope.from_bytes(export.envelope.to_bytes()) if export is not None
                    else Envelope.from_bytes(read_envelope_bytes(path)))
    with at(Step.SIGNATURE):  # (2): the signature, before the payload is parsed; the payload type
        opened = envelope.open(trusted, RECEIPT_PAYLOAD_TYPE)
        if export is not None:
            check_outer(export, trusted)
    with at(Step.PAYLOAD):  # (3): schema, canonical re-encoding, its signer
        receipt = open_payload(opened).receipt
    if export is not None:
        with at(Step.SIGNATURE):  # (2) of an export: none of its claims beyond the node's signed payload
            check_statement(export, receipt)
    with at(Step.PAYLOAD):  # (3): the hashes the receipt states are the hashes of what it carries
        if facts_hash(receipt.deployment_facts) != receipt.deployment_hash:
            raise InvalidReceipt(f"{path.name}: deployment hash does not match the facts it carries")
        if tuple_hash(receipt.tuple_values) != receipt.tuple_hash:
            raise InvalidReceipt(f"{path.name}: tuple hash does not match the tuple it carries")
    return receipt


def check_claims(path: Path, r: Receipt, deployments: dict[str, dict | None] | None, now_ns: int) -> None:
    """Step (4): what a receipt's own content refutes before any engine: its file names another request; a
    time no node could have signed at; a deployment that is not among the published ones (None: none
    given)."""
    rid = r.request.request_id
    if (exported_name(path.name) or path.name) != f"{rid}{RECEIPT_SUFFIX}":
        raise ClaimError(f"the file is named {path.name!r}, but it is the receipt of request {rid!r} (a copy "
                         "under another request's name)", request_id=rid)
    if not EARLIEST_UNIX_NS <= r.time_unix_ns <= now_ns + CLOCK_SKEW_NS:
        raise ClaimError(f"signed at {r.time_unix_ns} ns since the epoch, outside [2020-01-01, the "
                         f"verifier's clock + {CLOCK_SKEW_NS // 10**9} s]: no node signed it then",
                         request_id=rid)
    if deployments is not None and r.deployment_hash not in deployments:
        raise ClaimError(f"its deployment {r.deployment_hash[:16]}... is not among the {len(deployments)} "
                         "published deployment(s) given with --deployment", request_id=rid)
