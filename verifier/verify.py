"""`detent-audit verify`: receipts, folders and run manifests, checked in the numbered steps of
`verifier/steps.py` (docs/design.md section 7), each refuting with its own error class:

(1) read, (2) signature, (3) payload, (4) claims (`receipt_file.py`); (5) run manifests, (6) coverage
(`runs.py`); (7) deployment, (8) output, (9) request, (10) bits (`reexecute.py`, `checks.py`); then the
report, one outcome per file, whose exit code is 1 for any FAIL, else 2 for any BAD, else 3 for any receipt
not comparable here. A receipt that fails a step is that receipt's verdict, never the run's end. `sample`
draws its seed at random unless one is given, so a node cannot know it; `workers` spreads the batches over
processes (`plan.py`).
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Iterable
from concurrent.futures import FIRST_COMPLETED, Future, wait
from pathlib import Path

from detent_audit.errors import BadInput, DetentError
from detent_audit.manifests import decoding as dec
from detent_audit.manifests.encoding import facts_hash
from detent_audit.manifests.errors import InvalidReceipt
from detent_audit.manifests.receipt import Receipt
from detent_audit.manifests.run_manifest import RunManifest
from detent_audit.verifier import plan
from detent_audit.verifier.receipt_file import check_claims, open_receipt
from detent_audit.verifier.reexecute import Options, release, run_batch, worker_batch
from detent_audit.verifier.report import Coverage, Outcome, Report
from detent_audit.verifier.runs import check_coverage, check_manifest
from detent_audit.verifier.steps import PayloadError, VerificationError
from detent_audit.verifier.workers import worker_pool

MAX_DEPLOYMENT_FILE = 16 << 20


def verify(paths: Iterable[str | Path], trusted: dict, *, model: str | Path | None = None,
           mode: str = "rescore", sample: float | None = None, seed: int | None = None,
           cache_dir: str | None = None, threads: int | None = None, tuple_override: dict | None = None,
           workers: int | str = 1, progress: Callable[[int, int], None] | None = None,
           deployments: dict[str, dict | None] | None = None, tensor_parallel: int | None = None) -> Report:
    """Verify every receipt and run manifest under `paths`; never raises for a bad receipt: reports it.
    `workers`: processes that re-execute (`plan.auto_workers` for "auto"). `deployments`: the published ones
    (`load_deployments`); every receipt's deployment must be one of them (None: facts are self-asserted)."""
    if mode not in ("rescore", "replay"):
        raise DetentError(f"unknown mode {mode!r}", remedy="use --mode rescore or --mode replay")
    if workers != "auto" and (isinstance(workers, bool) or not isinstance(workers, int) or workers < 1):
        raise BadInput(f"workers must be a whole number >= 1 or 'auto', got {workers!r}")
    files = plan.collect(paths)
    outcomes = list(files.bad)
    # (1)-(4): each receipt file
    opened: dict[Path, Receipt] = {}
    now_ns = time.time_ns()
    for p in files.receipts:
        try:
            opened[p] = open_receipt(p, trusted)
            check_claims(p, opened[p], deployments, now_ns)
        except VerificationError as exc:
            opened.pop(p, None)
            outcomes.append(Outcome.refuted(str(p), "receipt", exc))
        # a signed payload that breaks a check is a bad receipt, not a crash
        except Exception as exc:  # noqa: BLE001
            opened.pop(p, None)
            outcomes.append(Outcome.refuted(str(p), "receipt",
                                            PayloadError(f"{p.name}: {type(exc).__name__}: {exc}")))
    # (5): each run manifest; (6): the receipts' coverage by them
    manifests: dict[Path, RunManifest] = {}
    for m in files.manifests:
        outcome, manifest = check_manifest(m, trusted, opened)
        outcomes.append(outcome)
        if manifest is not None:
            manifests[m] = manifest
    coverage = Coverage(len(opened), manifests=len(manifests))
    outcomes += check_coverage(opened, manifests, files.in_folders, coverage)

    # (7)-(10): the sample, in batches of one deployment and tuple
    if sample is not None and seed is None:  # unpredictable unless stated: a node must not know the sample
        seed = int.from_bytes(os.urandom(8), "little")
    chosen = plan.sample_paths(sorted(opened), sample, seed or 0)
    groups: dict[tuple[str, str], list[Path]] = {}
    for p in chosen:
        groups.setdefault((opened[p].deployment_hash, opened[p].tuple_hash), []).append(p)
    count = (plan.auto_workers(len(chosen), [opened[g[0]].deployment_facts for g in groups.values()], threads)
             if workers == "auto" else int(workers))
    batches = plan.batches(groups, count)
    kv_tokens = {key: max(plan.kv_tokens(opened[p], mode) for p in group) for key, group in groups.items()}
    options = Options(None if model is None else str(model), mode, cache_dir, threads, tuple_override,
                      kv_tokens, published=deployments is not None, tensor_parallel=tensor_parallel)
    outcomes += _run_batches(batches, opened, options, count, progress)
    order = {str(p): i for i, p in enumerate([*files.receipts, *files.manifests])}
    outcomes.sort(key=lambda o: (order.get(o.path, -1), o.path))
    return Report(outcomes, mode, seed if sample is not None else None, sorted(deployments or {}), coverage)


