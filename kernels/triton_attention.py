"""Batch-invariant paged attention on the GPU (Triton): prefill chunks and decode tokens in one varlen launch.

A program owns one KV head, one split and a tile of BLOCK_M packed rows: BLOCK_M // G query rows of one
sequence times the G query heads that share the KV head (GQA packing: each KV tile is read once for the G
heads; decode fills G of the rows). KV is read in tiles of BLOCK_N positions aligned to absolute positions,
split at multiples of SPLIT (a pinned stride, aligned to absolute positions); each program runs an fp32
online softmax (base 2, the scale folded into one FMA per score; tiles every row sees whole skip the masks)
and writes an unnormalised partial; a second kernel combines the partials of each row in
split order (with one split the first kernel normalises directly, which gives the same bits). A row's
scores come from a matrix-unit dot whose rows are independent (the same tile shape in prefill and decode),
fully masked tiles and empty splits are exact no-ops, so a token's output bits depend only on its own
query, its sequence's KV and its absolute position: prefill, chunked prefill, a prefix-cache hit and decode
give it the same bits.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl


@dataclass(frozen=True)
class TritonAttentionConfig:
    block_m: int = 64      # query rows per program (decode pads one row to this)
    block_n: int = 64      # KV positions per online-softmax step
    split: int = 2048      # KV positions per split (a multiple of block_n); the pinned split stride
    num_warps: int = 4
    num_stages: int = 2
    # streaming mode (a deployment fact, off unless asked for: --attention-streaming; the H200 serving figures
    # of RESULTS.md use it): splits folded one after another with explicit FMAs, in one program per
    # tile when the launch has programs enough (prefill: no partials in memory), else in
    # parallel programs and a streaming combine; the two give a row the same bits, so the choice per launch
    # is harmless, and small split strides stop costing prefill (the tuner can pick them for decode)
    streaming: bool = False


@triton.jit
def _tile_rows(q_ptr, tile_seq_ptr, tile_row_ptr, tile_len_ptr, cu_ptr, ctx_ptr, tile, hk,
               H: tl.constexpr, D: tl.constexpr, G: tl.constexpr, BLOCK_M: tl.constexpr,
               DECODE: tl.constexpr):
    """A tile's packed rows: row j = (query row j // G, head hk * G + j % G); their queries and positions,
    and the positions of the tile's first and last query rows. DECODE: a launch of one query row per
    sequence, so tile, sequence and row are one index (the same values without reading them: the query and
    the block table are read at once, not after the tile's lookups)."""
    if DECODE:
        s = tile
        row0 = tile
        n_rows = 1
        seq_row0 = tile
    else:
        s = tl.load(tile_seq_ptr + tile)
        row0 = tl.load(tile_row_ptr + tile)      # first query row of this tile (global row index)
        n_rows = tl.load(tile_len_ptr + tile)    # at most BLOCK_M // G query rows
        seq_row0 = tl.load(cu_ptr + s)
    ctx = tl.load(ctx_ptr + s)               # absolute position of the sequence's first query row
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, D)
    qi = offs_m // G
    heads = hk * G + offs_m % G
    row_ok = qi < n_rows
    rows = row0 + qi
    pos = ctx + (rows - seq_row0)            # [BLOCK_M] absolute positions
    min_pos = ctx + (row0 - seq_row0)
    max_pos = min_pos + n_rows - 1
    q = tl.load(q_ptr + (rows[:, None] * H + heads[:, None]) * D + offs_d[None, :], mask=row_ok[:, None],
                other=0.0)
    return s, rows, heads, pos, row_ok, min_pos, max_pos, q


