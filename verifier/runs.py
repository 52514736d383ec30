"""Steps (5)-(6) of verification: the run manifests, and the coverage of the receipts by them."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

from detent_audit.errors import DetentError
from detent_audit.manifests.dsse import read_envelope_bytes
from detent_audit.manifests.errors import InvalidReceipt, ManifestMismatch
from detent_audit.manifests.receipt import Receipt
from detent_audit.manifests.run_manifest import RunManifest, check_run, verify_run_manifest
from detent_audit.verifier.report import Coverage, Outcome
from detent_audit.verifier.steps import CoverageError, ManifestError


def check_manifest(path: Path, trusted: dict, opened: dict[Path, Receipt]) -> tuple[Outcome, RunManifest | None]:
    """Step (5): a manifest's verdict, and the manifest itself when its signature verified (it then covers its
    digests): (1)-(3) of its file; its receipts present reproduce its root; none of its run's receipts present
    in its range is left out; after a final manifest, its run has no receipt; each request is answered once
    in it."""
    manifest: RunManifest | None = None
    try:
        manifest = verify_run_manifest(read_envelope_bytes(path, error=InvalidReceipt), trusted).manifest
        _check_run(manifest, opened)
    except ManifestMismatch as exc:
        shown = ", ".join(exc.missing[:3]) + (", ..." if len(exc.missing) > 3 else "")
        error = ManifestError(exc.message + (f" (receipt digests missing: {shown})" if exc.missing else ""),
                              missing=exc.missing)
        return Outcome.refuted(str(path), "manifest", error), manifest
    except ManifestError as exc:
        return Outcome.refuted(str(path), "manifest", exc), manifest
    except DetentError as exc:
        error = ManifestError(exc.message, exit_code=1 if exc.exit_code == 1 else 2)
        return Outcome.refuted(str(path), "manifest", error), manifest
    return Outcome(str(path), "manifest", "OK", f"{manifest.kind} manifest of run {manifest.run_id[:12]}, receipts "
                   f"{manifest.seq_first}-{manifest.seq_last}: {manifest.receipt_count} receipts, Merkle root "
                   f"{manifest.merkle_root[:16]}..."), manifest


def _check_run(manifest: RunManifest, opened: dict[Path, Receipt]) -> None:
    wanted = set(manifest.receipt_digests)
    present = [r for r in opened.values() if r.digest in wanted]
    check_run(manifest, present)
    of_run = [r for r in opened.values() if r.run.run_id == manifest.run_id and r.node_keyid == manifest.node_keyid]
    omitted = sorted(r.request.request_id for r in of_run
                     if manifest.seq_first <= r.run.seq <= manifest.seq_last and r.digest not in wanted)
    if omitted:  # a receipt of its range it does not list: the manifest leaves out an answered request
        raise ManifestError(f"omits {len(omitted)} receipt(s) present in its range {manifest.seq_first}-"
                            f"{manifest.seq_last} of run {manifest.run_id}: {', '.join(map(repr, omitted[:3]))}")
    later = sorted(r.request.request_id for r in of_run if r.run.seq > manifest.seq_last)
    if manifest.kind == "final" and later:
        raise ManifestError(f"the run's final manifest ends at receipt {manifest.seq_last}, yet {len(later)} "
                            f"receipt(s) of the run come after it: {', '.join(map(repr, later[:3]))}")
    repeated = sorted(i for i, n in Counter(r.request.request_id for r in present).items() if n > 1)
    if repeated:  # one request answered twice in a run: a node could keep the draw it liked
        raise ManifestError(f"request id(s) answered more than once in this run: "
                            f"{', '.join(map(repr, repeated[:3]))}")


def check_coverage(opened: dict[Path, Receipt], manifests: list[RunManifest], in_folders: set[Path],
                   coverage: Coverage) -> list[Outcome]:
    """Step (6), across all manifests: where manifests were given, a receipt found in a folder that no manifest
    covers FAILs (a node's folder accounts for every answer; receipts alone, with no manifest at all, are
    counted as uncovered and shown, not failed); one (run, sequence number) or one request id twice in a run
    FAILs. Fills in `coverage`."""
    covered = {d for m in manifests for d in m.receipt_digests}
    out = []
    coverage.covered = sum(r.digest in covered for r in opened.values())
    for p, r in sorted(opened.items()):
        if r.digest not in covered:
            coverage.uncovered.append(str(p))
            if p in in_folders and manifests:
                out.append(Outcome.refuted(str(p), "coverage", CoverageError(
                    f"receipt {r.run.seq} of run {r.run.run_id} is in no run manifest (a manifest was lost, or the "
                    "node was killed and not restarted on its folder, which seals such receipts)",
                    request_id=r.request.request_id)))
    runs: dict[str, list[tuple[Path, Receipt]]] = {}
    for p, r in opened.items():
        runs.setdefault(r.run.run_id, []).append((p, r))
    for run_id, items in sorted(runs.items()):
        for what, key in (("sequence number", lambda r: r.run.seq), ("request id", lambda r: r.request.request_id)):
            counts = Counter(key(r) for _, r in items)
            twice = sorted(k for k, n in counts.items() if n > 1)
            if twice:
                out.append(Outcome.refuted(f"run {run_id}", "coverage", CoverageError(
                    f"{len(twice)} {what}(s) appear in more than one receipt of this run: "
                    f"{', '.join(map(repr, twice[:3]))}")))
    return out
