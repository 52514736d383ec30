"""The serving node: signs a receipt for every response and writes it durably before the response leaves.

Receipt files are `<manifest-out>/receipts/<receipt-id>.receipt` (the DSSE envelope bytes), each written to a
temporary file, fsynced, renamed into place and the directory fsynced: a crash loses no receipt of an
answered request. A run manifest (the Merkle root of the receipt digests since the last one) is written every
`rotate` receipts and on close, as `<manifest-out>/manifests/run-<n>.manifest`.
"""

from __future__ import annotations

import re
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from detent_audit.atomic import write_atomically
from detent_audit.engine.facts import facts_hash
from detent_audit.engine.llm import RequestOutput
from detent_audit.engine.sampling_params import SamplingParams
from detent_audit.engine.tuples import tuple_hash
from detent_audit.engine_api import Engine
from detent_audit.errors import BadInput
from detent_audit.manifests.keys import keyid as keyid_of
from detent_audit.manifests.receipt import (
    OutputRecord,
    Receipt,
    RequestRecord,
    SamplingRecord,
    sign_receipt,
)
from detent_audit.manifests.run_manifest import RunManifest, sign_run_manifest

RECEIPT_SUFFIX = ".receipt"
MANIFEST_SUFFIX = ".manifest"
RECEIPT_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")  # a plain file name in receipts/: no separator, no dot first


def tuple_values(llm: Engine) -> dict[str, dict[str, Any]]:
    """What a receipt commits to as the tuple: the per-family pins and knobs, and the mode (as `mode.name`)."""
    return llm.tuple_values()


@dataclass(frozen=True)
class SignedReceipt:
    receipt_id: str
    path: Path
    receipt: Receipt


class ServingNode:
    """Owns the signing key and the output folder. Thread-safe: the HTTP server signs from its threads."""

    def __init__(self, llm: Engine, private_key: Any, manifest_out: str | Path, rotate: int | None = None) -> None:
        self.llm, self.key, self.rotate = llm, private_key, rotate
        self.out = Path(manifest_out)
        try:
            (self.out / "receipts").mkdir(parents=True, exist_ok=True)
            (self.out / "manifests").mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise BadInput(f"{self.out}: cannot make the receipts and manifests folders ({exc.strerror})",
                           remedy="give --manifest-out a folder this user can write") from None
        self.keyid = keyid_of(private_key.public_key())
        self.facts = llm.facts()
        self.facts_hash = facts_hash(self.facts)
        self.tuple = tuple_values(llm)
        self.tuple_hash = tuple_hash(self.tuple)
        self.run_id = uuid.uuid4().hex
        self._lock = threading.Lock()
        self._pending: list[Receipt] = []
        self._num_manifests = len(list((self.out / "manifests").glob(f"*{MANIFEST_SUFFIX}")))

    def sign(self, output: RequestOutput, params: SamplingParams, request_id: str | None = None) -> SignedReceipt:
        """Sign and durably write the receipt of one finished request; returns where it is."""
        receipt_id = request_id or uuid.uuid4().hex
        if not RECEIPT_ID.fullmatch(receipt_id):
            raise BadInput(f"request id {receipt_id!r} cannot name a receipt file",
                           remedy="use 1-128 letters, digits, '.', '_' or '-', starting with a letter or digit")
        receipt = Receipt(
            deployment_facts=self.facts, deployment_hash=self.facts_hash,
            tuple_values=self.tuple, tuple_hash=self.tuple_hash,
            request=RequestRecord(receipt_id, tuple(output.prompt_token_ids), SamplingRecord.from_params(params),
                                  params.seed),
            output=OutputRecord.from_floats(output.token_ids, output.logprobs, output.finish_reason or "length"),
            node_keyid=self.keyid, time_unix_ns=time.time_ns())
        envelope = sign_receipt(receipt, self.key)
        path = self.receipt_path(receipt_id)
        with self._lock:
            if path.exists():
                raise FileExistsError(f"a receipt named {path.name} exists already")
            write_atomically(path, envelope)
            self._pending.append(receipt)
            if self.rotate and len(self._pending) >= self.rotate:
                self._write_manifest()
        return SignedReceipt(receipt_id, path, receipt)

    def receipt_path(self, receipt_id: str) -> Path:
        return self.out / "receipts" / f"{receipt_id}{RECEIPT_SUFFIX}"

    def close(self) -> Path | None:
        """Write the run manifest of the receipts since the last one (if any)."""
        with self._lock:
            return self._write_manifest() if self._pending else None

    def _write_manifest(self) -> Path:
        manifest = RunManifest.for_receipts(self._pending, run_id=f"{self.run_id}-{self._num_manifests}",
                                            node_keyid=self.keyid, deployment_hash=self.facts_hash,
                                            tuple_hash=self.tuple_hash, time_unix_ns=time.time_ns())
        path = self.out / "manifests" / f"run-{self._num_manifests:05d}{MANIFEST_SUFFIX}"
        write_atomically(path, sign_run_manifest(manifest, self.key))
        self._num_manifests += 1
        self._pending = []
        return path
