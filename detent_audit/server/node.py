"""The serving node: signs a receipt for every response and writes it durably before the response leaves.

Receipt files are `<manifest-out>/receipts/<receipt-id>.receipt` (the DSSE envelope bytes), each written to a
temporary file, fsynced, renamed into place and the directory fsynced: a crash loses no receipt of an
answered request. Each receipt names the node's run (a random id per process) and its sequence number in it.
Run manifests (the Merkle root of the receipt digests since the last one) are written every `rotate` receipts
(`rotation`) and on close (`final`), as `<manifest-out>/manifests/<run-id>-<first seq>.manifest`: names never
collide, across processes or after a manifest is moved away, and none is ever overwritten.

One process at a time owns a folder: an exclusive lock on `<manifest-out>/.lock` (held until the process
ends; a second server on the folder is refused). On start the node seals what a killed predecessor left:
every receipt (of this node's key) that no manifest covers goes into a `recovery` manifest of its own run, so
after a restart every receipt is in a manifest.

A write that fails (a full disk, an I/O error) raises `StorageFailed`: the response is not given, the server
answers 507 and reports it in /health until a write succeeds again (`storage_ok` tries one on the next
request or /health); `close` writes the final manifest if it can and says so if not.
"""

from __future__ import annotations

import dataclasses
import errno
import fcntl
import json
import os
import re
import sys
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from detent_audit.atomic import write_atomically
from detent_audit.enums import ExitCode
from detent_audit.errors import BadInput, DetentError
from detent_audit.manifests.dsse import Envelope, read_envelope_bytes
from detent_audit.manifests.encoding import facts_hash, tuple_hash
from detent_audit.manifests.keys import keyid as keyid_of
from detent_audit.manifests.receipt import (
    ClientRequest,
    OutputRecord,
    Receipt,
    RequestRecord,
    RunRecord,
    SamplingRecord,
    ScoringRecord,
    sign_receipt,
)
from detent_audit.manifests.run_manifest import RunManifest, sign_run_manifest, verify_run_manifest
from detent_audit.manifests.seeds import choice_seed, derived_seed
from detent_audit.runtime.contract import Engine, RequestOutput, TupleValues
from detent_audit.runtime.sampling_params import SamplingParams

RECEIPT_SUFFIX = ".receipt"
MANIFEST_SUFFIX = ".manifest"
LOCK_NAME = ".lock"
PROBE_NAME = ".storage-probe"  # written and removed to see whether a full disk has space again
# a plain file name in receipts/: no separator, no dot first
RECEIPT_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")


class StorageFailed(DetentError):
    """A receipt or manifest could not be written (a full disk, an I/O error): the response must not leave."""

    exit_code = ExitCode.BAD_INPUT
    remedy = "free space on (or repair) the --manifest-out file system; the server answers 507 until then"


def tuple_values(llm: Engine) -> TupleValues:
    """What a receipt commits to as the tuple: the per-family pins and knobs, and the mode (as
    `mode.name`)."""
    return llm.tuple_values()


def scoring_record(output: RequestOutput, params: SamplingParams) -> ScoringRecord | None:
    """The scoring record of an echo request's output (its prompt logprobs and their top-n); else None."""
    if output.prompt_logprobs is None:
        return None
    top_n = params.logprobs or 0
    top = (output.prompt_top_logprobs or []) if top_n else []
    return ScoringRecord.from_floats(output.prompt_logprobs, top, top_n)
def published_deployment(facts: dict[str, Any]) -> bytes:
    """The file `serve --publish-deployment` writes: the facts and their hash, as canonical JSON."""
    doc = {"format": "detent-audit published deployment v1", "facts": facts, "hash": facts_hash(facts)}
    return json.dumps(doc, sort_keys=True, indent=1, ensure_ascii=True).encode() + b"\n"


@dataclass(frozen=True)
class SignedReceipt:
    receipt_id: str
    path: Path
    receipt: Receipt
    envelope: bytes

    @property
    def client_proof(self) -> dict[str, str]:
        """What a response carries so its client can keep proof of what it was told (the receipt's digest, the
        signature over it, the signer), for `verify-response`."""
        env = Envelope.from_bytes(self.envelope)
        import base64

        return {"id": self.receipt_id, "digest": self.receipt.digest, "keyid": env.keyid,
                "signature": base64.b64encode(env.signature).decode("ascii")}


