"""The parity gate: before a backward, the trainer's old-policy logprobs against the rollout's, bit for bit.

Fail closed: the first mismatch raises `LogprobMismatch` naming the sample, the position and both fp32 values
(with their bits in hex), unless the gate was told to log and continue. Either way the check reports the
metrics frameworks already chart: `logprob_bit_mismatch` (prime-rl: the fraction of tokens whose bits differ)
and the rollout/trainer absolute difference (slime's `train_rollout_logprob_abs_diff`, the mean over tokens),
so importance-sampling correction can be switched off where the mismatch is 0.
"""

from __future__ import annotations

import logging
import struct
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from detent_audit.enums import ExitCode
from detent_audit.errors import DetentError

log = logging.getLogger(__name__)


def float_bits(x: float) -> str:
    """An fp32 value's bit pattern in hex (0x3f800000 for 1.0)."""
    return f"0x{struct.unpack('<I', struct.pack('<f', x))[0]:08x}"


class LogprobMismatch(DetentError):
    """A trainer logprob differs from the rollout's in some bit."""

    exit_code = ExitCode.MISMATCH


@dataclass(frozen=True)
class ParityReport:
    """One comparison: tokens compared, how many differ in any bit, the abs diff's mean and max, the first
    mismatch as (sample, position) or None, and its message ("" if none)."""

    tokens: int
    mismatched: int
    abs_diff_mean: float
    abs_diff_max: float
    first: tuple[int, int] | None
    message: str = ""

    def metrics(self) -> dict[str, float]:
        """The names frameworks chart."""
        return {"logprob_bit_mismatch": self.mismatched / self.tokens if self.tokens else 0.0,
                "logprob_bit_mismatch_tokens": float(self.mismatched),
                "train_rollout_logprob_abs_diff": self.abs_diff_mean,
                "train_rollout_logprob_abs_diff_max": self.abs_diff_max}


def _fp32(values: Sequence[float] | torch.Tensor) -> torch.Tensor:
    if not isinstance(values, torch.Tensor):
        return torch.tensor(list(values), dtype=torch.float32)
    t = values.detach()
    return t.to("cpu", torch.float32).reshape(-1)


Logprobs = Sequence[Sequence[float] | torch.Tensor]  # per sample


def compare(rollout: Logprobs, trainer: Logprobs,
            sample_names: Sequence[str] | None = None) -> ParityReport:
    """Per sample, the rollout engine's logprobs against the trainer's (lists of floats or tensors, fp32
    values), bit for bit; never raises on a mismatch (the report names the first one)."""
    if len(rollout) != len(trainer):
        raise LogprobMismatch(f"{len(rollout)} rollout samples against {len(trainer)} scored ones",
                              remedy="score every rollout sample")
    tokens = mismatched = 0
    total_diff, max_diff = 0.0, 0.0
    first: tuple[int, int] | None = None
    message = ""
    for i, (r, t) in enumerate(zip(rollout, trainer)):
        a, b = _fp32(r), _fp32(t)
        name = sample_names[i] if sample_names is not None else f"sample {i}"
        if a.shape != b.shape:
            raise LogprobMismatch(f"{name}: {a.numel()} rollout logprobs against {b.numel()} scored ones",
                                  remedy="score the rollout's completion tokens exactly")
        differ = (a.view(torch.int32) != b.view(torch.int32)).nonzero().flatten().tolist()
        diff = (a.double() - b.double()).abs()
        tokens, mismatched = tokens + a.numel(), mismatched + len(differ)
        total_diff += float(diff.sum())
        max_diff = max(max_diff, float(diff.max())) if a.numel() else max_diff
        if differ and first is None:
            first = (i, differ[0])
            x, y = float(a[differ[0]]), float(b[differ[0]])
            message = (f"{name}, position {differ[0]}: rollout logprob {x!r} ({float_bits(x)}) but trainer "
                       f"{y!r} ({float_bits(y)})")
    return ParityReport(tokens, mismatched, total_diff / tokens if tokens else 0.0, max_diff, first, message)


@dataclass(frozen=True)
class ParityGate:
    """`check(rollout, trainer)`: `compare`, then on a mismatch raise `LogprobMismatch` naming the first
    (`fail`, the default) or log it and return the report."""

    fail: bool = True

    def check(self, rollout: Sequence[Sequence[float] | torch.Tensor],
              trainer: Sequence[Sequence[float] | torch.Tensor],
              sample_names: Sequence[str] | None = None) -> ParityReport:
        report = compare(rollout, trainer, sample_names)
        if report.first is not None:
            if self.fail:
                remedy = ("score with the rollout's weights and committed tuple "
                          "(detent_audit.rl.scorer.Scorer), or gate with fail=False to log and continue")
                raise LogprobMismatch(report.message, remedy=remedy)
            log.warning("logprob mismatch (%d of %d tokens): %s", report.mismatched, report.tokens,
                        report.message)
        return report
