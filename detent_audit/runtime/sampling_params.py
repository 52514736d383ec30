"""Per-request sampling parameters: what a receipt records about how a token was drawn.

A `SamplingParams` that exists is valid: every field is checked in `__post_init__` and a bad value raises
`BadInput` naming the field, the value and the legal range. The seed is always explicit (default 0, never
drawn from the global RNG), so a receipt carries everything needed to redraw a token. `seed_for` gives a
sampled request that names no seed a fresh one (`fresh_seed`); a serving node replaces it with one derived
from its run and the bound request (`ServingNode.seeded`, manifests/seeds.py), returns it and records it.
"""

from __future__ import annotations

import math
import os
import struct
from dataclasses import dataclass, field
from typing import TypeGuard

from detent_audit.errors import BadInput
from detent_audit.runtime.stop_strings import check_stop_strings

MAX_LOGPROBS = 20  # top-n alternatives per output token
MAX_SEED = 2**64 - 1  # the seed travels in receipts as an unsigned 64-bit integer
MAX_TOKEN_ID = 2**32 - 1  # token ids are hashed as unsigned 32-bit integers (block_manager)


def is_int(value: object) -> TypeGuard[int]:
    """True for a Python int that is not a bool."""
    return isinstance(value, int) and not isinstance(value, bool)


def check_token_id(token_id: object, what: str) -> int:
    """Return `token_id` if it is an int in [0, 2**32 - 1], else raise `BadInput` naming `what`."""
    if type(token_id) is int and 0 <= token_id <= MAX_TOKEN_ID:  # the common case, checked first
        return token_id
    if not is_int(token_id) or not (0 <= token_id <= MAX_TOKEN_ID):
        raise BadInput(
            f"{what} must be token ids in [0, 2**32 - 1], got {token_id!r}",
            remedy="pass token ids produced by the model's tokenizer",
        )
    return token_id


def fresh_seed() -> int:
    """A seed from the OS's entropy, for a sampled request that gave none (never the global RNG)."""
    return int.from_bytes(os.urandom(8), "little")


def seed_for(temperature: float, seed: int | None) -> int:
    """The request's seed: its own; else, when it samples, a fresh one; else (greedy: unused) 0."""
    if seed is not None:
        return seed
    return fresh_seed() if _is_number(temperature) and temperature > 0 else 0


def _as_float32(value: float) -> float:
    return struct.unpack("<f", struct.pack("<f", value))[0]


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


@dataclass(frozen=True)
class SamplingParams:
    """How to draw each output token of one request.

    temperature: 0 is greedy (argmax); > 0 samples from softmax(logits / temperature) with noise drawn from
        `seed`. top_k: keep the k most likely tokens, 0 = off. top_p: nucleus mass in (0, 1], 1 = off.
    max_tokens: output tokens at most (the sequence finishes with reason 'length').
    seed: unsigned 64-bit sampling seed, default 0; it is recorded in every receipt, also when greedy.
    stop_token_ids: tokens that finish the sequence with reason 'stop' (kept in the output); they apply
        even with `ignore_eos`, which only disables the model's end-of-sequence tokens.
    logprobs: also return the top-n alternatives per output token (0..20), None = only the sampled token's
        logprob (which is always recorded).
    stop: stop strings: the first output token whose detokenized text contains one finishes the sequence with
        reason 'stop' (kept in the output; the returned text is cut before the string: stop_strings.py).
    """

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    max_tokens: int = 16
    seed: int = 0
    stop_token_ids: tuple[int, ...] = field(default=())
    ignore_eos: bool = False
    logprobs: int | None = None
    stop: tuple[str, ...] = field(default=())

    def __post_init__(self) -> None:
        if not _is_number(self.temperature) or not math.isfinite(self.temperature) or self.temperature < 0:
            raise BadInput(
                f"temperature must be a finite number >= 0 (0 = greedy), got {self.temperature!r}",
                remedy="pass temperature=0 for greedy decoding or a positive value to sample",
            )
        if not is_int(self.top_k) or self.top_k < 0:
            raise BadInput(
                f"top_k must be an integer >= 0 (0 = off), got {self.top_k!r}",
                remedy="pass top_k=0 to disable top-k filtering",
            )
        if not _is_number(self.top_p) or not (0.0 < self.top_p <= 1.0):
            raise BadInput(
                f"top_p must be a number in (0, 1], got {self.top_p!r}",
                remedy="pass top_p=1.0 to disable nucleus filtering",
            )
        if _as_float32(self.top_p) == 0.0:
            raise BadInput(f"top_p {self.top_p!r} is 0 in float32, as the sampler holds it",
                           remedy="pass a top_p of at least 1e-45")
        if not is_int(self.max_tokens) or self.max_tokens < 1:
            raise BadInput(
                f"max_tokens must be an integer >= 1, got {self.max_tokens!r}",
                remedy="ask for at least one output token",
            )
        if not is_int(self.seed) or not (0 <= self.seed <= MAX_SEED):
            raise BadInput(
                f"seed must be an integer in [0, 2**64 - 1], got {self.seed!r}",
                remedy="pass a non-negative 64-bit seed",
            )
        if not isinstance(self.stop_token_ids, (tuple, list)):
            raise BadInput(
                f"stop_token_ids must be a tuple of token ids, got {type(self.stop_token_ids).__name__}",
                remedy="pass stop_token_ids as a tuple of integers",
            )
        for token_id in self.stop_token_ids:
            check_token_id(token_id, "stop_token_ids")
        # A list is accepted for convenience and stored as a tuple, so the params stay hashable and frozen.
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        if not isinstance(self.ignore_eos, bool):
            raise BadInput(
                f"ignore_eos must be a bool, got {self.ignore_eos!r}",
                remedy="pass ignore_eos=True or ignore_eos=False",
            )
        if self.logprobs is not None and (not is_int(self.logprobs)
                                          or not (0 <= self.logprobs <= MAX_LOGPROBS)):
            raise BadInput(
                f"logprobs must be None or an integer in [0, {MAX_LOGPROBS}], got {self.logprobs!r}",
                remedy=f"ask for at most {MAX_LOGPROBS} alternatives per token",
            )
        object.__setattr__(self, "stop", check_stop_strings(self.stop))

    @property
    def is_greedy(self) -> bool:
        """True when tokens are the argmax of the logits (temperature 0); the seed is then unused."""
        return self.temperature == 0
