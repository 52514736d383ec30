"""What `verify` reports: one `Outcome` per receipt, manifest or run (its status, and the step that refuted
it), the run manifests' `Coverage`, and the `Report` with its exit code."""

from __future__ import annotations

from dataclasses import dataclass, field

from detent_audit.enums import ExitCode, Verdict
from detent_audit.verifier.compare import Divergence
from detent_audit.verifier.steps import Step, VerificationError

STATUS_OF_EXIT = {ExitCode.MISMATCH: Verdict.FAIL.value, ExitCode.BAD_INPUT: Verdict.BAD.value,
                  ExitCode.NOT_COMPARABLE: Verdict.NOT_COMPARABLE.value}


@dataclass
class Outcome:
    """One receipt's or manifest's verdict; `step`: the step that refuted it (None when it passed)."""

    path: str
    kind: str                      # receipt | manifest | coverage | response
    status: str                    # a Verdict: OK | FAIL | BAD | NOT_COMPARABLE
    message: str = ""
    request_id: str | None = None
    divergence: Divergence | None = None
    fields: list[str] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)  # a manifest's: digests of its receipts not found
    step: Step | None = None

    @classmethod
    def refuted(cls, path: str, kind: str, error: VerificationError,
                request_id: str | None = None) -> Outcome:
        """The outcome of a file that `error` refuted (`request_id`: the file's, where the error has none)."""
        return cls(path, kind, STATUS_OF_EXIT.get(error.exit_code, "BAD"), error.message,
                   error.request_id or request_id,
                   getattr(error, "divergence", None), list(getattr(error, "fields", [])),
                   list(getattr(error, "missing", [])), error.step)

    def to_json(self) -> dict:
        return {"path": self.path, "kind": self.kind, "status": self.status, "message": self.message,
                "request_id": self.request_id, "fields": self.fields, "missing": self.missing,
                "divergence": self.divergence.to_json() if self.divergence else None,
                "step": None
                if self.step is None else {"number": int(self.step), "name": self.step.name.lower()}}


@dataclass
class Coverage:
    """Which receipts the run manifests cover: `receipts` found, `covered` by a manifest whose signature
    verified, the uncovered ones' paths, and the manifests read; `gaps`: what the files given leave unshown
    (receipts without their run's manifests, a run's sequence numbers no manifest given accounts for), which
    the verdict states."""

    receipts: int = 0
    covered: int = 0
    manifests: int = 0
    uncovered: list[str] = field(default_factory=list)
    gaps: list[str] = field(default_factory=list)

    def to_json(self) -> dict:
        return {"receipts": self.receipts, "covered": self.covered, "manifests": self.manifests,
                "uncovered": self.uncovered, "gaps": self.gaps}


@dataclass
class Report:
    outcomes: list[Outcome]
    mode: str
    sample_seed: int | None = None  # the seed the sample was drawn with (to repeat it), when sampling
    # facts checked against published deployments (their hashes); empty: the receipts' facts are self-asserted
    published: list[str] = field(default_factory=list)
    coverage: Coverage = field(default_factory=Coverage)

    @property
    def exit_code(self) -> ExitCode:
        return ExitCode.of({o.status for o in self.outcomes})

    def counts(self) -> dict[str, int]:
        return {v.value: sum(o.status == v for o in self.outcomes) for v in Verdict}