@triton.jit
def _block_ids(bt_ptr, s, stride_bt, page_size, max_pos, kv0, BLOCK_N: tl.constexpr):
    """The cache block of each KV position of the tile at kv0, read within the sequence's table row (an id
    past the sequence's last position is never used: its K/V loads are masked), so the read waits on no
    position."""
    kv = kv0 + tl.arange(0, BLOCK_N)
    return tl.load(bt_ptr + s * stride_bt + kv // page_size, mask=kv // page_size < stride_bt, other=0)


@triton.jit
def _kv_step(q, k_ptr, v_ptr, blk, page_size, hk, pos, row_ok, max_pos, kv0, m_i, l_i, acc, qk_scale,
             HKV: tl.constexpr, D: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr):
    """One online-softmax step over KV [kv0, kv0 + BLOCK_N), whose cache blocks are `blk`. State in the log2
    domain: m is a row's running maximum of score * qk_scale (qk_scale = softmax scale * log2 e), and
    p = exp2(fma(score, qk_scale, -m)). MASKED is the diagonal / last tile's path (causal and range masks);
    an unmasked step is the masked one with every mask true, the same operations on the same values, so
    which path a tile takes (it depends on the tile's other rows) never changes a row's bits."""
    offs_d = tl.arange(0, D)
    kv = kv0 + tl.arange(0, BLOCK_N)
    slot = (blk.to(tl.int64) * page_size + kv % page_size) * HKV + hk
    if MASKED:
        kv_ok = kv <= max_pos
        k = tl.load(k_ptr + slot[:, None] * D + offs_d[None, :], mask=kv_ok[:, None], other=0.0)
        v = tl.load(v_ptr + slot[:, None] * D + offs_d[None, :], mask=kv_ok[:, None], other=0.0)
    else:
        k = tl.load(k_ptr + slot[:, None] * D + offs_d[None, :])
        v = tl.load(v_ptr + slot[:, None] * D + offs_d[None, :])
    scores = tl.dot(q, tl.trans(k))                                      # [BLOCK_M, BLOCK_N] fp32
    if MASKED:
        allowed = (kv[None, :] <= pos[:, None]) & row_ok[:, None]
        scores = tl.where(allowed, scores, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(scores, 1) * qk_scale)
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)               # a row with nothing yet
    p = tl.math.exp2(tl.fma(scores, qk_scale, -m_safe[:, None]))
    alpha = tl.math.exp2(m_i - m_safe)
    l_i = tl.fma(l_i, alpha, tl.sum(p, 1))
    acc = acc * alpha[:, None]
    acc = tl.dot(p.to(v.dtype), v, acc)
    return m_new, l_i, acc


@triton.jit
def _empty_state(BLOCK_M: tl.constexpr, D: tl.constexpr):
    """The online softmax's state before any KV: (m, l, acc) = (-inf, 0, 0) per row."""
    return (tl.full([BLOCK_M], float("-inf"), tl.float32), tl.zeros([BLOCK_M], tl.float32),
            tl.zeros([BLOCK_M, D], tl.float32))


