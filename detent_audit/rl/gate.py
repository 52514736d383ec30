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

from detent_audit.errors import DetentError

log = logging.getLogger(__name__)


def float_bits(x: float) -> str:
    """An fp32 value's bit pattern in hex (0x3f800000 for 1.0)."""
    return f"0x{struct.unpack('<I', struct.pack('<f', x))[0]:08x}"


class LogprobMismatch(DetentError):
    """A trainer logprob differs from the rollout's in some bit."""

    exit_code = 1


@dataclass(frozen=True)
class ParityReport:
    """One check: tokens compared, how many differ in any bit, the abs diff's mean and max, the first mismatch
    as (sample, position) or None."""

    tokens: int
    mismatched: int
    abs_diff_mean: float
    abs_diff_max: float
    first: tuple[int, int] | None

    def metrics(self) -> dict[str, float]:
        """The names frameworks chart."""
        return {"logprob_bit_mismatch": self.mismatched / self.tokens if self.tokens else 0.0,
                "logprob_bit_mismatch_tokens": float(self.mismatched),
                "train_rollout_logprob_abs_diff": self.abs_diff_mean,
                "train_rollout_logprob_abs_diff_max": self.abs_diff_max}


def _fp32(values: Sequence[float] | torch.Tensor) -> torch.Tensor:
    t = values.detach() if isinstance(values, torch.Tensor) else torch.tensor(list(values), dtype=torch.float32)
    return t.to("cpu", torch.float32).reshape(-1)


@dataclass(frozen=True)
class ParityGate:
    """`check(rollout, trainer)`: per sample, the rollout engine's logprobs and the trainer's (lists of floats
    or tensors, fp32 values). `fail`: raise on a mismatch (the default), else log it and return the report."""

    fail: bool = True

    def check(self, rollout: Sequence[Sequence[float] | torch.Tensor],
              trainer: Sequence[Sequence[float] | torch.Tensor],
              sample_names: Sequence[str] | None = None) -> ParityReport:
        if len(rollout) != len(trainer):
            raise LogprobMismatch(f"{len(rollout)} rollout samples against {len(trainer)} scored ones",
                                  remedy="score every rollout sample")
        tokens = mismatched = 0
        total_diff, max_diff = 0.0, 0.0
        first: tuple[int, int] | None = None
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
                pos, x, y = differ[0], float(a[differ[0]]), float(b[differ[0]])
                message = (f"{name}, position {pos}: rollout logprob {x!r} ({float_bits(x)}) but trainer "
                           f"{y!r} ({float_bits(y)})")
                if self.fail:
                    raise LogprobMismatch(message, remedy="score with the rollout's weights and committed tuple "
                                          "(detent_audit.rl.Scorer), or gate with fail=False to log and continue")
                log.warning("logprob mismatch: %s", message)
        return ParityReport(tokens, mismatched, total_diff / tokens if tokens else 0.0, max_diff, first)
