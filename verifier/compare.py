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


def prompt_divergence(prompt: list[int], expected_lps: list[float], got_lps: list[float],
                      expected_tops: list[list[tuple[int, float]]], got_tops: list[list[tuple[int, float]]]
                      ) -> str | None:
    """An echo receipt's prompt scores against a teacher-forced prefill: the first prompt position whose
    logprob bits, or whose top-n ids or bits, differ (position 1 is the first scored token), or None."""
    for i, (e, g) in enumerate(zip(expected_lps, got_lps)):
        if f32_bits(e) != f32_bits(g):
            return (f"logprob of prompt token {i + 1} ({prompt[i + 1]}): expected bits {f32_bits(e):08x}, "
                    f"got {f32_bits(g):08x} ({ulp_distance(e, g)} ULP)")
    for i, (e_top, g_top) in enumerate(zip(expected_tops, got_tops)):
        e_bits, g_bits = [(t, f32_bits(v)) for t, v in e_top], [(t, f32_bits(v)) for t, v in g_top]
        if e_bits != g_bits:
            return (f"top alternatives of prompt token {i + 1}: expected "
                    f"{[(t, f'{b:08x}') for t, b in e_bits]}, got {[(t, f'{b:08x}') for t, b in g_bits]}")
    return None

