"""Row-local ops on the GPU as single Triton launches: RMSNorm (with the residual add fused), SiLU-and-mul,
and the attention prologue (split qkv, Qwen3's per-head norm, RoPE, K/V into the paged cache).

Batch-invariant by construction: one program owns one row (one token, or one head of one token) and reduces
it in a block whose size is set by the row's width alone, so no row's bits depend on how many rows the launch
has or where the row sits. Rounding points are HF's (math in fp32, the normalised row cast to the model's
dtype before the weight multiply; silu in fp32 cast before the multiply by up). The compiler may contract a
multiply and an add into one FMA, which changes bits against torch's kernels but never across batches: the
GPU tier's bits are compared only with themselves (the battery), and with fp32 references within a tolerance.

Why one launch each: a decode step of a 32-layer model made of torch's composed ops runs ~50 kernels a layer,
and at batch 1 their launch gaps, not the weights, set the step time (measured: benchmarks/gpu_engine.py).
Importing this module needs Triton (GPU machines); the CPU path is kernels/rowlocal.py.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm(x_ptr, r_ptr, w_ptr, out_ptr, sum_ptr, n, eps, HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    ok = offs < n
    x = tl.load(x_ptr + row * n + offs, mask=ok, other=0.0)
    # s = x + residual in the model's dtype (HF's `h = h + attn(...)`), stored for the next add
    if HAS_RESIDUAL:
        x = x + tl.load(r_ptr + row * n + offs, mask=ok, other=0.0)
        tl.store(sum_ptr + row * n + offs, x, mask=ok)
    xf = x.to(tl.float32)
    var = tl.sum(xf * xf, axis=0) / n
    normed = (xf * tl.rsqrt(var + eps)).to(x_ptr.dtype.element_ty)
    w = tl.load(w_ptr + offs, mask=ok, other=0.0)
    tl.store(out_ptr + row * n + offs, w * normed, mask=ok)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x: [M, N] -> [M, N] in x's dtype."""
    x = x.contiguous()
    out = torch.empty_like(x)
    if x.shape[0]:
        _rms_norm[(x.shape[0],)](x, x, weight, out, out, x.shape[1], eps, HAS_RESIDUAL=False,
                                 BLOCK=triton.next_power_of_2(x.shape[1]), num_warps=_warps(x.shape[1]))
    return out


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual); x, residual: [M, N] in one dtype."""
    x, residual = x.contiguous(), residual.contiguous()
    out, total = torch.empty_like(x), torch.empty_like(x)
    if x.shape[0]:
        _rms_norm[(x.shape[0],)](x, residual, weight, out, total, x.shape[1], eps, HAS_RESIDUAL=True,
                                 BLOCK=triton.next_power_of_2(x.shape[1]), num_warps=_warps(x.shape[1]))
    return out, total


@triton.jit
def _silu_and_mul(x_ptr, out_ptr, inter, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < inter
    g = tl.load(x_ptr + row * 2 * inter + offs, mask=ok, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * 2 * inter + inter + offs, mask=ok, other=0.0)
    act = (g / (1.0 + tl.exp(-g))).to(up.dtype)
    tl.store(out_ptr + row * inter + offs, act * up, mask=ok)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x: [M, 2I] (gate then up) -> [M, I]: silu(gate) (fp32, cast) * up."""
    x = x.contiguous()
    inter = x.shape[-1] // 2
    out = x.new_empty(*x.shape[:-1], inter)
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    if rows:
        block = min(1024, triton.next_power_of_2(inter))
        _silu_and_mul[(rows, triton.cdiv(inter, block))](x, out, inter, BLOCK=block, num_warps=4)
    return out


@triton.jit
def _qkv_prologue(qkv_ptr, pos_ptr, cos_ptr, sin_ptr, qw_ptr, kw_ptr, slot_ptr, q_ptr, kc_ptr, vc_ptr, eps,
                  H: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, HAS_NORM: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    j = tl.program_id(1)                       # head: q heads, then k heads, then v heads
    half = tl.arange(0, D // 2)
    base = qkv_ptr + t * (H + 2 * HKV) * D + j * D
    x1 = tl.load(base + half)
    x2 = tl.load(base + D // 2 + half)
    slot = tl.load(slot_ptr + t)
    if j >= H + HKV:                           # v: stored as it is
        hv = j - H - HKV
        dst = vc_ptr + (slot * HKV + hv) * D
        tl.store(dst + half, x1)
        tl.store(dst + D // 2 + half, x2)
        return
    if HAS_NORM:                               # Qwen3: RMSNorm over the head, before RoPE
        f1, f2 = x1.to(tl.float32), x2.to(tl.float32)
        var = (tl.sum(f1 * f1, axis=0) + tl.sum(f2 * f2, axis=0)) / D
        inv = tl.rsqrt(var + eps)
        w_ptr = qw_ptr if j < H else kw_ptr
        x1 = tl.load(w_ptr + half) * (f1 * inv).to(x1.dtype)
        x2 = tl.load(w_ptr + D // 2 + half) * (f2 * inv).to(x2.dtype)
    p = tl.load(pos_ptr + t)
    cos = tl.load(cos_ptr + p * D + half)      # the table's two halves are equal (frequencies repeated)
    sin = tl.load(sin_ptr + p * D + half)
    f1, f2 = x1.to(tl.float32), x2.to(tl.float32)
    o1 = (f1 * cos - f2 * sin).to(x1.dtype)
    o2 = (f2 * cos + f1 * sin).to(x1.dtype)
    if j < H:
        dst = q_ptr + (t * H + j) * D
    else:
        dst = kc_ptr + (slot * HKV + (j - H)) * D
    tl.store(dst + half, o1)
    tl.store(dst + D // 2 + half, o2)


def qkv_prologue(qkv: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 heads: tuple[int, int, int], k_cache: torch.Tensor, v_cache: torch.Tensor,
                 slot_mapping: torch.Tensor, q_norm: torch.Tensor | None, k_norm: torch.Tensor | None,
                 eps: float) -> torch.Tensor:
    """qkv: [T, (H + 2 HKV) D] -> q: [T, H, D] rotated; k (normed, rotated) and v written into the caches
    [blocks, page, HKV, D] at slot_mapping [T] (no negative slots). cos/sin: [positions, D] fp32."""
    h, hkv, d = heads
    if d & (d - 1):
        raise ValueError(f"head_dim {d} must be a power of two for the Triton prologue")
    t = qkv.shape[0]
    q = qkv.new_empty(t, h, d)
    if t:
        _qkv_prologue[(t, h + 2 * hkv)](
            qkv.contiguous(), positions, cos, sin, q_norm if q_norm is not None else qkv,
            k_norm if k_norm is not None else qkv, slot_mapping, q, k_cache, v_cache, eps,
            H=h, HKV=hkv, D=d, HAS_NORM=q_norm is not None, num_warps=1 if d <= 128 else 2)
    return q


def _warps(n: int) -> int:
    return 1 if n <= 512 else 4 if n <= 4096 else 8
