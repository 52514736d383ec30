"""Paged causal GQA attention in C (built with the machine's C compiler, loaded with ctypes), fixed order.

The same contract as `attention.paged_attention` with `AttentionParams(kv_tile, split_stride)`: a query token
at absolute position p reduces over its own sequence's KV positions 0..p in tiles [j*tile, (j+1)*tile) and
splits [s*stride, (s+1)*stride) aligned to absolute positions, an online softmax per split and the split
partials merged in split order. Here the order of every floating-point operation is written out in C and
nothing else decides it: a dot product over D accumulates in 8 lanes (lane i takes d = i, i+8, ...) and adds
the lanes in a fixed tree; a tile's exp and sums run position by position; exp is this file's own (IEEE
add/mul/ldexp only, no libm). The file is compiled with `-ffp-contract=off` and without fast-math, so the
compiler may vectorize but not reorder or fuse: the bits of a token are a function of its q, its KV 0..p, p,
the scale and the params, on any x86-64 build (`-mavx2` or not: tested equal), whatever the batch, the
step's query count, chunked prefill or a prefix-cache hit.

The bits are not those of the torch form (`attention.py`, whose products are MKL's): an engine records which
form it runs (`IMPLEMENTATION`). Work is split over tokens by threads (each token's arithmetic is one
thread's, so the thread count does not change bits). Falls back, raising `Unavailable` with the compiler's
message, where no C compiler builds it; callers say so and use the torch form.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from detent_audit.enums import ExitCode
from detent_audit.errors import BadInput, DetentError
from detent_audit.kernels.attention_metadata import AttentionMetadata
from detent_audit.kernels.params import AttentionParams

IMPLEMENTATION = "c-fixed-order-v1"  # what facts record; changes whenever the arithmetic below changes
ENV_CC = "DETENT_CC"  # the C compiler (default: cc)
ENV_CACHE = "DETENT_KERNEL_CACHE"  # where the built library is kept (default: ~/.cache/detent-audit/kernels)

# exp(x) for x <= 0 in IEEE add, mul and ldexp only (the SiLU of `rowlocal_c` takes it too)
EXP_SOURCE = r"""
/* exp(x) for x <= 0 (every argument here is a score minus a running max, or -inf): Cody-Waite reduction
   x = n*ln2 + r, |r| <= ln2/2, a degree-7 Taylor polynomial in Horner form, times 2^n built from its bits.
   Branch-free so that a loop of it vectorizes (the same operations per lane). */
static inline float dexp(float x) {
    const float log2e = 1.44269504088896341f, ln2_hi = 0.693145751953125f, ln2_lo = 1.42860682030941723e-6f;
    const int keep = x > -87.0f;   /* false for -inf, NaN and underflow */
    const float xc = keep ? x : -87.0f;
    const float t = xc * log2e;
    const int32_t n = (int32_t)(t < 0.0f ? t - 0.5f : t + 0.5f);
    const float nf = (float)n;
    const float r = (xc - nf * ln2_hi) - nf * ln2_lo;
    float p = 1.0f / 5040.0f;
    p = p * r + 1.0f / 720.0f;
    p = p * r + 1.0f / 120.0f;
    p = p * r + 1.0f / 24.0f;
    p = p * r + 1.0f / 6.0f;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    union { int32_t i; float f; } scale;
    scale.i = (n + 127) << 23;     /* n >= -126: a normal power of two */
    const float y = p * scale.f;
    return keep ? y : 0.0f;
}
"""

# n jobs (n <= 16) of `size` bytes each: job 0 on the calling thread, the others on threads of their own (a
# job whose thread cannot start runs on the calling thread after the others); the fixed-order GEMM uses it too
JOBS_SOURCE = r"""
static void run_jobs(void *(*run)(void *), void *jobs, size_t size, int64_t n) {
    pthread_t ids[16];
    int64_t started = 0;
    for (int64_t i = 1; i < n; i++, started++)
        if (pthread_create(&ids[i], 0, run, (char *)jobs + i * size)) break;
    run(jobs);
    for (int64_t i = 1; i <= started; i++) pthread_join(ids[i], 0);
    for (int64_t i = started + 1; i < n; i++) run((char *)jobs + i * size);
}
"""

SOURCE = r"""
#include <stdint.h>
#include <string.h>
#include <math.h>
#include <pthread.h>

#define LANES 8

""" + EXP_SOURCE + JOBS_SOURCE + r"""
/* a [D] dot product: lane l sums d = l, l+8, l+16, ... in order, then the lanes in a fixed tree
   (D % 8 == 0) */
