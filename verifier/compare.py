"""Bit comparison of a receipt's output with a re-execution: first diverging position, bits, ULP distance."""

from __future__ import annotations

import struct
from dataclasses import dataclass


def f32_bits(x: float) -> int:
    return struct.unpack("<I", struct.pack("<f", x))[0]


def ulp_distance(a: float, b: float) -> int:
    """Distance between two fp32 values in units in the last place (ordered-integer difference)."""
    def ordered(x: float) -> int:
        bits = f32_bits(x)
        return bits if bits < 0x80000000 else 0x80000000 - bits
    return abs(ordered(a) - ordered(b))


@dataclass(frozen=True)
class Divergence:
    position: int                 # output position (0 = first output token)
    what: str                     # "token" | "logprob" | "length"
    expected_token: int | None
    got_token: int | None
    expected_bits: str | None     # fp32 logprob bits, hex
    got_bits: str | None
    ulp: int | None

    def describe(self) -> str:
        if self.what == "token":
            return (f"output token {self.position}: expected {self.expected_token}, got {self.got_token}")
        if self.what == "length":
            return (f"output length differs at position {self.position}: expected token "
                    f"{self.expected_token}, got {self.got_token}")
        return (f"logprob of output token {self.position}: expected bits {self.expected_bits}, got "
                f"{self.got_bits} ({self.ulp} ULP)")

    def to_json(self) -> dict:
        return dict(self.__dict__)


def first_divergence(expected_tokens: list[int], expected_lps: list[float], got_tokens: list[int],
                     got_lps: list[float]) -> Divergence | None:
    """The first position where the tokens or the fp32 logprob bits differ, or None."""
    for i in range(max(len(expected_tokens), len(got_tokens))):
        if i >= len(expected_tokens) or i >= len(got_tokens):
            return Divergence(i, "length", expected_tokens[i] if i < len(expected_tokens) else None,
                              got_tokens[i] if i < len(got_tokens) else None, None, None, None)
        if expected_tokens[i] != got_tokens[i]:
            return Divergence(i, "token", expected_tokens[i], got_tokens[i], None, None, None)
        e, g = expected_lps[i], got_lps[i]
        if f32_bits(e) != f32_bits(g):
            return Divergence(i, "logprob", expected_tokens[i], got_tokens[i], f"{f32_bits(e):08x}",
                              f"{f32_bits(g):08x}", ulp_distance(e, g))
    return None
