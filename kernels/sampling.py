"""Seeded, row-local sampling: noise is a pure function of (seed, position, vocabulary index).

Noise: SplitMix64 in int64 torch ops (multiplication wraps mod 2**64; `>>` is made logical by masking).
A row's stream state is `mix(mix(seed + G) + (position + 1) * G)` and vocabulary entry v draws
`mix(state + (v + 1) * G)` (G = 0x9E3779B97F4A7C15): the (v+1)-th output of a SplitMix64 stream, so no global
RNG is read and a row's draw does not depend on the batch. The top 53 bits give u in (0, 1) exactly in
float64; Gumbel noise is -log(-log(u)); the sampled token is argmax(logits / T + noise) over the kept set
(the Gumbel-max trick: a draw from softmax(logits / T) restricted to the kept set).

Filtering (vLLM's order: temperature, then top-k, then top-p, all row-local): top-k keeps every logit >= the
k-th largest (ties at the threshold are kept); top-p keeps the smallest prefix of the probabilities sorted
descending (stable: lower index first on ties) whose mass reaches p (the first token is always kept).
Temperature 0 is greedy: argmax of the raw logits, lowest index on ties (torch.argmax returns the first).
sort, cumsum, softmax, log_softmax and argmax over the last dim were measured row-invariant (rowlocal.py).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from detent_audit import isa
from detent_audit.errors import BadInput
from detent_audit.kernels.rowlocal import log_softmax
from detent_audit.kernels.rowlocal_c import log64


def _signed(value: int) -> int:
    """An unsigned 64-bit constant as the int64 with the same bits."""
    return value - (1 << 64) if value >= 1 << 63 else value


_GOLDEN = _signed(0x9E3779B97F4A7C15)
_MIX1 = _signed(0xBF58476D1CE4E5B9)
_MIX2 = _signed(0x94D049BB133111EB)


def _shr(z: torch.Tensor, bits: int) -> torch.Tensor:
    """Logical right shift of int64 bit patterns."""
    return (z >> bits) & ((1 << (64 - bits)) - 1)


def _mix(z: torch.Tensor) -> torch.Tensor:
    """SplitMix64's output function on int64 tensors (wrapping arithmetic)."""
    z = (z ^ _shr(z, 30)) * _MIX1
    z = (z ^ _shr(z, 27)) * _MIX2
    return z ^ _shr(z, 31)


def uniform_noise(seeds: torch.Tensor, positions: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """seeds, positions: [B] int -> u: [B, V] float64 in (0, 1), a pure function of (seed, position, v)."""
    seeds, positions = seeds.to(torch.int64), positions.to(torch.int64)
    state = _mix(_mix(seeds + _GOLDEN) + (positions + 1) * _GOLDEN)  # [B]
    counters = (torch.arange(vocab_size, dtype=torch.int64, device=seeds.device) + 1) * _GOLDEN  # [V]
    bits = _mix(state[:, None] + counters[None, :])
    return (_shr(bits, 11).double() + 0.5) * 2.0**-53


def _kept(scaled: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, any_k: bool, any_p: bool
          ) -> torch.Tensor:
    """scaled: [B, V] logits / T -> bool [B, V] of the entries top-k and then top-p keep (`any_k`, `any_p`:
    whether some row filters by top-k, by top-p)."""
    vocab = scaled.shape[-1]
    if not any_k and not any_p:
        return torch.ones_like(scaled, dtype=torch.bool)
    use_k = (top_k > 0) & (top_k < vocab)
    sorted_vals, sorted_ids = torch.sort(scaled, dim=-1, descending=True, stable=True)
    kth = sorted_vals.gather(1, (top_k.clamp(1, vocab) - 1)[:, None])  # [B, 1]
    keep = ~use_k[:, None] | (scaled >= kth)
    if any_p:
        probs = torch.softmax(torch.where(keep, scaled, -torch.inf), dim=-1)
        sorted_probs = probs.gather(1, sorted_ids)
        mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
        keep_sorted = (mass_before < top_p[:, None]) | (top_p[:, None] >= 1)
        keep = keep & torch.zeros_like(keep).scatter(1, sorted_ids, keep_sorted)
    return keep


@torch.no_grad()
def sample(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    seeds: torch.Tensor,
    positions: torch.Tensor,
) -> torch.Tensor:
    """logits: [B, V] fp32; per-row temperature, top_k (0 = off), top_p (1 = off), seed, position: [B].

    Returns tokens [B] int64. Row b's token depends only on row b's logits and parameters. The parameters
    are checked where they are given and then moved to the logits' device: given on the host (pinned), the
    call never waits for the device.
    """
    batch, vocab = logits.shape
    rows = [torch.as_tensor(t) for t in (temperature, top_k, top_p, seeds, positions)]
    if any(t.shape != (batch,) for t in rows):
        raise BadInput(f"sampling parameters must each have shape [{batch}]")
    temperature, top_k, top_p, seeds, positions = rows
    temperature, top_p, top_k = temperature.float(), top_p.float(), top_k.to(torch.int64)
    if bool((temperature < 0).any()) or bool(((top_p <= 0) | (top_p > 1)).any()) or bool((top_k < 0).any()):
        raise BadInput("temperature must be >= 0, top_p in (0, 1], top_k >= 0")
    greedy = logits.argmax(dim=-1)
    if bool((temperature == 0).all()):
        return greedy
    any_k, any_p = bool(((top_k > 0) & (top_k < vocab)).any()), bool((top_p < 1).any())
    dev = logits.device
    temperature, top_k, top_p, seeds, positions = (t.to(dev, non_blocking=True) for t in
                                                    (temperature, top_k, top_p, seeds, positions))
    scaled = logits.float() / torch.where(temperature > 0, temperature, 1.0)[:, None]
    keep = _kept(scaled, top_k, top_p, any_k, any_p)
    # torch's log gives other bits on another CPU (MKL's): the portable setting takes the C one (docs/isa.md)
    log = log64 if logits.device.type == "cpu" and isa.capped() else torch.log
    gumbel = -log(-log(uniform_noise(seeds, positions, vocab)))
    scores = torch.where(keep, scaled.double() + gumbel, -torch.inf)
    return torch.where(temperature == 0, greedy, scores.argmax(dim=-1))


@torch.no_grad()
def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """logits: [B, V], tokens: [B] -> log p(token) under the raw logits, [B] fp32."""
    return log_softmax(logits).gather(1, tokens.to(torch.int64)[:, None]).squeeze(1)


class TopLogprobs(NamedTuple):
    logprobs: torch.Tensor  # [B, n] fp32, descending
    ids: torch.Tensor  # [B, n] int64, lower id first on ties


@torch.no_grad()
def top_logprobs(logits: torch.Tensor, n: int) -> TopLogprobs:
    """The n most likely tokens of every row under the raw logits."""
    values, ids = torch.sort(log_softmax(logits), dim=-1, descending=True, stable=True)
    return TopLogprobs(values[:, :n].contiguous(), ids[:, :n].contiguous())