class ServingNode:
    """Owns the signing key and the output folder. Thread-safe: the HTTP server signs from its threads."""

    def __init__(self, llm: Engine, private_key: Any, manifest_out: str | Path,
                 rotate: int | None = None) -> None:
        self.llm, self.key, self.rotate = llm, private_key, rotate
        self.out = Path(manifest_out)
        try:
            (self.out / "receipts").mkdir(parents=True, exist_ok=True)
            (self.out / "manifests").mkdir(parents=True, exist_ok=True)
            self._lock_fd: int | None = os.open(self.out / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as exc:
            raise BadInput(f"{self.out}: cannot make the receipts and manifests folders ({exc.strerror})",
                           remedy="give --manifest-out a folder this user can write") from None
        try:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(self._lock_fd)
            raise BadInput(f"--manifest-out {self.out} is in use by another server (it holds {LOCK_NAME})",
                           remedy="give each server its own --manifest-out folder") from None
        self.keyid = keyid_of(private_key.public_key())
        self.facts = llm.facts()
        self.facts_hash = facts_hash(self.facts)
        self._weights_digest = getattr(llm, "weights_digest", None)  # new weights loaded in place: new facts
        self.tuple = tuple_values(llm)
        self.tuple_hash = tuple_hash(self.tuple)
        self.run_id = uuid.uuid4().hex
        self._lock = threading.Lock()
        self._pending: list[Receipt] = []
        self._seq = 0
        self.storage_error: str | None = None  # the last write failure, until a write succeeds
        self.recovered = self._seal_uncovered()

    # ---- signing

    def seeded(self, params: SamplingParams, client: ClientRequest, named: bool | None = None, choice: int = 0
               ) -> SamplingParams:
        """`params` with the seed of choice `choice` of the request: a sampled request whose client named
        none (`named`: whether it did; None: read from the bound body) gets one derived from this run and the
        bound request (`manifests/seeds.py`), so that the node cannot choose it once it has seen the request;
        a seeded request's choice i samples with the client's seed + i (`choice_seed`); a greedy one keeps
        its own."""
        if named is None:
            named = client.body().get("seed") is not None
        if params.is_greedy:
            return params
        if named:
            return dataclasses.replace(params, seed=choice_seed(params.seed, choice)) if choice else params
        seed = derived_seed(self.run_id, client.api, client.body_sha256, choice)
        return dataclasses.replace(params, seed=seed)

    def sign(self, output: RequestOutput, params: SamplingParams, request_id: str | None = None,
             client: ClientRequest | None = None, *, max_tokens: int | None = None) -> SignedReceipt:
        """Sign and durably write the receipt of one finished request; returns where it is. `client`: the
        request as its client sent it (api and body). Raises `StorageFailed` when it cannot be written. An
        output with prompt logprobs (echo) gets a scoring record; `max_tokens`: the request's, where it asked
        for 0 (the engine drew a token the response does not return, and `output` holds none)."""
        receipt_id = request_id or uuid.uuid4().hex
        if not RECEIPT_ID.fullmatch(receipt_id):
            raise BadInput(f"request id {receipt_id!r} cannot name a receipt file",
                           remedy="use 1-128 letters, digits, '.', '_' or '-', "
                                  "starting with a letter or digit")
        if client is None:
            raise BadInput("a receipt binds the client's request: pass client=ClientRequest.of(api, body)")
        request = RequestRecord(receipt_id, client, tuple(output.prompt_token_ids),
                                SamplingRecord.from_params(params, max_tokens), params.seed)
        out = OutputRecord.from_floats(output.token_ids, output.logprobs, output.finish_reason or "length",
                                       output.text, output.top_logprobs if params.logprobs else ())
        scoring = scoring_record(output, params)
        self._check_kernel_params()
        path = self.receipt_path(receipt_id)
        with self._lock:
            if self._lock_fd is None:
                raise BadInput("this node is closed: it signs no more receipts")
            if getattr(self.llm, "weights_digest", None) != self._weights_digest:  # a policy update since
                self.facts = self.llm.facts()
                self.facts_hash = facts_hash(self.facts)
                self._weights_digest = getattr(self.llm, "weights_digest", None)
            if path.exists():
                raise FileExistsError(f"a receipt named {path.name} exists already")
            receipt = Receipt(deployment_facts=self.facts, deployment_hash=self.facts_hash,
                              tuple_values=self.tuple, tuple_hash=self.tuple_hash, request=request,
                              output=out, run=RunRecord(self.run_id, self._seq), node_keyid=self.keyid,
                              time_unix_ns=time.time_ns(), scoring=scoring)
            envelope = sign_receipt(receipt, self.key)
            self._write(path, envelope, "receipt")
            self._seq += 1
            self._pending.append(receipt)
            if self.rotate and len(self._pending) >= self.rotate:
                self._write_manifest("rotation")
        return SignedReceipt(receipt_id, path, receipt, envelope)

    def _check_kernel_params(self) -> None:
        """The kernels report the params they were called with: every one must be among those the signed
        facts state (`kernel_params`), or the facts do not describe what ran and nothing is signed."""
        report = getattr(self.llm, "kernel_params_called", None)
        called = report() if report is not None else None
        stated = self.facts.get("kernel_params")
        if called is None or stated is None:
            return  # an engine whose kernels do not report (vLLM's, the GPU KernelSet)
        lists = {family: value for family, value in stated.items() if isinstance(value, list)}
        extra = {family: [p for p in params if p not in lists.get(family, [])]
                 for family, params in called.items()}
        extra = {family: params for family, params in extra.items() if params}
        if extra:
            raise DetentError(f"the kernels were called with params the signed facts do not state: {extra}",
                              remedy="a selector gave params outside the probe of "
                                     "kernel_select.probe_inputs; report this as a bug")

    def receipt_path(self, receipt_id: str) -> Path:
        return self.out / "receipts" / f"{receipt_id}{RECEIPT_SUFFIX}"

    def publish(self, path: str | Path) -> str:
        """Write the published deployment (facts and hash) to `path`; returns the hash."""
        try:
            write_atomically(Path(path), published_deployment(self.facts))
        except OSError as exc:
            raise BadInput(f"--publish-deployment {path}: cannot write ({exc.strerror or exc})") from None
        return self.facts_hash

    def close(self) -> Path | None:
        """Write the final run manifest of the receipts since the last one (if any) and release the folder. A
        failure to write it is reported on stderr, never raised: the receipts are on disk, and the next start
        seals them."""
        with self._lock:
            try:
                if not self._pending:
                    return None
                return self._write_manifest("final")
            except StorageFailed as exc:
                print(f"detent-audit: the final run manifest was not written: {exc.message} "
                      f"({len(self._pending)} receipts are sealed into a recovery manifest on the next "
                      "start)", file=sys.stderr)
                return None
            finally:
                if self._lock_fd is not None:
                    os.close(self._lock_fd)  # releases the folder's lock
                    self._lock_fd = None

    def storage_ok(self) -> bool:
        """Whether receipts can be written: true while no write has failed since the last that succeeded;
        after a failure, true once a probe file can be written again (space freed), which clears
        `storage_error`. So the server recovers without a restart, and /health with it."""
        if self.storage_error is None:
            return True
        probe = self.out / PROBE_NAME
        with self._lock:
            try:
                self._write(probe, b"probe", "probe file")
                probe.unlink(missing_ok=True)
            except (StorageFailed, OSError):
                return False
        return True

    # ---- files

    def _write(self, path: Path, data: bytes, what: str) -> None:
        try:
            write_atomically(path, data)
        except OSError as exc:
            full = exc.errno in (errno.ENOSPC, errno.EDQUOT)
            self.storage_error = (f"{'no space left' if full else 'cannot write'} for a {what} in "
                                  f"{path.parent} ({exc.strerror or exc})")
            raise StorageFailed(self.storage_error) from None
        self.storage_error = None

    def _write_manifest(self, kind: str, receipts: list[Receipt] | None = None, run_id: str | None = None
                        ) -> Path:
        """Sign and write the manifest of `receipts` (default: the pending ones of this run)."""
        own = receipts is None
        receipts = self._pending if receipts is None else receipts
        first = receipts[0]
        manifest = RunManifest.for_receipts(receipts, run_id=run_id or self.run_id, node_keyid=self.keyid,
                                            deployment_hash=first.deployment_hash,
                                            tuple_hash=first.tuple_hash, time_unix_ns=time.time_ns(),
                                            kind=kind)
        name = f"{manifest.run_id}-{manifest.seq_first:08d}" + ("-recovery" if kind == "recovery" else "")
        path = self.out / "manifests" / f"{name}{MANIFEST_SUFFIX}"
        if path.exists():  # never overwrite a manifest
            path = path.with_name(f"{name}-{uuid.uuid4().hex[:8]}{MANIFEST_SUFFIX}")
        self._write(path, sign_run_manifest(manifest, self.key), "run manifest")
        if own:
            self._pending = []
        return path

    def _seal_uncovered(self) -> list[Path]:
        """Recovery manifests for the receipts of this node's key that no manifest covers (a killed run's);
        returns their paths. Files this node did not sign, or cannot read, are reported on stderr and left."""
        from detent_audit.manifests.receipt import verify_envelope

        trusted = {self.keyid: self.key.public_key()}
        covered: set[str] = set()
        problems: list[str] = []
        for path in sorted((self.out / "manifests").glob(f"*{MANIFEST_SUFFIX}")):
            try:
                manifest = verify_run_manifest(read_envelope_bytes(path), trusted).manifest
                covered |= set(manifest.receipt_digests)
            except DetentError as exc:
                problems.append(f"{path.name}: {exc.message}")
        uncovered: dict[tuple[str, str, str], list[Receipt]] = {}
        for path in sorted((self.out / "receipts").glob(f"*{RECEIPT_SUFFIX}")):
            try:
                receipt = verify_envelope(read_envelope_bytes(path), trusted).receipt
            except DetentError as exc:
                problems.append(f"{path.name}: {exc.message}")
                continue
            if receipt.digest not in covered:
                key = (receipt.run.run_id, receipt.deployment_hash, receipt.tuple_hash)
                uncovered.setdefault(key, []).append(receipt)
        if problems:
            print(f"detent-audit: {len(problems)} file(s) in {self.out} are not this node's and are left as "
                  f"they are: {'; '.join(problems[:3])}", file=sys.stderr)
        written = []
        for (run_id, _, _), receipts in sorted(uncovered.items()):
            receipts.sort(key=lambda r: r.run.seq)
            written.append(self._write_manifest("recovery", receipts, run_id))
        if written:
            total = sum(map(len, uncovered.values()))
            print(f"detent-audit: sealed {total} receipt(s) no manifest covered into {len(written)} recovery "
                  "manifest(s)", file=sys.stderr)
        return written
