"""Batch-invariant fused MoE on the GPU (Triton): routing, alignment, two grouped GEMMs, slot-ordered combine.

Five launches and a few torch integer ops, none reading a value back to the host (CUDA-graph capturable):
1. route: one program per row over its E logits (one block): fp32 softmax, top-k by k rounds of argmax
   with ties to the lowest expert id, optional renormalisation by the kept weights summed in slot order.
2. moe_align: the (row, slot) entries sorted by expert, each expert's group padded to a multiple of
   BLOCK_M; every array has its maximum size for M (never a data-dependent shape). One launch at decode
   sizes, torch integer ops above; either way the same layout, and a row's bits do not depend on its place
   in a block anyway (measured: benchmarks/gpu_moe.py, tests/kernels/test_gpu_moe.py).
3. grouped GEMM with w13: one program per (BLOCK_M block of one expert, BLOCK_N tile); the whole K in
   BLOCK_K chunks in order, fp32 accumulator, no split-K; padded entries masked.
4. silu_and_mul (rowlocal's rounding points: silu in fp32, cast, times up), then the grouped GEMM with w2.
5. combine: out[r] = sum over slots s in order of slot_out[r*k + s] (fp32) * weight[r, s], cast once.
Invariant: for a fixed TritonMoeConfig a row's bits depend only on its x row, its router logits and the
weights: each step is row-local or computes a row's dot products in an order the config fixes. Which
config fields change the bits is measured on the device (benchmarks/gpu_moe.py), not assumed; the detent
config therefore comes from the pinned selection, while `stock_config` reads the batch (vLLM's rule).

Importing this module needs Triton (it imports only torch and triton); the CPU path is kernels/moe.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
import triton
import triton.language as tl


@dataclass(frozen=True)
class TritonMoeConfig:
    """The expert GEMMs' tile. Defaults: vLLM's batch-invariant default ({64, 64, 32, G8}, Triton's 4/3)."""

    block_m: int = 64
    block_n: int = 64
    block_k: int = 32
    group_m: int = 8
    num_warps: int = 4
    num_stages: int = 3

    def __post_init__(self) -> None:
        for name in ("block_m", "block_n", "block_k"):
            value = getattr(self, name)
            if value < 16 or value & (value - 1):  # tl.dot needs >= 16 on every dimension
                raise ValueError(f"{name} must be a power of two >= 16, got {value}")
        if self.group_m < 1 or self.num_warps not in (1, 2, 4, 8, 16) or self.num_stages < 1:
            raise ValueError(f"bad group_m / num_warps / num_stages in {self}")


def stock_config(M: int, E: int, H: int, I: int, top_k: int) -> TritonMoeConfig:  # noqa: E741
    """vLLM's `get_default_config` for unquantized experts: {16, 32, 64, G1} when M <= E, else {64, 64, 32,
    G8}; warps and stages left to Triton (4, 3). It reads M, the batch: rows may change bits with it.
    H, I and top_k are in the signature as in vLLM's; its unquantized rule does not read them."""
    if M <= E:
        return TritonMoeConfig(16, 32, 64, 1, 4, 3)
    return TritonMoeConfig(64, 64, 32, 8, 4, 3)


class TritonRouting(NamedTuple):
    weights: torch.Tensor  # [M, k] fp32, slot order = descending probability, ties by lower expert id
    ids: torch.Tensor  # [M, k] int32 expert ids


class MoeAlignment(NamedTuple):
    sorted_entries: torch.Tensor  # [max_blocks * BLOCK_M] int32 entry r*k + s; padding = M*k (invalid)
    block_expert: torch.Tensor  # [max_blocks] int32 expert of each BLOCK_M block, -1 for unused blocks
    num_valid_blocks: torch.Tensor  # [1] int32 (stays on the device)


@triton.jit
def _route_kernel(logits_ptr, weights_ptr, ids_ptr, E, stride_lm, TOP_K: tl.constexpr,
                  BLOCK_E: tl.constexpr, BLOCK_SLOTS: tl.constexpr, RENORMALIZE: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_E)
    logits = tl.load(logits_ptr + row * stride_lm + offs, mask=offs < E, other=float("-inf")).to(tl.float32)
    num = tl.exp(logits - tl.max(logits, axis=0))  # padded lanes: exp(-inf) = 0
    probs = tl.where(offs < E, num / tl.sum(num, axis=0), -1.0)  # [BLOCK_E]; padded lanes never picked
    slots = tl.arange(0, BLOCK_SLOTS)
    kept = tl.zeros([BLOCK_SLOTS], dtype=tl.float32)
    kept_ids = tl.zeros([BLOCK_SLOTS], dtype=tl.int32)
    total = 0.0
    for s in tl.static_range(TOP_K):
        best = tl.argmax(probs, axis=0, tie_break_left=True)  # the lowest id among equal probabilities
        weight = tl.max(probs, axis=0)
        kept = tl.where(slots == s, weight, kept)
        kept_ids = tl.where(slots == s, best.to(tl.int32), kept_ids)
        total = total + weight  # the kept weights summed in slot order
        probs = tl.where(offs == best, -1.0, probs)
    if RENORMALIZE:
        kept = kept / total
    tl.store(weights_ptr + row * TOP_K + slots, kept, mask=slots < TOP_K)
    tl.store(ids_ptr + row * TOP_K + slots, kept_ids, mask=slots < TOP_K)


def route(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> TritonRouting:
    """router_logits: [M, E] (E <= 512) -> each row's top_k experts and fp32 weights (kernels/moe.route's
    rule)."""
    m, num_experts = router_logits.shape
    if not 1 <= top_k <= num_experts <= 512:
        raise ValueError(f"top_k={top_k} with {num_experts} experts (1 <= top_k <= E <= 512)")
    weights = torch.empty((m, top_k), device=router_logits.device, dtype=torch.float32)
    ids = torch.empty((m, top_k), device=router_logits.device, dtype=torch.int32)
    if m:
        _route_kernel[(m,)](router_logits, weights, ids, num_experts, router_logits.stride(0), TOP_K=top_k,
                            BLOCK_E=triton.next_power_of_2(num_experts),
                            BLOCK_SLOTS=triton.next_power_of_2(top_k), RENORMALIZE=renormalize)
    return TritonRouting(weights, ids)


def max_blocks(num_entries: int, num_experts: int, block_m: int) -> int:
    """BLOCK_M blocks that hold num_entries entries of at most num_experts experts, each group padded."""
    padded = min(num_entries + num_experts * (block_m - 1), num_entries * block_m)
    return triton.cdiv(padded, block_m)


ALIGN_KERNEL_MAX_ENTRIES = 256  # up to this many (row, slot) entries (decode batches) one launch aligns them


@triton.jit(do_not_specialize=["num_entries", "num_blocks"])
def _align_kernel(ids_ptr, sorted_ptr, block_expert_ptr, num_valid_ptr, scratch_ptr, num_entries, num_experts,
                  num_blocks, BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr, CHUNK: tl.constexpr,
                  NUM_CHUNKS: tl.constexpr):
    """One program aligns all entries (decode sizes): the same layout as the torch construction, in one
    launch instead of ~16 (at batch 1 the launches, not the work, set the MoE's time)."""
    offs_e = tl.arange(0, BLOCK_E)
    # (1) entries per expert, in chunks of CHUNK entries (one-hot sums)
    counts = tl.zeros([BLOCK_E], tl.int32)
    for c in range(NUM_CHUNKS):
        t = c * CHUNK + tl.arange(0, CHUNK)
        e = tl.load(ids_ptr + t, mask=t < num_entries, other=-1)
        counts += tl.sum((e[:, None] == offs_e[None, :]).to(tl.int32), axis=0)
    blocks = (counts + BLOCK_M - 1) // BLOCK_M
    block_end = tl.cumsum(blocks, axis=0)                       # [E] inclusive
    tl.store(scratch_ptr + offs_e, block_end - blocks, mask=offs_e < num_experts)  # each expert's first block
    total = tl.sum(blocks, axis=0)
    # (2) every slot padding first; then each entry at its expert's block start + its rank in the group
    for b0 in range(0, num_blocks * BLOCK_M, CHUNK):
        slots = b0 + tl.arange(0, CHUNK)
        tl.store(sorted_ptr + slots, num_entries + tl.zeros([CHUNK], tl.int32),
                 mask=slots < num_blocks * BLOCK_M)
    tl.debug_barrier()
    for c in range(NUM_CHUNKS):
        t = c * CHUNK + tl.arange(0, CHUNK)
        ok = t < num_entries
        e = tl.load(ids_ptr + t, mask=ok, other=-1)
        rank = tl.zeros([CHUNK], tl.int32)                      # earlier entries of the same expert
        for c2 in range(NUM_CHUNKS):
            t2 = c2 * CHUNK + tl.arange(0, CHUNK)
            e2 = tl.load(ids_ptr + t2, mask=t2 < num_entries, other=-2)
            rank += tl.sum(((e[:, None] == e2[None, :]) & (t2[None, :] < t[:, None])).to(tl.int32), axis=1)
        start = tl.load(scratch_ptr + e, mask=ok, other=0)
        tl.store(sorted_ptr + start * BLOCK_M + rank, t, mask=ok)
    # (3) each block's expert: the experts whose blocks end at or before it, -1 past the last
    for b0 in range(0, num_blocks, CHUNK):
        b = b0 + tl.arange(0, CHUNK)
        ends = tl.where(offs_e < num_experts, block_end, 1 << 30)
        owner = tl.sum((ends[None, :] <= b[:, None]).to(tl.int32), axis=1)
        tl.store(block_expert_ptr + b, tl.where(b < total, owner, -1), mask=b < num_blocks)
    tl.store(num_valid_ptr + tl.arange(0, 1), total + tl.zeros([1], tl.int32))


def moe_align(ids: torch.Tensor, num_experts: int, block_m: int) -> MoeAlignment:
    """ids: [M, k] int32 -> the entries grouped by expert (rows ascending within a group), each group padded
    to a multiple of block_m. No host synchronisation, shapes set by M: one Triton launch for up to
    ALIGN_KERNEL_MAX_ENTRIES entries, torch integer ops above (the same layout; integers are exact)."""
    num_entries = ids.numel()
    if 0 < num_entries <= ALIGN_KERNEL_MAX_ENTRIES and num_experts <= 512:
        return _align_small(ids, num_experts, block_m)
    return _align_torch(ids, num_experts, block_m)


def _align_small(ids: torch.Tensor, num_experts: int, block_m: int) -> MoeAlignment:
    num_entries = ids.numel()
    dev = ids.device
    blocks = max_blocks(num_entries, num_experts, block_m)
    sorted_entries = torch.empty((blocks * block_m,), device=dev, dtype=torch.int32)
    block_expert = torch.empty((blocks,), device=dev, dtype=torch.int32)
    num_valid = torch.empty((1,), device=dev, dtype=torch.int32)
    scratch = torch.empty((num_experts,), device=dev, dtype=torch.int32)
    chunk = 32
    _align_kernel[(1,)](ids.reshape(-1).to(torch.int32), sorted_entries, block_expert, num_valid, scratch,
                        num_entries, num_experts, blocks, BLOCK_M=block_m,
                        BLOCK_E=triton.next_power_of_2(num_experts), CHUNK=chunk,
                        NUM_CHUNKS=triton.cdiv(num_entries, chunk), num_warps=4)
    return MoeAlignment(sorted_entries, block_expert, num_valid)


def _align_torch(ids: torch.Tensor, num_experts: int, block_m: int) -> MoeAlignment:
    num_entries = ids.numel()
    dev = ids.device
    blocks = max_blocks(num_entries, num_experts, block_m)
    flat = ids.reshape(-1).to(torch.int32)  # [T], entry r*k + s is row r's slot s
    sorted_experts, order = torch.sort(flat, stable=True)  # [T], [T]
    experts = torch.arange(num_experts + 1, device=dev, dtype=torch.int32)
    bounds = torch.searchsorted(sorted_experts, experts).to(torch.int32)  # [E+1] group starts in `order`
    counts = bounds[1:] - bounds[:-1]  # [E]
    expert_blocks = (counts + block_m - 1) // block_m  # [E] BLOCK_M blocks of each expert
    block_end = torch.cumsum(expert_blocks, 0).to(torch.int32)  # [E] inclusive
    block_start = block_end - expert_blocks  # [E]
    rank = torch.arange(num_entries, device=dev, dtype=torch.int32) - bounds[sorted_experts.long()]  # [T]
    dest = block_start[sorted_experts.long()] * block_m + rank  # [T] slot in the padded layout
    sorted_entries = torch.full((blocks * block_m,), num_entries, device=dev, dtype=torch.int32)
    sorted_entries.scatter_(0, dest.long(), order.to(torch.int32))
    block_ids = torch.arange(blocks, device=dev, dtype=torch.int32)  # [max_blocks]
    num_valid = block_end[-1:]  # [1]
    owner = torch.searchsorted(block_end, block_ids, right=True).to(torch.int32)  # first e with end > b
    block_expert = torch.where(block_ids < num_valid, owner, torch.full_like(owner, -1))
    return MoeAlignment(sorted_entries, block_expert, num_valid)


@triton.jit(do_not_specialize=["num_entries", "num_blocks"])  # per-call counts: no compile per value class
def _grouped_gemm_kernel(a_ptr, w_ptr, c_ptr, entries_ptr, block_expert_ptr, num_entries, num_blocks, row_div,
                         stride_am, stride_ak, stride_we, stride_wn, stride_wk, stride_cm, stride_cn,
                         N: tl.constexpr, K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                         BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
    pid = tl.program_id(0)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    # grouped ordering of tiles (L2 reuse): it changes which program computes a tile, not how
    num_in_group = GROUP_M * num_pid_n
    first_m = (pid // num_in_group) * GROUP_M
    group_size_m = min(num_blocks - first_m, GROUP_M)
    pid_m = first_m + (pid % num_in_group) % group_size_m
    pid_n = (pid % num_in_group) // group_size_m
    expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    if expert < 0:  # a block past the valid ones
        return
    entries = tl.load(entries_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))  # [BLOCK_M]
    valid = entries < num_entries
    a_rows = (entries // row_div).to(tl.int64)  # [BLOCK_M] the A row of each entry
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    w_base = w_ptr + expert * stride_we
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):  # the whole K, in order: no split-K
        offs_k = k0 + tl.arange(0, BLOCK_K)
        a = tl.load(a_ptr + a_rows[:, None] * stride_am + offs_k[None, :] * stride_ak,
                    mask=valid[:, None] & (offs_k[None, :] < K), other=0.0)  # [BLOCK_M, BLOCK_K]
        b = tl.load(w_base + offs_k[:, None] * stride_wk + offs_n[None, :] * stride_wn,
                    mask=(offs_k[:, None] < K) & (offs_n[None, :] < N), other=0.0)  # [BLOCK_K, BLOCK_N]
        acc = tl.dot(a, b, acc)  # bf16 operands, fp32 accumulator (fp32 operands: Triton's default TF32)
    c_rows = entries.to(tl.int64)
    tl.store(c_ptr + c_rows[:, None] * stride_cm + offs_n[None, :] * stride_cn,
             acc.to(c_ptr.dtype.element_ty), mask=valid[:, None] & (offs_n[None, :] < N))


def grouped_gemm(a: torch.Tensor, w: torch.Tensor, align: MoeAlignment, num_entries: int, row_div: int,
                 config: TritonMoeConfig) -> torch.Tensor:
    """out[e] = a[e // row_div] @ w[expert of e].T for every entry e. a: [rows, K], w: [E, N, K] ->
    [num_entries, N] in a's dtype; a row is computed over the whole K in config.block_k chunks, in order."""
    n, k = w.shape[1], w.shape[2]
    out = torch.empty((num_entries, n), device=a.device, dtype=a.dtype)
    num_blocks = align.block_expert.numel()
    grid = (num_blocks * triton.cdiv(n, config.block_n),)
    _grouped_gemm_kernel[grid](
        a, w, out, align.sorted_entries, align.block_expert, num_entries, num_blocks, row_div,
        a.stride(0), a.stride(1), w.stride(0), w.stride(1), w.stride(2), out.stride(0), out.stride(1),
        N=n, K=k, BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
                               GROUP_M=config.group_m,
        num_warps=config.num_warps, num_stages=config.num_stages)
    return out


@triton.jit
def _silu_and_mul_kernel(h_ptr, out_ptr, inter, stride_h, stride_o, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < inter
    g = tl.load(h_ptr + row * stride_h + offs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(h_ptr + row * stride_h + inter + offs, mask=mask, other=0.0).to(tl.float32)
    act = (g / (1.0 + tl.exp(-g))).to(out_ptr.dtype.element_ty)  # silu in fp32, cast to x's dtype
    # act * up in x's dtype: the fp32 product of two bf16 values is exact, so one rounding to bf16 gives
    # the correctly rounded bf16 product (what torch computes); written in fp32 for the interpreter too
    product = (act.to(tl.float32) * up).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + row * stride_o + offs, product, mask=mask)


def silu_and_mul(hidden: torch.Tensor) -> torch.Tensor:
    """hidden: [T, 2I] (gate then up) -> silu(gate) * up: [T, I] in hidden's dtype (rowlocal's rounding)."""
    rows, inter = hidden.shape[0], hidden.shape[1] // 2
    out = torch.empty((rows, inter), device=hidden.device, dtype=hidden.dtype)
    block = min(1024, triton.next_power_of_2(inter))
    _silu_and_mul_kernel[(rows, triton.cdiv(inter, block))](hidden, out, inter, hidden.stride(0),
                                                            out.stride(0), BLOCK=block)
    return out


@triton.jit
def _combine_kernel(slot_ptr, w_ptr, out_ptr, H, TOP_K: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < H
    total = tl.load(slot_ptr + row * TOP_K * H + offs, mask=mask, other=0.0).to(tl.float32) \
        * tl.load(w_ptr + row * TOP_K)
    # slot order, slot 0 first; the compiler may contract a multiply-add into one FMA: fixed per element
    # (row-local), though not the CPU's two roundings
    for s in tl.static_range(1, TOP_K):
        part = tl.load(slot_ptr + (row * TOP_K + s) * H + offs, mask=mask, other=0.0).to(tl.float32)
        total = total + part * tl.load(w_ptr + row * TOP_K + s)
    tl.store(out_ptr + row * H + offs, total.to(out_ptr.dtype.element_ty), mask=mask)


def combine(slot_out: torch.Tensor, weights: torch.Tensor, top_k: int) -> torch.Tensor:
    """slot_out: [M*k, H] (row r slot s at r*k + s), weights: [M, k] fp32 -> [M, H] in slot_out's dtype."""
    rows, hidden = weights.shape[0], slot_out.shape[1]
    out = torch.empty((rows, hidden), device=slot_out.device, dtype=slot_out.dtype)
    block = min(1024, triton.next_power_of_2(hidden))
    grid = (rows, triton.cdiv(hidden, block))
    _combine_kernel[grid](slot_out, weights, out, hidden, TOP_K=top_k, BLOCK=block)
    return out


@torch.no_grad()
def fused_moe(x: torch.Tensor, router_logits: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, top_k: int,
              renormalize: bool, config: TritonMoeConfig) -> torch.Tensor:
    """x: [M, H], router_logits: [M, E], w13: [E, 2I, H] (gate rows then up rows), w2: [E, H, I] -> [M, H]
    in x's dtype. For a fixed config, row i depends only on x[i], router_logits[i] and the weights. No host
    synchronisation (capturable in a CUDA graph); shape errors raise ValueError before any launch."""
    tokens, hidden = x.shape
    num_experts, two_inter, _ = w13.shape
    if (router_logits.shape != (tokens, num_experts) or w13.shape[2] != hidden
            or w2.shape != (num_experts, hidden, two_inter // 2) or two_inter % 2):
        raise ValueError(f"shapes x {tuple(x.shape)}, logits {tuple(router_logits.shape)}, "
                         f"w13 {tuple(w13.shape)}, w2 {tuple(w2.shape)} "
                         "do not fit [M,H],[M,E],[E,2I,H],[E,H,I]")
    if tokens == 0:
        return x.new_empty((0, hidden))
    x = x.contiguous()
    w13, w2 = w13.contiguous(), w2.contiguous()
    routing = route(router_logits, top_k, renormalize)  # [M, k], [M, k]
    align = moe_align(routing.ids, num_experts, config.block_m)
    num_entries = tokens * top_k
    inter = grouped_gemm(x, w13, align, num_entries, top_k, config)  # [M*k, 2I]: entry e reads x[e // k]
    act = silu_and_mul(inter)  # [M*k, I]
    slot_out = grouped_gemm(act, w2, align, num_entries, 1, config)  # [M*k, H]
    return combine(slot_out, routing.weights, top_k)  # [M, H]