def _run_batches(batches: list[list[Path]], opened: dict[Path, Receipt], options: Options, workers: int,
                 progress: Callable[[int, int], None] | None) -> list[Outcome]:
    """Steps (7)-(10) of every batch: here, or in `workers` spawned processes."""
    outcomes: list[Outcome] = []
    done, total = 0, sum(map(len, batches))
    if workers == 1 or len(batches) <= 1:
        engines: dict = {}
        try:
            for batch in batches:
                outcomes += run_batch([(p, opened[p]) for p in batch], options, engines)
                done += len(batch)
                if progress:
                    progress(done, total)
        finally:
            release(engines)
        return outcomes
    with worker_pool(min(workers, len(batches))) as pool:  # workers that die with this process
        pending: dict[Future, int] = {
            pool.submit(worker_batch, [(str(p), opened[p].to_bytes()) for p in batch], options): len(batch)
            for batch in batches}
        while pending:
            finished, _ = wait(pending, return_when=FIRST_COMPLETED)
            for future in finished:
                outcomes += future.result()  # an engine that cannot be built raises here, as serially
                done += pending.pop(future)
                if progress:
                    progress(done, total)
    return outcomes


def load_deployments(specs: Iterable[str]) -> dict[str, dict | None]:
    """Published deployments by hash: each spec a 64-hex deployment hash, or a file `serve
    --publish-deployment` wrote (its facts must hash to its hash). Raises `BadInput` naming the spec."""
    out: dict[str, dict | None] = {}
    for spec in specs:
        spec = str(spec)
        if len(spec) == 64 and dec.HEX_DIGITS.issuperset(spec):
            out.setdefault(spec, None)
            continue
        try:
            doc = json.loads(dec.read_bounded(spec, MAX_DEPLOYMENT_FILE, what="published deployment"))
        except InvalidReceipt as exc:
            remedy = ("pass a deployment hash (64 hex digits) or the file that "
                      "`detent-audit serve --publish-deployment FILE` wrote")
            raise BadInput(exc.message, remedy=remedy) from None
        except (ValueError, RecursionError) as exc:
            raise BadInput(f"--deployment {spec}: not JSON ({str(exc)[:200]})") from None
        if not isinstance(doc, dict) or not isinstance(doc.get("facts"),
                                                       dict) or not isinstance(doc.get("hash"), str):
            raise BadInput(f"--deployment {spec}: expected a published deployment ({{facts, hash}})")
        try:
            digest = facts_hash(doc["facts"])
        except (DetentError, ValueError, TypeError, OverflowError, RecursionError) as exc:  # NaN, a float
            message = exc.message if isinstance(exc, DetentError) else str(exc)
            raise BadInput(f"--deployment {spec}: its facts are not deployment facts ({message[:200]})",
                           remedy="obtain the file from the node's operator again") from None
        if digest != doc["hash"]:
            raise BadInput(f"--deployment {spec}: its facts do not hash to its hash {doc['hash'][:16]}...",
                           remedy="obtain the file from the node's operator again")
        out[doc["hash"]] = doc["facts"]
    return out