static inline float dot(const float *a, const float *b, int64_t d) {
    float lane[LANES] = {0, 0, 0, 0, 0, 0, 0, 0};
    for (int64_t i = 0; i < d; i += LANES)
        for (int l = 0; l < LANES; l++) lane[l] = lane[l] + a[i + l] * b[i + l];
    return ((lane[0] + lane[4]) + (lane[2] + lane[6])) + ((lane[1] + lane[5]) + (lane[3] + lane[7]));
}

typedef struct {
    const float *q; const float *k; const float *v; const int32_t *tables; const int64_t *tok_seq;
    const int64_t *tok_pos; float *out; int64_t tokens, q_heads, kv_heads, dim, block_size, max_blocks;
    int64_t tile, stride; float scale; int64_t begin, end;
} job_t;

#define MAX_G 16
#define MAX_D 256
#define MAX_TILE 512

static void one(const job_t *j, int64_t t, int64_t h) {
    const int64_t G = j->q_heads / j->kv_heads, D = j->dim, pos = j->tok_pos[t];
    const int32_t *table = j->tables + j->tok_seq[t] * j->max_blocks;
    float q[MAX_G][MAX_D], acc[MAX_G][MAX_D], big_acc[MAX_G][MAX_D], pv[MAX_G][MAX_D], s[MAX_G][MAX_TILE];
    float m[MAX_G], l[MAX_G], big_m[MAX_G], big_l[MAX_G];
    const float *krow[MAX_TILE], *vrow[MAX_TILE];
    for (int64_t g = 0; g < G; g++) {
        const float *src = j->q + (t * j->q_heads + h * G + g) * D;
        for (int64_t d = 0; d < D; d++) { q[g][d] = src[d] * j->scale; big_acc[g][d] = 0.0f; }
        big_m[g] = -INFINITY; big_l[g] = 0.0f;
    }
    const int64_t stride = j->stride > 0 ? j->stride : pos + 1;
    for (int64_t s0 = 0; s0 <= pos; s0 += stride) {
        for (int64_t g = 0; g < G; g++) {
            m[g] = -INFINITY; l[g] = 0.0f;
            for (int64_t d = 0; d < D; d++) acc[g][d] = 0.0f;
        }
        for (int64_t t0 = s0; t0 <= pos && t0 < s0 + stride; t0 += j->tile) {
            int64_t n = pos + 1 - t0 < j->tile ? pos + 1 - t0 : j->tile;
            for (int64_t i = 0; i < n; i++) {
                int64_t p = t0 + i, block = table[p / j->block_size];
                int64_t slot = block * j->block_size + p % j->block_size;
                krow[i] = j->k + (slot * j->kv_heads + h) * D;
                vrow[i] = j->v + (slot * j->kv_heads + h) * D;
            }
            for (int64_t i = 0; i < n; i++)
                for (int64_t g = 0; g < G; g++) s[g][i] = dot(q[g], krow[i], D);
            for (int64_t g = 0; g < G; g++) {
                float tmax = -INFINITY;
                for (int64_t i = 0; i < n; i++) tmax = s[g][i] > tmax ? s[g][i] : tmax;
                float m_new = m[g] > tmax ? m[g] : tmax;
                float alpha = dexp(m[g] - m_new), psum = 0.0f;
                for (int64_t i = 0; i < n; i++) { s[g][i] = dexp(s[g][i] - m_new); psum = psum + s[g][i]; }
                l[g] = l[g] * alpha + psum;
                for (int64_t d = 0; d < D; d++) { acc[g][d] = acc[g][d] * alpha; pv[g][d] = 0.0f; }
                m[g] = m_new;
            }
            for (int64_t i = 0; i < n; i++) {  /* each (g, d) sums the tile's positions in order */
                const float *vr = vrow[i];
                for (int64_t g = 0; g < G; g++) {
                    const float pi = s[g][i];
                    float *pg = pv[g];
                    for (int64_t d = 0; d < D; d++) pg[d] = pg[d] + pi * vr[d];
                }
            }
            for (int64_t g = 0; g < G; g++)
                for (int64_t d = 0; d < D; d++) acc[g][d] = acc[g][d] + pv[g][d];
        }
        for (int64_t g = 0; g < G; g++) {  /* merge this split's partial, in split order */
            float nm = big_m[g] > m[g] ? big_m[g] : m[g];
            float a = dexp(big_m[g] - nm), b = dexp(m[g] - nm);
            big_l[g] = big_l[g] * a + l[g] * b;
            for (int64_t d = 0; d < D; d++) big_acc[g][d] = big_acc[g][d] * a + acc[g][d] * b;
            big_m[g] = nm;
        }
    }
    for (int64_t g = 0; g < G; g++) {
        float *dst = j->out + (t * j->q_heads + h * G + g) * D;
        for (int64_t d = 0; d < D; d++) dst[d] = big_acc[g][d] / big_l[g];
    }
}

