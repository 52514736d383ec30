"""Matrix product in C with every floating-point operation's order written out: the same bits on any x86 CPU.

`linear(x, weight)` is x @ weight.T, x: [M, K], weight: [N, K], both fp32. Output element (m, n) is a dot
product of two contiguous K-rows: lane l (0..7) sums the products x[m, k] * w[n, k] for k = l, l + 8, l + 16,
... in increasing k (each product rounded, then added: no fused multiply-add), then the eight lanes are added
in a fixed tree. Nothing else decides the order: not the batch (each element's arithmetic is its own, so a
row's bits do not depend on M or on the other rows), not the thread count (threads split the N columns; an
element is one thread's), not the CPU (the file is compiled with `-ffp-contract=off` and without fast-math, so
the compiler may vectorize the lanes but not reorder or fuse them; `-mavx2` or not gives the same bits,
tested) and not a BLAS's blocking, which may read the CPU's vendor and cache sizes (with MKL's products, the
same torch build under the same ISA cap gave logprobs 0-10 ULP apart on an Intel Xeon and an AMD EPYC:
docs/isa.md). `reference` is the same
arithmetic in torch's elementwise ops (correctly rounded IEEE mul and add), the tests' oracle.

The engine uses this form ("fixed") under the portable ISA setting, where bits must not depend on the CPU; it
is slower than MKL (benchmarks/RESULTS.md, "ISA"). The build machinery is the C attention's (`attention_c`).
"""

from __future__ import annotations

import ctypes

import torch

from detent_audit.errors import BadInput
from detent_audit.kernels.attention_c import JOBS_SOURCE, load

IMPLEMENTATION = "c-fixed-order-gemm-v1"  # what facts record; changes whenever the arithmetic below changes
LANES = 8

SOURCE = r"""
#include <stdint.h>
#include <string.h>
#include <pthread.h>

#define LANES 8
/* eight lanes as one value: the compiler emits one AVX register or two SSE ones; every operation on it is
   the IEEE operation lane by lane */
typedef float v8 __attribute__((vector_size(32)));

static inline v8 load8(const float *p) { v8 v; memcpy(&v, p, sizeof v); return v; }

static inline float tree(v8 l) {
    return ((l[0] + l[4]) + (l[2] + l[6])) + ((l[1] + l[5]) + (l[3] + l[7]));
}

/* out[m, n] for m in [m0, m0 + MR), n in [n0, n0 + NR): lane l sums k = l, l + 8, ... in order (a K tail
   shorter than 8 adds its products to lanes 0.. in order); then the fixed tree. */
#define BLOCK(MR, NR)                                                                                      \
static void block_##MR##x##NR(const float *x, const float *w, float *out, int64_t K, int64_t N,           \
                              int64_t m0, int64_t n0) {                                                  \
    v8 acc[MR][NR];                                                                                      \
    for (int a = 0; a < MR; a++) for (int b = 0; b < NR; b++) acc[a][b] = (v8){0, 0, 0, 0, 0, 0, 0, 0};  \
    const int64_t body = K - K % LANES;                                                                  \
    for (int64_t k = 0; k < body; k += LANES) {                                                          \
        v8 xv[MR], wv[NR];                                                                               \
        for (int a = 0; a < MR; a++) xv[a] = load8(x + (m0 + a) * K + k);                                \
        for (int b = 0; b < NR; b++) wv[b] = load8(w + (n0 + b) * K + k);                                \
        for (int a = 0; a < MR; a++) for (int b = 0; b < NR; b++) acc[a][b] = acc[a][b] + xv[a] * wv[b]; \
    }                                                                                                    \
    for (int64_t k = body; k < K; k++)                                                                   \
        for (int a = 0; a < MR; a++) for (int b = 0; b < NR; b++)                                        \
            acc[a][b][k - body] = acc[a][b][k - body] + x[(m0 + a) * K + k] * w[(n0 + b) * K + k];       \
    for (int a = 0; a < MR; a++) for (int b = 0; b < NR; b++)                                            \
        out[(m0 + a) * N + n0 + b] = tree(acc[a][b]);                                                    \
}
BLOCK(4, 2)
BLOCK(1, 4)
BLOCK(1, 1)

""" + JOBS_SOURCE + r"""
typedef struct { const float *x; const float *w; float *out; int64_t M, K, N, n_begin, n_end; } job_t;

/* the weight columns of one pass over the rows: about 256 KB of them, so that they stay in the core's L2
   while every block of 4 rows reads them (an even count: 2 columns per block) */
static int64_t panel_columns(int64_t K) {
    int64_t cols = (256 * 1024 / 4) / (K > 0 ? K : 1);
    cols -= cols % 2;
    return cols < 2 ? 2 : cols;
}

static void *run(void *arg) {
    const job_t *j = (const job_t *)arg;
    int64_t n = j->n_begin;
    if (j->M >= 4) {
        const int64_t panel = panel_columns(j->K);
        const int64_t even_end = j->n_begin + (j->n_end - j->n_begin) / 2 * 2;
        for (int64_t p = j->n_begin; p < even_end; p += panel) {
            const int64_t p_end = p + panel < even_end ? p + panel : even_end;
            int64_t m = 0;
            for (; m + 4 <= j->M; m += 4)
                for (int64_t c = p; c < p_end; c += 2) block_4x2(j->x, j->w, j->out, j->K, j->N, m, c);
            for (; m < j->M; m++)
                for (int64_t c = p; c < p_end; c++) block_1x1(j->x, j->w, j->out, j->K, j->N, m, c);
        }
        n = even_end;
    } else {
        for (; n + 4 <= j->n_end; n += 4)
            for (int64_t m = 0; m < j->M; m++) block_1x4(j->x, j->w, j->out, j->K, j->N, m, n);
    }
    for (; n < j->n_end; n++)
        for (int64_t m = 0; m < j->M; m++) block_1x1(j->x, j->w, j->out, j->K, j->N, m, n);
    return 0;
}

int detent_gemm(const float *x, const float *w, float *out, int64_t M, int64_t K, int64_t N,
                int64_t threads) {
    job_t base = {x, w, out, M, K, N, 0, N};
    if (threads > 16) threads = 16;
    if (threads <= 1 || N < 64 * threads) { run(&base); return 0; }
    job_t jobs[16];
    for (int64_t i = 0; i < threads; i++) {  /* column ranges, multiples of 4 apart */
        jobs[i] = base;
        jobs[i].n_begin = (N / 4 * i / threads) * 4;
        jobs[i].n_end = i + 1 == threads ? N : (N / 4 * (i + 1) / threads) * 4;
    }
    run_jobs(run, jobs, sizeof jobs[0], threads);
    return 0;
}
"""