@triton.jit
def _split_partial(q, k_ptr, v_ptr, bt_ptr, s, stride_bt, page_size, hk, pos, row_ok, min_pos, max_pos, start,
                   end, qk_scale, HKV: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr,
                   BLOCK_N: tl.constexpr):
    """One split's unnormalised partial (m, l, acc) of each packed row over KV [start, end), an fp32 online
    softmax in BLOCK_N tiles aligned to absolute positions, in order: first the tiles every row of the tile
    sees whole (no masks), then the diagonal and last tiles (masked). Each step loads the next tile's block
    ids, so a tile's K/V addresses never wait on a block-table read."""
    m_i, l_i, acc = _empty_state(BLOCK_M, D)
    full_end = tl.maximum(start, tl.minimum(end, (min_pos + 1) // BLOCK_N * BLOCK_N))
    blk = _block_ids(bt_ptr, s, stride_bt, page_size, max_pos, start, BLOCK_N)
    for kv0 in range(start, full_end, BLOCK_N):
        nxt = _block_ids(bt_ptr, s, stride_bt, page_size, max_pos, kv0 + BLOCK_N, BLOCK_N)
        m_i, l_i, acc = _kv_step(q, k_ptr, v_ptr, blk, page_size, hk, pos, row_ok, max_pos, kv0, m_i, l_i,
                                 acc, qk_scale, HKV, D, BLOCK_N, False)
        blk = nxt
    for kv0 in range(full_end, end, BLOCK_N):
        nxt = _block_ids(bt_ptr, s, stride_bt, page_size, max_pos, kv0 + BLOCK_N, BLOCK_N)
        m_i, l_i, acc = _kv_step(q, k_ptr, v_ptr, blk, page_size, hk, pos, row_ok, max_pos, kv0, m_i, l_i,
                                 acc, qk_scale, HKV, D, BLOCK_N, True)
        blk = nxt
    return m_i, l_i, acc


@triton.jit
def _fold(M, L, ACC, m, lsum, acc):
    """Fold the next split's partial into the running (M, L, ACC), in split order. Explicit FMAs: every
    kernel that folds (the streaming combine, the in-program fold) rounds alike. An empty split (m = -inf,
    l = 0, acc = 0) is an exact no-op; split 0 is never empty for a real row (it holds position 0)."""
    m_new = tl.maximum(M, m)
    a = tl.math.exp2(M - m_new)
    b = tl.math.exp2(m - m_new)
    return m_new, tl.fma(L, a, lsum * b), tl.fma(ACC, a[:, None], acc * b[:, None])


# Integer arguments that change from step to step (block-table width, row count, split stride and count) are
# not specialised on their values: Triton would compile a variant for 1 and one for multiples of 16, and a
# compile in the middle of serving stalls every request in flight. The page size is a compile-time constant.
@triton.jit(do_not_specialize=["stride_bt", "num_rows", "SPLIT"])
def _attn_partial(q_ptr, k_ptr, v_ptr, bt_ptr, tile_seq_ptr, tile_row_ptr, tile_len_ptr, cu_ptr, ctx_ptr,
                  o_ptr, m_ptr, l_ptr, n_ptr, out_ptr, qk_scale, stride_bt, num_rows, SPLIT,
                  PAGE: tl.constexpr, H: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, G: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DIRECT: tl.constexpr,
                  DECODE: tl.constexpr):
    tile = tl.num_programs(0) - 1 - tl.program_id(0)   # a sequence's last (longest) tiles start first
    hk = tl.program_id(1)                    # one KV head; its G query heads are packed into the tile's rows
    sp = tl.program_id(2)
    start = sp * SPLIT
    s, rows, heads, pos, row_ok, min_pos, max_pos, q = _tile_rows(
        q_ptr, tile_seq_ptr, tile_row_ptr, tile_len_ptr, cu_ptr, ctx_ptr, tile, hk, H, D, G, BLOCK_M, DECODE)
    offs_d = tl.arange(0, D)
    if DIRECT:
        # one split: the combine of one partial is num / den with weight exp(0) = 1, so normalising here
        # gives the combine's bits (an empty split in a longer step adds exact zeros to both)
        m_i, l_i, acc = _split_partial(q, k_ptr, v_ptr, bt_ptr, s, stride_bt, PAGE, hk, pos, row_ok, min_pos,
                                       max_pos, start, tl.minimum(start + SPLIT, max_pos + 1), qk_scale, HKV,
                                       D, BLOCK_M, BLOCK_N)
        out = (rows * H + heads)[:, None] * D + offs_d[None, :]
        tl.store(out_ptr + out, (acc / l_i[:, None]).to(out_ptr.dtype.element_ty), mask=row_ok[:, None])
    else:
        if (sp == 0) & (hk == 0):  # each row's split count: the combine reads no split past its position
            tl.store(n_ptr + rows, pos // SPLIT + 1, mask=row_ok)
        if start <= max_pos:  # a split past every row of the tile is written by no one and read by no one
            m_i, l_i, acc = _split_partial(q, k_ptr, v_ptr, bt_ptr, s, stride_bt, PAGE, hk, pos, row_ok,
                                           min_pos, max_pos, start, tl.minimum(start + SPLIT, max_pos + 1),
                                           qk_scale, HKV, D, BLOCK_M, BLOCK_N)
            # a row of the tile whose position is before this split stores the empty partial (0, -inf, 0)
            # here, which its combine does not read
            out = (sp * num_rows + rows) * H + heads
            tl.store(o_ptr + out[:, None] * D + offs_d[None, :], acc, mask=row_ok[:, None])
            tl.store(m_ptr + out, m_i, mask=row_ok)
            tl.store(l_ptr + out, l_i, mask=row_ok)


@triton.jit(do_not_specialize=["stride_bt", "SPLIT"])
def _attn_folded(q_ptr, k_ptr, v_ptr, bt_ptr, tile_seq_ptr, tile_row_ptr, tile_len_ptr, cu_ptr, ctx_ptr,
                 out_ptr, qk_scale, stride_bt, SPLIT, PAGE: tl.constexpr, H: tl.constexpr, HKV: tl.constexpr,
                 D: tl.constexpr, G: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 DECODE: tl.constexpr):
    """Streaming mode, one program per (tile, KV head) over all its splits: each split's partial computed as
    `_attn_partial` computes it, folded in split order as `_attn_split_fold` folds the stored partials.
    No partials in memory, no second launch: for tiles with many query rows (prefill)."""
    tile = tl.num_programs(0) - 1 - tl.program_id(0)
    hk = tl.program_id(1)
    s, rows, heads, pos, row_ok, min_pos, max_pos, q = _tile_rows(
        q_ptr, tile_seq_ptr, tile_row_ptr, tile_len_ptr, cu_ptr, ctx_ptr, tile, hk, H, D, G, BLOCK_M, DECODE)
    M, L, ACC = _split_partial(q, k_ptr, v_ptr, bt_ptr, s, stride_bt, PAGE, hk, pos, row_ok, min_pos, max_pos,
                               0, tl.minimum(SPLIT, max_pos + 1), qk_scale, HKV, D, BLOCK_M, BLOCK_N)
    for start in range(SPLIT, max_pos + 1, SPLIT):
        m, l_, acc = _split_partial(q, k_ptr, v_ptr, bt_ptr, s, stride_bt, PAGE, hk, pos, row_ok, min_pos,
                                    max_pos, start, tl.minimum(start + SPLIT, max_pos + 1), qk_scale, HKV, D,
                                    BLOCK_M, BLOCK_N)
        M, L, ACC = _fold(M, L, ACC, m, l_, acc)
    offs_d = tl.arange(0, D)
    out = (rows * H + heads)[:, None] * D + offs_d[None, :]
    tl.store(out_ptr + out, (ACC / L[:, None]).to(out_ptr.dtype.element_ty), mask=row_ok[:, None])


@triton.jit
def _one_pass_step(q, k_ptr, v_ptr, bt_ptr, s, stride_bt, hk, pos, row_ok, max_pos, kv0, SPLIT, M, L, ACC,
                   m_i, l_i, acc, blk, qk_scale, PAGE: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr):
    """One tile of the one-pass fold: where a split ends, fold its partial into (M, L, ACC) and start the next
    from the empty state; then the tile's step, with the next tile's block ids loaded ahead."""
    if (kv0 > 0) & (kv0 % SPLIT == 0):
        M, L, ACC = _fold(M, L, ACC, m_i, l_i, acc)
        m_i, l_i, acc = _empty_state(BLOCK_M, D)
    nxt = _block_ids(bt_ptr, s, stride_bt, PAGE, max_pos, kv0 + BLOCK_N, BLOCK_N)
    m_i, l_i, acc = _kv_step(q, k_ptr, v_ptr, blk, PAGE, hk, pos, row_ok, max_pos, kv0, m_i, l_i, acc,
                             qk_scale, HKV, D, BLOCK_N, MASKED)
    return M, L, ACC, m_i, l_i, acc, nxt


@triton.jit(do_not_specialize=["stride_bt", "SPLIT"])
def _attn_folded_one_pass(q_ptr, k_ptr, v_ptr, bt_ptr, tile_seq_ptr, tile_row_ptr, tile_len_ptr, cu_ptr,
                          ctx_ptr, out_ptr, qk_scale, stride_bt, SPLIT, PAGE: tl.constexpr, H: tl.constexpr,
                          HKV: tl.constexpr, D: tl.constexpr, G: tl.constexpr, BLOCK_M: tl.constexpr,
                          BLOCK_N: tl.constexpr, DECODE: tl.constexpr):
    """`_attn_folded` in one pass over the KV tiles: the same steps in the same order (each split's partial
    from a fresh state, the unmasked and masked paths as `_split_partial` assigns them) and the same folds,
    done where a split ends instead of by a loop per split, so the software pipeline is not restarted at
    every split boundary. Folding split 0 into the empty state (-inf, 0, 0) is exact (weights exp2(-inf) = 0
    and exp2(0) = 1), so a row gets `_attn_folded`'s bits."""
    tile = tl.num_programs(0) - 1 - tl.program_id(0)
    hk = tl.program_id(1)
    s, rows, heads, pos, row_ok, min_pos, max_pos, q = _tile_rows(
        q_ptr, tile_seq_ptr, tile_row_ptr, tile_len_ptr, cu_ptr, ctx_ptr, tile, hk, H, D, G, BLOCK_M, DECODE)
    M, L, ACC = _empty_state(BLOCK_M, D)
    m_i, l_i, acc = _empty_state(BLOCK_M, D)
    end = max_pos + 1
    full_end = tl.minimum(end, (min_pos + 1) // BLOCK_N * BLOCK_N)
    blk = _block_ids(bt_ptr, s, stride_bt, PAGE, max_pos, 0, BLOCK_N)
    for kv0 in range(0, full_end, BLOCK_N):
        M, L, ACC, m_i, l_i, acc, blk = _one_pass_step(q, k_ptr, v_ptr, bt_ptr, s, stride_bt, hk, pos, row_ok,
                                                       max_pos, kv0, SPLIT, M, L, ACC, m_i, l_i, acc, blk,
                                                       qk_scale, PAGE, HKV, D, BLOCK_M, BLOCK_N, False)
    for kv0 in range(full_end, end, BLOCK_N):
        M, L, ACC, m_i, l_i, acc, blk = _one_pass_step(q, k_ptr, v_ptr, bt_ptr, s, stride_bt, hk, pos, row_ok,
                                                       max_pos, kv0, SPLIT, M, L, ACC, m_i, l_i, acc, blk,
                                                       qk_scale, PAGE, HKV, D, BLOCK_M, BLOCK_N, True)
    M, L, ACC = _fold(M, L, ACC, m_i, l_i, acc)
    offs_d = tl.arange(0, D)
    out = (rows * H + heads)[:, None] * D + offs_d[None, :]
    tl.store(out_ptr + out, (ACC / L[:, None]).to(out_ptr.dtype.element_ty), mask=row_ok[:, None])


@triton.jit(do_not_specialize=["stride_bt", "num_rows", "SPLIT"])
def _attn_split_fold(q_ptr, k_ptr, v_ptr, bt_ptr, tile_seq_ptr, tile_row_ptr, tile_len_ptr, cu_ptr, ctx_ptr,
                     o_ptr, m_ptr, l_ptr, count_ptr, out_ptr, qk_scale, stride_bt, num_rows, SPLIT,
                     PAGE: tl.constexpr, H: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, G: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DECODE: tl.constexpr):
    """Streaming mode in parallel splits, one launch: the programs of a (tile, KV head) take its splits in
    turn (program p: splits p, p + P, ...), each split's partial computed as `_attn_folded` computes it and
    stored; the program that stores the tile's last partial (a counter per (tile, KV head), which it sets
    back to 0) folds every split in split order, as `_attn_folded` folds them, and writes the output. Which
    program folds, and when, changes no bit: the fold reads the stored fp32 partials in a fixed order."""
    tile = tl.num_programs(0) - 1 - tl.program_id(0)
    hk = tl.program_id(1)
    p = tl.program_id(2)
    s, rows, heads, pos, row_ok, min_pos, max_pos, q = _tile_rows(
        q_ptr, tile_seq_ptr, tile_row_ptr, tile_len_ptr, cu_ptr, ctx_ptr, tile, hk, H, D, G, BLOCK_M, DECODE)
    n_split = max_pos // SPLIT + 1       # the tile's splits; a row before a split's start stores it empty
    offs_d = tl.arange(0, D)
    idx = rows * H + heads
    mine = 0
    for sp in range(p, n_split, tl.num_programs(2)):
        start = sp * SPLIT
        m_i, l_i, acc = _split_partial(q, k_ptr, v_ptr, bt_ptr, s, stride_bt, PAGE, hk, pos, row_ok, min_pos,
                                       max_pos, start, tl.minimum(start + SPLIT, max_pos + 1), qk_scale, HKV,
                                       D, BLOCK_M, BLOCK_N)
        at = sp * num_rows * H + idx
        tl.store(o_ptr + at[:, None] * D + offs_d[None, :], acc, mask=row_ok[:, None])
        tl.store(m_ptr + at, m_i, mask=row_ok)
        tl.store(l_ptr + at, l_i, mask=row_ok)
        mine += 1
    if mine > 0:
        tl.debug_barrier()  # every thread's partials stored before the counter (released at GPU scope) moves
        counter = count_ptr + tile * HKV + hk
        if tl.atomic_add(counter, mine, sem="acq_rel", scope="gpu") + mine == n_split:
            tl.store(counter, 0)  # for the next launch (a kernel boundary orders it)
            # from the empty state, every split folded in, split 0 too: `_attn_folded_one_pass`'s folds, one
            # for one (the others' partials read from L2, ".cg": this SM's L1 holds none of them)
            M, L, ACC = _empty_state(BLOCK_M, D)
            for sp in range(0, n_split):
                at = sp * num_rows * H + idx
                m = tl.load(m_ptr + at, mask=row_ok, other=0.0, cache_modifier=".cg")
                lsum = tl.load(l_ptr + at, mask=row_ok, other=0.0, cache_modifier=".cg")
                acc = tl.load(o_ptr + at[:, None] * D + offs_d[None, :], mask=row_ok[:, None], other=0.0,
                              cache_modifier=".cg")
                M, L, ACC = _fold(M, L, ACC, m, lsum, acc)
            out = idx[:, None] * D + offs_d[None, :]
            tl.store(out_ptr + out, (ACC / L[:, None]).to(out_ptr.dtype.element_ty), mask=row_ok[:, None])


@triton.jit(do_not_specialize=["num_rows"])
def _attn_combine(o_ptr, m_ptr, l_ptr, n_ptr, out_ptr, num_rows, H: tl.constexpr, D: tl.constexpr):
    """The combine of stored partials up to the row's last split: an empty split changes neither the maximum
    nor the sums (its weight is exp2(-inf) = 0 on zeros)."""
    r = tl.program_id(0)
    h = tl.program_id(1)
    num_splits = tl.load(n_ptr + r)
    offs_d = tl.arange(0, D)
    m_all = tl.full([1], float("-inf"), tl.float32)
    for sp in range(0, num_splits):          # the running maximum, in split order
        m_all = tl.maximum(m_all, tl.load(m_ptr + (sp * num_rows + r) * H + h + tl.zeros([1], tl.int32)))
    m_safe = tl.where(m_all == float("-inf"), 0.0, m_all)
    num = tl.zeros([D], tl.float32)
    den = tl.zeros([1], tl.float32)
    for sp in range(0, num_splits):          # partials summed in split order; empty splits add exact zeros
        idx = (sp * num_rows + r) * H + h
        w = tl.math.exp2(tl.load(m_ptr + idx + tl.zeros([1], tl.int32)) - m_safe)
        num += tl.load(o_ptr + idx * D + offs_d) * w
        den += tl.load(l_ptr + idx + tl.zeros([1], tl.int32)) * w
    tl.store(out_ptr + (r * H + h) * D + offs_d, (num / den).to(out_ptr.dtype.element_ty))


LOG2E = 1.4426950408889634
# Streaming: a launch of this many (tile, KV head) programs or more folds each tile's splits in one program
# (`_attn_folded_one_pass`); a smaller one runs the splits in parallel programs (`_attn_split_fold`), as many
# per (tile, KV head) as make up SPLIT_PROGRAMS (two per SM of an H200), where its partials fit
# SPLIT_BUFFER_BYTES. The two give a token the same bits, so the choice is speed alone: on the H200,
# Llama-3.1-8B decode from CUDA graphs at stride 64, the parallel splits are the faster below 16 rows
# (benchmarks/gpu_attention_strides.py).
IN_PROGRAM_MIN_PROGRAMS = 128
SPLIT_PROGRAMS = 264
SPLIT_BUFFER_BYTES = 64 << 20
SPLIT_COUNTERS = 256
# streaming's in-program fold as one pass over the KV tiles (`_attn_folded_one_pass`) rather than a loop per
# split (`_attn_folded`): the same bits; on the H200 prefill 1 x 8192 at stride 256 takes 1.79 ms where the
# loop per split takes 2.22, and 1.78 against 1.82 at stride 2048 (benchmarks/gpu_attention.py --one-pass;
# RESULTS.md, "GPU kernels")
FOLD_IN_ONE_PASS = True


@dataclass(frozen=True)
class StepPlan:
    """What every layer's call of one step shares: the query tiles and the split count (built once), and
    the split fold's counters (`counters`; zero between launches)."""

    tile_seq: torch.Tensor
    tile_row: torch.Tensor
    tile_len: torch.Tensor
    cu: torch.Tensor
    context_lens: torch.Tensor
    block_tables: torch.Tensor
    num_tiles: int
    num_splits: int
    counters: torch.Tensor
    one_row_each: bool = False  # every sequence has one query row (decode): tile, sequence and row coincide


def split_counters(device: torch.device | str) -> torch.Tensor:
    """Zeroed counters for `_attn_split_fold`, one per (tile, KV head) of a launch (a launch of more programs
    folds in one program per tile). Allocated outside any CUDA-graph capture, with the plan; every launch
    leaves them at zero."""
    return torch.zeros(SPLIT_COUNTERS, dtype=torch.int32, device=device)


def plan_step(cu_seqlens_q: torch.Tensor, context_lens: torch.Tensor, block_tables: torch.Tensor,
              config: TritonAttentionConfig, device: torch.device, heads_per_group: int = 1) -> StepPlan:
    """Query tiles (one sequence each, block_m // heads_per_group query rows) and split count of a step, on
    `device` (one host sync)."""
    if config.split % config.block_n:
        raise ValueError("split must be a multiple of block_n")
    rows_per_tile = config.block_m // heads_per_group
    if rows_per_tile < 1:
        raise ValueError(f"{heads_per_group} query heads per KV head do not fit block_m={config.block_m}")
    cu = cu_seqlens_q.tolist()
    ctx = context_lens.tolist()
    tiles = [(s, r, min(rows_per_tile, cu[s + 1] - r)) for s in range(len(cu) - 1)
             for r in range(cu[s], cu[s + 1], rows_per_tile)]
    tile_seq, tile_row, tile_len = (torch.tensor(c, dtype=torch.int32, device=device) for c in zip(*tiles))
    max_len = max(c + cu[s + 1] - cu[s] for s, c in enumerate(ctx))
    return StepPlan(tile_seq, tile_row, tile_len, torch.tensor(cu, dtype=torch.int32, device=device),
                    torch.tensor(ctx, dtype=torch.int32, device=device),
                    block_tables.to(device=device, dtype=torch.int32).contiguous(), len(tiles),
                    triton.cdiv(max_len, config.split), split_counters(device),
                    cu[0] == 0 and all(b - a == 1 for a, b in zip(cu, cu[1:])))


def _partials(num_splits: int, t: int, h: int, d: int, dev: torch.device
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each (split, row, head)'s unnormalised partial: acc [splits, T, H, D], m and l [splits, T, H], fp32."""
    return (torch.empty((num_splits, t, h, d), dtype=torch.float32, device=dev),
            torch.empty((num_splits, t, h), dtype=torch.float32, device=dev),
            torch.empty((num_splits, t, h), dtype=torch.float32, device=dev))


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, cu_seqlens_q: torch.Tensor,
                    context_lens: torch.Tensor, block_tables: torch.Tensor, scale: float,
                    config: TritonAttentionConfig = TritonAttentionConfig(), plan: StepPlan | None = None
                    ) -> torch.Tensor:
    """q: [T, H, D]; k/v_cache: [num_blocks, page, HKV, D]; cu_seqlens_q: [S+1]; context_lens: [S] (absolute
    position of each sequence's first query row; its KV up to its last query row is already in the cache);
    block_tables: [S, max_blocks]. Causal. Returns [T, H, D] in q's dtype. `plan`: the step's shared plan
    (`plan_step`), so the layers of one step do not each rebuild it."""
    t, h, d = q.shape
    page, hkv = k_cache.shape[1], k_cache.shape[2]
    dev = q.device
    qk_scale = scale * LOG2E  # the kernels' exponentials are base 2
    plan = plan or plan_step(cu_seqlens_q, context_lens, block_tables, config, dev, h // hkv)
    num_splits = plan.num_splits
    out = torch.empty_like(q)
    direct = num_splits == 1
    bt = plan.block_tables
    shape = dict(PAGE=page, H=h, HKV=hkv, D=d, G=h // hkv, BLOCK_M=config.block_m, BLOCK_N=config.block_n,
                 DECODE=plan.one_row_each, num_warps=config.num_warps, num_stages=config.num_stages)
    programs = plan.num_tiles * hkv
    if config.streaming:
        if (direct or programs >= IN_PROGRAM_MIN_PROGRAMS or programs > plan.counters.numel()
                or num_splits * t * h * d * 4 > SPLIT_BUFFER_BYTES):
            folded = _attn_folded_one_pass if FOLD_IN_ONE_PASS else _attn_folded
            folded[(plan.num_tiles, hkv)](
                q.contiguous(), k_cache, v_cache, bt, plan.tile_seq, plan.tile_row, plan.tile_len, plan.cu,
                plan.context_lens, out, qk_scale, bt.stride(0), config.split, **shape)
        else:
            per_tile = min(num_splits, triton.cdiv(SPLIT_PROGRAMS, programs))
            _attn_split_fold[(plan.num_tiles, hkv, per_tile)](
                q.contiguous(), k_cache, v_cache, bt, plan.tile_seq, plan.tile_row, plan.tile_len, plan.cu,
                plan.context_lens, *_partials(num_splits, t, h, d, dev), plan.counters, out, qk_scale,
                bt.stride(0), t, config.split, **shape)
        return out
    if direct:
        o = m = l_ = n = out  # unused
    else:
        o, m, l_ = _partials(num_splits, t, h, d, dev)
        n = torch.empty(t, dtype=torch.int32, device=dev)  # each row's split count
    _attn_partial[(plan.num_tiles, hkv, num_splits)](
        q.contiguous(), k_cache, v_cache, bt, plan.tile_seq, plan.tile_row, plan.tile_len,
        plan.cu, plan.context_lens, o, m, l_, n, out, qk_scale, bt.stride(0), t, config.split, DIRECT=direct,
        **shape)
    if not direct:
        _attn_combine[(t, h)](o, m, l_, n, out, t, H=h, D=d)
    return out
