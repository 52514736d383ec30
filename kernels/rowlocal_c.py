"""SiLU-and-mul and a float64 log in C, every operation's order written out: the portable setting's.

torch's elementwise `exp`, `log` and `sqrt` give other bits on another CPU under the same torch build and the
same ISA cap (measured on an Intel Xeon and an AMD EPYC: `benchmarks/isa_ops.py`, docs/isa.md; the vectorized
kernels of softmax, log_softmax, rsqrt, sin, cos and pow agreed), so the engine's two uses of them are
written here for the portable setting:
- `silu_and_mul(x)`: silu(gate) * up from x = [gate, up], with e = exp(-|g|) from the C attention's own exp
  (IEEE add, mul and ldexp only): silu(g) = g / (1 + e) for g >= 0, g * e / (1 + e) below (the same function,
  written so that exp is only ever taken of a non-positive number).
- `log64(x)`: the natural log of positive float64 values (the sampler's Gumbel noise): x = m * 2^e with m in
  [sqrt(1/2), sqrt(2)), log(m) = 2 * atanh(s), s = (m - 1) / (m + 1), a series to s^25 (truncation below
  1e-20 relative), e * ln 2 in two parts.
Compiled as the C attention is (`attention_c.build`: no fast-math, no contraction into FMA), so the bits are
those of the C source on any x86-64 CPU.
"""

from __future__ import annotations

import ctypes

import torch

from detent_audit.errors import BadInput
from detent_audit.kernels.attention_c import EXP_SOURCE, Signature, load

IMPLEMENTATION = "c-fixed-order-rowlocal-v1"  # what facts record; changes whenever the arithmetic changes

SOURCE = r"""
#include <stdint.h>
#include <string.h>

""" + EXP_SOURCE + r"""
void detent_silu_and_mul(const float *x, float *out, int64_t rows, int64_t inter) {
    for (int64_t r = 0; r < rows; r++) {
        const float *gate = x + r * 2 * inter, *up = gate + inter;
        float *dst = out + r * inter;
        for (int64_t i = 0; i < inter; i++) {
            const float g = gate[i];
            const float e = dexp(g >= 0.0f ? -g : g);
            const float act = g >= 0.0f ? g / (1.0f + e) : (g * e) / (1.0f + e);
            dst[i] = act * up[i];
        }
    }
}

void detent_log64(const double *x, double *out, int64_t n) {
    const double ln2_hi = 6.93147180369123816490e-01, ln2_lo = 1.90821492927058770002e-10;
    const double sqrt2 = 1.41421356237309504880;
    for (int64_t i = 0; i < n; i++) {
        double v = x[i];
        if (!(v > 0.0) || v > 1.7976931348623157e308) {  /* 0: -inf; below 0, NaN, inf: NaN */
            out[i] = v == 0.0 ? -1.0 / 0.0 : (v - v) / 0.0;
            continue;
        }
        int64_t e = 0;
        if (v < 2.2250738585072014e-308) { v = v * 18014398509481984.0; e = -54; }  /* subnormal: x 2^54 */
        uint64_t bits;
        memcpy(&bits, &v, sizeof bits);
        e += (int64_t)((bits >> 52) & 0x7ff) - 1023;
        bits = (bits & 0x000fffffffffffffULL) | 0x3ff0000000000000ULL;
        double m;
        memcpy(&m, &bits, sizeof m);
        if (m > sqrt2) { m = m * 0.5; e += 1; }
        const double s = (m - 1.0) / (m + 1.0), z = s * s;
        double p = 1.0 / 25.0;
        p = p * z + 1.0 / 23.0;
        p = p * z + 1.0 / 21.0;
        p = p * z + 1.0 / 19.0;
        p = p * z + 1.0 / 17.0;
        p = p * z + 1.0 / 15.0;
        p = p * z + 1.0 / 13.0;
        p = p * z + 1.0 / 11.0;
        p = p * z + 1.0 / 9.0;
        p = p * z + 1.0 / 7.0;
        p = p * z + 1.0 / 5.0;
        p = p * z + 1.0 / 3.0;
        p = p * z + 1.0;
        const double ef = (double)e;
        out[i] = ef * ln2_hi + (ef * ln2_lo + 2.0 * s * p);
    }
}
"""

def library(arch_flags: tuple[str, ...] | None = None) -> ctypes.CDLL:
    """The compiled kernels for these flags; `attention_c.Unavailable` where no C compiler builds them."""
    signatures: dict[str, Signature] = {
        "detent_silu_and_mul": (None, [ctypes.c_void_p] * 2 + [ctypes.c_int64] * 2),
        "detent_log64": (None, [ctypes.c_void_p] * 2 + [ctypes.c_int64])}
    return load(SOURCE, "rowlocal", signatures, arch_flags)


@torch.no_grad()
def silu_and_mul(x: torch.Tensor, *, arch_flags: tuple[str, ...] | None = None) -> torch.Tensor:
    """x: [..., 2I] fp32 (gate then up) -> silu(gate) * up: [..., I] fp32."""
    if x.dtype != torch.float32 or x.shape[-1] % 2:
        raise BadInput(f"the C SiLU takes float32 [..., 2I], got {x.dtype} {tuple(x.shape)}")
    inter = x.shape[-1] // 2
    x2 = x.reshape(-1, 2 * inter).contiguous()
    out = torch.empty(x2.shape[0], inter, dtype=torch.float32)
    if out.numel():
        library(arch_flags).detent_silu_and_mul(x2.data_ptr(), out.data_ptr(), x2.shape[0], inter)
    return out.reshape(*x.shape[:-1], inter)


@torch.no_grad()
def log64(x: torch.Tensor, *, arch_flags: tuple[str, ...] | None = None) -> torch.Tensor:
    """The natural log of a float64 tensor (positive values; 0 gives -inf, below 0 or NaN gives NaN)."""
    if x.dtype != torch.float64:
        raise BadInput(f"log64 takes float64, got {x.dtype}")
    src = x.contiguous()
    out = torch.empty_like(src)
    if out.numel():
        library(arch_flags).detent_log64(src.data_ptr(), out.data_ptr(), src.numel())
    return out
