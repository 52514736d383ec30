"""SiLU-and-mul, a float64 log and RoPE's cos and sin in C, every operation's order written out: the portable
setting's.

torch's elementwise `exp`, `log` and `sqrt` give other bits on another CPU under the same torch build and the
same ISA cap (measured on an Intel Xeon and an AMD EPYC: `benchmarks/isa_ops.py`, docs/isa.md), and so do its
`sin` and `cos` beyond |x| of about 1e4 (MKL's vector math, moved to its AVX branch on one CPU:
`tests/kernels/test_kernel_fixed_order.py`), so the engines' uses of them are written here for the portable
setting:
- `silu_and_mul(x)`: silu(gate) * up from x = [gate, up], with e = exp(-|g|) from the C attention's own exp
  (IEEE add, mul and ldexp only): silu(g) = g / (1 + e) for g >= 0, g * e / (1 + e) below (the same function,
  written so that exp is only ever taken of a non-positive number).
- `log64(x)`: the natural log of positive float64 values (the sampler's Gumbel noise): x = m * 2^e with m in
  [sqrt(1/2), sqrt(2)), log(m) = 2 * atanh(s), s = (m - 1) / (m + 1), a series to s^25 (truncation below
  1e-20 relative), e * ln 2 in two parts.
- `sincos(x)`: RoPE's tables (an angle is a position times a frequency, up to the context length): reduced by
  pi/2 in three parts and two Taylor series in double, rounded once to float32 (on 331,072 angles up to
  131,072 it equals torch's float64 sin and cos rounded to float32).
Compiled as the C attention is (`attention_c.build`: no fast-math, no contraction into FMA), so the bits are
those of the C source on any x86-64 CPU.
"""

from __future__ import annotations

import ctypes

import torch

from detent_audit.errors import BadInput
from detent_audit.kernels.attention_c import EXP_SOURCE, Signature, load

IMPLEMENTATION = "c-fixed-order-rowlocal-v2"  # what facts record; changes whenever the arithmetic changes

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

/* cos and sin of float32 x (|x| < 2^19: RoPE's angles, position times frequency), each evaluated in double
   and rounded once to float32. x = k pi/2 + r, k = x 2/pi rounded to nearest; r by three parts of pi/2
   (33, 33 and 53 bits: k times either of the first two is exact); on |r| <= pi/4 the Taylor series of sin to
   r^19 and of cos to r^20 (Horner, truncation below 1e-18); the quadrant k mod 4 picks the signs. */
void detent_sincos(const float *x, float *cos_out, float *sin_out, int64_t n) {
    const double two_over_pi = 6.36619772367581382433e-01;
    const double pio2_1 = 1.57079632673412561417e+00, pio2_2 = 6.07710050630396597660e-11,
                 pio2_3 = 2.02226624871116645580e-21;
    for (int64_t i = 0; i < n; i++) {
        const double v = (double)x[i];
        if (!(v == v) || v > 524288.0 || v < -524288.0) {  /* NaN (and beyond the range: refused in Python) */
            cos_out[i] = sin_out[i] = (float)(v - v);
            continue;
        }
        const double t = v * two_over_pi;
        const int64_t k = (int64_t)(t >= 0.0 ? t + 0.5 : t - 0.5);
        const double kd = (double)k;
        const double r = ((v - kd * pio2_1) - kd * pio2_2) - kd * pio2_3;
        const double z = r * r;
        double sp = -1.0 / 121645100408832000.0;                 /* -1/19! */
        sp = sp * z + 1.0 / 355687428096000.0;                   /*  1/17! */
        sp = sp * z - 1.0 / 1307674368000.0;                     /* -1/15! */
        sp = sp * z + 1.0 / 6227020800.0;                        /*  1/13! */
        sp = sp * z - 1.0 / 39916800.0;                          /* -1/11! */
        sp = sp * z + 1.0 / 362880.0;                            /*  1/9!  */
        sp = sp * z - 1.0 / 5040.0;                              /* -1/7!  */
        sp = sp * z + 1.0 / 120.0;                               /*  1/5!  */
        sp = sp * z - 1.0 / 6.0;                                 /* -1/3!  */
        const double sn = r == 0.0 ? r : r + r * (z * sp);  /* sin(-0) = -0 */
        double cp = 1.0 / 2432902008176640000.0;                 /*  1/20! */
        cp = cp * z - 1.0 / 6402373705728000.0;                  /* -1/18! */
        cp = cp * z + 1.0 / 20922789888000.0;                    /*  1/16! */
        cp = cp * z - 1.0 / 87178291200.0;                       /* -1/14! */
        cp = cp * z + 1.0 / 479001600.0;                         /*  1/12! */
        cp = cp * z - 1.0 / 3628800.0;                           /* -1/10! */
        cp = cp * z + 1.0 / 40320.0;                             /*  1/8!  */
        cp = cp * z - 1.0 / 720.0;                               /* -1/6!  */
        cp = cp * z + 1.0 / 24.0;                                /*  1/4!  */
        cp = cp * z - 0.5;                                       /* -1/2!  */
        const double cs = 1.0 + z * cp;
        switch (k & 3) {
            case 0: cos_out[i] = (float)cs; sin_out[i] = (float)sn; break;
            case 1: cos_out[i] = (float)-sn; sin_out[i] = (float)cs; break;
            case 2: cos_out[i] = (float)-cs; sin_out[i] = (float)-sn; break;
            default: cos_out[i] = (float)sn; sin_out[i] = (float)-cs; break;
        }
    }
}
"""

def library(arch_flags: tuple[str, ...] | None = None) -> ctypes.CDLL:
    """The compiled kernels for these flags; `attention_c.Unavailable` where no C compiler builds them."""
    signatures: dict[str, Signature] = {
        "detent_silu_and_mul": (None, [ctypes.c_void_p] * 2 + [ctypes.c_int64] * 2),
        "detent_log64": (None, [ctypes.c_void_p] * 2 + [ctypes.c_int64]),
        "detent_sincos": (None, [ctypes.c_void_p] * 3 + [ctypes.c_int64])}
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


@torch.no_grad()
def sincos(x: torch.Tensor, *, arch_flags: tuple[str, ...] | None = None
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos x, sin x) of a float32 tensor with |x| < 2^19 (RoPE's angles), in the C order above: torch's sin
    and cos are MKL's vector math, whose float32 results differ between CPUs beyond |x| of about 1e4 (a
    position past 10,000 at the lowest RoPE frequencies)."""
    if x.dtype != torch.float32:
        raise BadInput(f"sincos takes float32, got {x.dtype}")
    src = x.contiguous()
    if src.numel() and float(src.abs().max()) >= 524288.0:
        raise BadInput("sincos takes |x| < 2^19 (RoPE's angles)", remedy="a context below 524,288 positions")
    cos, sin = torch.empty_like(src), torch.empty_like(src)
    if src.numel():
        library(arch_flags).detent_sincos(src.data_ptr(), cos.data_ptr(), sin.data_ptr(), src.numel())
    return cos, sin