static void *run(void *arg) {
    const job_t *j = (const job_t *)arg;
    for (int64_t w = j->begin; w < j->end; w++) one(j, w / j->kv_heads, w % j->kv_heads);
    return 0;
}

int detent_paged_attention(const float *q, const float *k, const float *v, const int32_t *tables,
                           const int64_t *tok_seq, const int64_t *tok_pos, float *out, int64_t tokens,
                           int64_t q_heads, int64_t kv_heads, int64_t dim, int64_t block_size,
                           int64_t max_blocks, int64_t tile, int64_t stride, float scale, int64_t threads) {
    if (q_heads / kv_heads > MAX_G || dim > MAX_D || dim % LANES || tile > MAX_TILE) return 1;
    job_t base = {q, k, v, tables, tok_seq, tok_pos, out, tokens, q_heads, kv_heads, dim, block_size,
                  max_blocks, tile, stride, scale, 0, tokens * kv_heads};
    int64_t work = tokens * kv_heads;
    if (threads > 16) threads = 16;
    if (threads <= 1 || work < 2 * threads) { run(&base); return 0; }
    job_t jobs[16];
    for (int64_t i = 0; i < threads; i++) {
        jobs[i] = base; jobs[i].begin = work * i / threads; jobs[i].end = work * (i + 1) / threads;
    }
    run_jobs(run, jobs, sizeof jobs[0], threads);
    return 0;
}
"""

# no fast-math, no contraction into FMA: the compiler may vectorize lanes, never reassociate or fuse
BASE_FLAGS = ("-O3", "-std=c11", "-fPIC", "-shared", "-ffp-contract=off", "-fno-fast-math", "-fno-math-errno",
              "-pthread")


class Unavailable(DetentError):
    """A C kernel (the attention, the fixed-order GEMM) cannot be built or loaded here."""

    exit_code = ExitCode.BAD_INPUT


def _arch_flags() -> tuple[str, ...]:
    """-mavx2 where the CPU runs AVX2 (torch's own probe); the bits are the same without it (tested)."""
    return ("-mavx2",) if torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512") else ()


def _cache_dir() -> Path:
    return Path(os.environ.get(ENV_CACHE) or Path.home() / ".cache" / "detent-audit" / "kernels")


def build(arch_flags: tuple[str, ...] | None = None, *, source: str = SOURCE,
          name: str = "attention") -> Path:
    """The shared library of `source` (this module's attention by default; the fixed-order GEMM's too) for
    these flags, compiled once per source and flags (atomically renamed into place)."""
    flags = BASE_FLAGS + (_arch_flags() if arch_flags is None else arch_flags)
    cc = os.environ.get(ENV_CC) or "cc"
    key = hashlib.sha256((source + "\0" + " ".join(flags) + "\0" + cc).encode()).hexdigest()[:16]
    lib = _cache_dir() / f"detent_{name}_{key}.so"
    if lib.is_file():
        return lib
    if shutil.which(cc) is None:
        raise Unavailable(f"no C compiler {cc!r} on PATH to build the C {name}",
                          remedy=f"install a C compiler (apt-get install gcc) or set {ENV_CC}")
    lib.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=lib.parent) as tmp:
        src, out = Path(tmp) / f"{name}.c", Path(tmp) / f"{name}.so"
        src.write_text(source)
        proc = subprocess.run([cc, *flags, str(src), "-o", str(out), "-lm"], capture_output=True, text=True)
        if proc.returncode:
            raise Unavailable(f"{cc} could not build the C {name}: {proc.stderr.strip()[-600:]}",
                              remedy=f"install gcc or clang, or set {ENV_CC}")
        os.replace(out, lib)
    return lib


_lock = threading.Lock()
_loaded: dict[tuple[str, tuple[str, ...] | None], ctypes.CDLL] = {}
# a C function's (return type, argument types) for ctypes
Signature = tuple[type | None, Sequence[type]]