def library(arch_flags: tuple[str, ...] | None = None) -> ctypes.CDLL:
    """The compiled GEMM for these flags (default: `-mavx2` where the CPU has it); `attention_c.Unavailable`
    where no C compiler builds it."""
    args = [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 4
    return load(SOURCE, "gemm", {"detent_gemm": (ctypes.c_int, args)}, arch_flags)


@torch.no_grad()
def linear(x: torch.Tensor, weight: torch.Tensor, *, threads: int | None = None,
           arch_flags: tuple[str, ...] | None = None) -> torch.Tensor:
    """x: [M, K] fp32, weight: [N, K] fp32 -> [M, N] fp32, in the fixed order above. `threads` defaults to
    torch's (it never changes bits)."""
    if x.dtype != torch.float32 or weight.dtype != torch.float32:
        raise BadInput(f"the fixed-order GEMM runs float32 only, got {x.dtype} x {weight.dtype}")
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise BadInput(f"fixed-order GEMM: x {tuple(x.shape)} and weight {tuple(weight.shape)} do not match")
    m, k = x.shape
    n = weight.shape[0]
    out = torch.empty(m, n, dtype=torch.float32)
    if m == 0 or n == 0:
        return out
    x, weight = x.contiguous(), weight.contiguous()
    library(arch_flags).detent_gemm(x.data_ptr(), weight.data_ptr(), out.data_ptr(), m, k, n,
                                    torch.get_num_threads() if threads is None else threads)
    return out


@torch.no_grad()
def reference(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The same arithmetic as `linear`, in torch's elementwise ops (slow; the tests' oracle)."""
    m, k = x.shape
    n = weight.shape[0]
    lanes = torch.zeros(m, n, LANES, dtype=torch.float32)
    body = k - k % LANES
    for k0 in range(0, body, LANES):
        lanes = lanes + x[:, None, k0:k0 + LANES] * weight[None, :, k0:k0 + LANES]
    for kk in range(body, k):
        lanes[:, :, kk - body] = lanes[:, :, kk - body] + x[:, None, kk] * weight[None, :, kk]
    t = lanes
    return (((t[..., 0] + t[..., 4]) + (t[..., 2] + t[..., 6]))
            + ((t[..., 1] + t[..., 5]) + (t[..., 3] + t[..., 7])))
