"""Steps (5)-(6) of verification: the run manifests, and the coverage of the receipts by them."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

from detent_audit.errors import DetentError
from detent_audit.manifests.dsse import read_envelope_bytes
from detent_audit.manifests.errors import InvalidReceipt, ManifestMismatch
from detent_audit.manifests.intoto import check_outer, check_statement, exported_name, read_export
from detent_audit.manifests.receipt import Receipt
from detent_audit.manifests.run_manifest import RunManifest, check_run, verify_run_manifest
from detent_audit.verifier.report import Coverage, Outcome
from detent_audit.verifier.steps import CoverageError, ManifestError


def check_manifest(path: Path, trusted: dict,
                   opened: dict[Path, Receipt]) -> tuple[Outcome, RunManifest | None]:
    """Step (5): a manifest's verdict, and the manifest itself when its signature verified (it then covers its
    digests): (1)-(3) of its file; its receipts present reproduce its root; none of its run's receipts present
    in its range is left out; a recovery manifest has no hole in its range; after a final or recovery
    manifest, its run has no receipt; each request is answered once in it."""
    manifest: RunManifest | None = None
    try:
        if exported_name(path.name) is None:
            manifest = verify_run_manifest(read_envelope_bytes(path, error=InvalidReceipt), trusted).manifest
        else:  # an export (manifests/intoto.py): the node's envelope it carries, then its Statement
            export = read_export(path)
            manifest = verify_run_manifest(export.envelope.to_bytes(), trusted).manifest
            check_outer(export, trusted)
            check_statement(export, manifest)
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
    return Outcome(str(path), "manifest", "OK",
                   f"{manifest.kind} manifest of run {manifest.run_id[:12]}, receipts "
                   f"{manifest.seq_first}-{manifest.seq_last}: {manifest.receipt_count} receipts, Merkle "
                   f"root {manifest.merkle_root[:16]}..."), manifest


def _check_run(manifest: RunManifest, opened: dict[Path, Receipt]) -> None:
    wanted = set(manifest.receipt_digests)
    present = [r for r in opened.values() if r.digest in wanted]
    check_run(manifest, present)
    of_run = [r for r in opened.values() if r.run.run_id == manifest.run_id
              and r.node_keyid == manifest.node_keyid]
    omitted = sorted(r.request.request_id for r in of_run
                     if manifest.seq_first <= r.run.seq <= manifest.seq_last and r.digest not in wanted)
    if omitted:  # a receipt of its range it does not list: the manifest leaves out an answered request
        raise ManifestError(f"omits {len(omitted)} receipt(s) present in its range {manifest.seq_first}-"
                            f"{manifest.seq_last} of run {manifest.run_id}: "
                            f"{', '.join(map(repr, omitted[:3]))}")
    span = manifest.seq_last - manifest.seq_first + 1
    if manifest.kind == "recovery" and manifest.receipt_count < span:
        # a run numbers its receipts without a gap (a number is taken once its receipt is on disk), and the
        # next start seals every one a killed run left: a hole in a recovery manifest is a receipt taken out
        listed = {r.run.seq for r in present}
        holes: list[int] = []
        seq = manifest.seq_first
        while len(holes) < 5 and seq <= manifest.seq_last:  # the range may span 2^64: the first 5 holes
            holes += [] if seq in listed else [seq]
            seq += 1
        missing = span - manifest.receipt_count
        shown = ", ".join(map(str, holes)) + (", ..." if missing > len(holes) else "")
        raise ManifestError(f"a recovery manifest of {manifest.receipt_count} receipts for the range "
                            f"{manifest.seq_first}-{manifest.seq_last} of run {manifest.run_id}: {missing} "
                            f"of its sequence numbers are in it under no digest ({shown}; a killed run's "
                            "receipts are numbered without a gap, and the next start seals every one)")
    later = sorted(r.request.request_id for r in of_run if r.run.seq > manifest.seq_last)
    if manifest.kind in ("final", "recovery") and later:
        raise ManifestError(f"the run's {manifest.kind} manifest ends it at receipt {manifest.seq_last}, yet "
                            f"{len(later)} receipt(s) of the run come after it: "
                            f"{', '.join(map(repr, later[:3]))}")
    repeated = sorted(i for i, n in Counter(r.request.request_id for r in present).items() if n > 1)
    if repeated:  # one request answered twice in a run: a node could keep the draw it liked
        raise ManifestError(f"request id(s) answered more than once in this run: "
                            f"{', '.join(map(repr, repeated[:3]))}")


def _numbers(seqs: list[int]) -> str:
    """Sequence numbers for a message: the first few, then how many more."""
    return ", ".join(map(str, seqs[:5])) + (f" and {len(seqs) - 5} more" if len(seqs) > 5 else "")


def check_coverage(opened: dict[Path, Receipt], manifests: dict[Path, RunManifest],
                   in_folders: dict[Path, Path], coverage: Coverage) -> list[Outcome]:
    """Step (6), across all manifests (by path, those whose signature verified); fills in `coverage`.

    What a node's folder (a folder given) must account for FAILs: a receipt in it that no manifest covers
    (one outcome per folder when no manifest was given at all); a run with a manifest or receipt from a
    folder whose manifests leave a sequence number out (from 0 to their last, without a gap), or list no
    receipt given of the run. Where only files were given, the same gaps are stated in `coverage.gaps`, never
    passed in silence. One (run, sequence number) or one request id twice in a run FAILs, and one node's
    request id in two runs (`_answered_once`)."""
    covered = {d for m in manifests.values() for d in m.receipt_digests}
    out: list[Outcome] = []
    coverage.covered = sum(r.digest in covered for r in opened.values())
    by_folder: dict[Path, list[Path]] = {}
    loose = 0  # receipt files given without a manifest of their run
    runs_with_manifest = {(m.node_keyid, m.run_id) for m in manifests.values()}
    for p, r in sorted(opened.items()):
        if r.digest in covered:
            continue
        coverage.uncovered.append(str(p))
        if p in in_folders:
            by_folder.setdefault(in_folders[p], []).append(p)
        elif (r.node_keyid, r.run.run_id) not in runs_with_manifest:
            loose += 1
    for folder, paths in sorted(by_folder.items()):
        if not manifests:  # a node's folder of receipts, no manifest: nothing shows that no answer was hidden
            out.append(Outcome.refuted(str(folder), "coverage", CoverageError(
                f"{len(paths)} receipt(s) in this folder and no run manifest that verified: a node's folder "
                "accounts for every answer in its run manifests",
                remedy="pass the node's whole --manifest-out folder (receipts/ and manifests/); to check "
                       "receipts without their runs, pass the receipt files themselves")))
            continue
        for p in paths:
            r = opened[p]
            out.append(Outcome.refuted(str(p), "coverage", CoverageError(
                f"receipt {r.run.seq} of run {r.run.run_id} is in no run manifest (a manifest was lost, or "
                "the node was killed and not restarted on its folder, which seals such receipts)",
                request_id=r.request.request_id)))
    if loose:
        coverage.gaps.append(f"{loose} receipt(s) checked without a run manifest of their run: that the node "
                             "published them, and hid no answer beside them, is not shown")
    out += _sequence_accounting(opened, manifests, in_folders, coverage)
    out += _answered_once(opened, in_folders, coverage)
    return out


def _sequence_accounting(opened: dict[Path, Receipt], manifests: dict[Path, RunManifest],
                         in_folders: dict[Path, Path], coverage: Coverage) -> list[Outcome]:
    """Each run with a manifest: its manifests cover its sequence numbers from 0 to their last without a gap,
    and each receipt of the run given is in one of them (a FAIL where the run's manifests or receipts came
    from a folder, a stated gap where only files were given)."""
    out: list[Outcome] = []
    runs: dict[tuple[str, str], list[RunManifest]] = {}
    for m in manifests.values():
        runs.setdefault((m.node_keyid, m.run_id), []).append(m)
    from_folder = {(m.node_keyid, m.run_id) for p, m in manifests.items() if p in in_folders}
    from_folder |= {(r.node_keyid, r.run.run_id) for p, r in opened.items() if p in in_folders}
    for (node, run_id), ms in sorted(runs.items()):
        ms.sort(key=lambda m: (m.seq_first, m.seq_last))
        holes, expected = [], 0
        for m in ms:
            if m.seq_first > expected:
                holes.append(f"{expected}-{m.seq_first - 1}" if m.seq_first - 1 > expected else str(expected))
            expected = max(expected, m.seq_last + 1)
        listed = {d for m in ms for d in m.receipt_digests}
        outside = sorted(r.run.seq for p, r in opened.items()
                         if (r.node_keyid, r.run.run_id) == (node, run_id) and r.digest not in listed
                         and p not in in_folders)
        problems = []
        if holes:
            problems.append(f"its manifests account for no receipt numbered {', '.join(holes[:5])} (a run's "
                            "manifests cover its receipts from 0 without a gap: a manifest was removed, or "
                            "re-signed to leave receipts out)")
        if outside:
            problems.append(f"receipt(s) {_numbers(outside)} given of this run are in none of its {len(ms)} "
                            f"manifest(s), which end at receipt {expected - 1}")
        if not problems:
            continue
        if (node, run_id) in from_folder:
            out.append(Outcome.refuted(f"run {run_id}", "coverage", CoverageError(
                "; ".join(problems), remedy="the node's folder must hold every manifest of its runs")))
        else:
            coverage.gaps.append(f"run {run_id}: " + "; ".join(problems))
    return out


def _answered_once(opened: dict[Path, Receipt], in_folders: dict[Path, Path],
                   coverage: Coverage) -> list[Outcome]:
    """One (run, sequence number) or one request id in two receipts of a run FAILs; so does one request id a
    node answered in two runs (a node that answers a request twice can keep the draw it liked) where one of
    its receipts came from a folder; where all were given as files, that is a stated gap (jobs may reuse
    ids)."""
    out = []
    runs: dict[str, list[Receipt]] = {}
    for r in opened.values():
        runs.setdefault(r.run.run_id, []).append(r)
    for run_id, receipts in sorted(runs.items()):
        for what, key in (("sequence number", lambda r: r.run.seq),
                          ("request id", lambda r: r.request.request_id)):
            twice = sorted(k for k, n in Counter(key(r) for r in receipts).items() if n > 1)
            if twice:
                out.append(Outcome.refuted(f"run {run_id}", "coverage", CoverageError(
                    f"{len(twice)} {what}(s) appear in more than one receipt of this run: "
                    f"{', '.join(map(repr, twice[:3]))}")))
    answers: dict[tuple[str, str], list[Path]] = {}
    for p, r in opened.items():
        answers.setdefault((r.node_keyid, r.request.request_id), []).append(p)
    for (node, request_id), paths in sorted(answers.items()):
        runs_of = sorted({opened[p].run.run_id for p in paths})
        if len(runs_of) < 2:
            continue
        message = (f"request id {request_id!r} is answered in {len(runs_of)} runs of node {node[:12]} "
                   f"({', '.join(runs_of[:3])})")
        if any(p in in_folders for p in paths):
            out.append(Outcome.refuted(f"request {request_id}", "coverage", CoverageError(
                message, request_id=request_id,
                remedy="a node answers each request id once; separate jobs that reused ids are verified one "
                       "folder at a time")))
        else:
            coverage.gaps.append(f"{message}: one request answered twice, unless the files are of separate "
                                 "jobs")
    return out