def load(source: str, name: str, signatures: dict[str, Signature],
         arch_flags: tuple[str, ...] | None = None) -> ctypes.CDLL:
    """The library `build` makes of `source`, loaded once per name and flags, its functions typed."""
    with _lock:
        if (name, arch_flags) not in _loaded:
            lib = ctypes.CDLL(str(build(arch_flags, source=source, name=name)))
            for function, (restype, argtypes) in signatures.items():
                getattr(lib, function).restype = restype
                getattr(lib, function).argtypes = list(argtypes)
            _loaded[name, arch_flags] = lib
        return _loaded[name, arch_flags]


def library(arch_flags: tuple[str, ...] | None = None) -> ctypes.CDLL:
    args = [ctypes.c_void_p] * 7 + [ctypes.c_int64] * 8 + [ctypes.c_float, ctypes.c_int64]
    return load(SOURCE, "attention", {"detent_paged_attention": (ctypes.c_int, args)}, arch_flags)


def available() -> bool:
    try:
        library()
    except Unavailable:
        return False
    return True


@dataclass(frozen=True)
class TokenPositions:
    """Each query token's sequence and absolute position, and the int32 block tables: one batch's, the same
    for every layer of a step (an engine prepares them once per step)."""

    tok_seq: torch.Tensor
    tok_pos: torch.Tensor
    tables: torch.Tensor
    block_size: int


def token_positions(meta: AttentionMetadata, block_size: int) -> TokenPositions:
    q_lens = meta.cu_seqlens_q.diff()
    tokens = meta.num_tokens
    tok_seq = torch.repeat_interleave(torch.arange(q_lens.shape[0]), q_lens).contiguous()
    tok_pos = (meta.context_lens[tok_seq] + torch.arange(tokens) - meta.cu_seqlens_q[tok_seq]).to(torch.int64)
    if tokens and int(tok_pos.max()) >= meta.block_tables.shape[1] * block_size:
        raise BadInput("a query position lies past its block table")
    tables = meta.block_tables.to(torch.int32).contiguous()
    return TokenPositions(tok_seq, tok_pos.contiguous(), tables, block_size)


@torch.no_grad()
def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata, *,
                    scale: float, params: AttentionParams, threads: int | None = None,
                    arch_flags: tuple[str, ...] | None = None,
                    positions: TokenPositions | None = None) -> torch.Tensor:
    """Causal GQA attention of q: [T, Hq, D] fp32 over the paged fp32 caches [num_blocks, block_size, Hkv, D].

    Same arguments and meaning as `attention.paged_attention` with params; `threads` defaults to torch's;
    `positions`, `token_positions(meta, block_size)` computed once for all the layers of a step."""
    if q.dtype != torch.float32 or k_cache.dtype != torch.float32 or v_cache.dtype != torch.float32:
        raise BadInput("the C attention runs float32 q and caches only")
    if (q.dim() != 3 or k_cache.dim() != 4 or q.shape[-1] != k_cache.shape[-1]
            or k_cache.shape != v_cache.shape):
        raise BadInput(f"paged_attention: q {tuple(q.shape)} and cache {tuple(k_cache.shape)} do not match")
    tokens, q_heads, dim = q.shape
    kv_heads, block_size = k_cache.shape[2], k_cache.shape[1]
    if q_heads % kv_heads:
        raise BadInput(f"query heads {q_heads} are not a multiple of KV heads {kv_heads}")
    if tokens != meta.num_tokens:
        raise BadInput(f"q has {tokens} tokens, metadata {meta.num_tokens}")
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise BadInput("the C attention reads contiguous caches")
    out = torch.empty(tokens, q_heads, dim, dtype=torch.float32)
    if tokens == 0:
        return out
    q = q.contiguous()
    if positions is None:
        positions = token_positions(meta, block_size)
    elif positions.tok_seq.shape[0] != tokens or positions.block_size != block_size:
        raise BadInput("the token positions were prepared for another batch")
    tok_seq, tok_pos, tables = positions.tok_seq, positions.tok_pos, positions.tables
    rc = library(arch_flags).detent_paged_attention(
        q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), tables.data_ptr(), tok_seq.data_ptr(),
        tok_pos.data_ptr(), out.data_ptr(), tokens, q_heads, kv_heads, dim, block_size,
        tables.shape[1], params.kv_tile, params.split_stride, float(scale),
        torch.get_num_threads() if threads is None else threads)
    if rc:
        raise BadInput("the C attention takes at most 16 query heads per KV head, a head size that is a "
                       f"multiple of 8 up to 256 and tile 512, got {q_heads // kv_heads}, {dim}, "
                       f"{params.kv_tile}")
    return out
