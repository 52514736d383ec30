"""Paged, varlen, causal GQA attention whose per-token reduction order depends only on absolute positions.

With `AttentionParams(kv_tile, split_stride)` every query token at absolute position p does exactly this,
whatever else is in the batch: for each split s (positions [s*stride, (s+1)*stride), or one split when
stride == 0), in order, an online softmax over the tiles j of that split (positions [j*tile, (j+1)*tile),
positions > p masked), each tile being one fp32 [G, D] x [D, tile] scores product and one [G, tile] x
[tile, D] values product (G = Hq // Hkv query heads sharing a KV head); then the split partials are merged
in split order in fp32. The same token therefore gets the same bits prefilled in one chunk, in chunked
prefill, after a prefix-cache hit or decoded, and next to any other sequences.

On the CPU the per-tile products are torch.bmm calls whose batch elements are (token, kv head) pairs: an
element's bits do not depend on the batch count, except that a lone product is threaded over its rows, so
`_bmm` pads a batch of one to two; and the operand layout does change bits, so both code paths below build
identical element layouts (tests/kernels/test_kernel_attention.py holds what was measured). Stock
(params=None) pads the batch to (max_seqlen_q, max_seqlen_k) for one F.scaled_dot_product_attention call,
whose bits move with that padding.
Two paths feed the same per-token arithmetic: sequences with many active query tokens at a tile share that
tile's K/V through an expanded view (prefill), the rest are gathered per token and batched (decode).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from detent_audit.errors import BadInput
from detent_audit.kernels.attention_metadata import AttentionMetadata, write_kv
from detent_audit.kernels.params import AttentionParams

__all__ = ["AttentionMetadata", "paged_attention", "write_kv"]

# A sequence with at least this many active query tokens at a tile shares the tile's KV (no gather).
# Which path a token takes never changes its bits (tested); this only trades copies for Python calls.
_SHARED_MIN_TOKENS = 4


def _bmm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """torch.bmm with at least 2 batch elements (see module docstring: B == 1 changes bits)."""
    if a.shape[0] == 1:
        return torch.bmm(a.expand(2, -1, -1), b.expand(2, -1, -1))[:1]
    return torch.bmm(a, b)


def _tile_slots(tables: torch.Tensor, kv_pos: torch.Tensor, block_size: int) -> torch.Tensor:
    """tables: [..., max_blocks], kv_pos: [tile] -> slots [..., tile] (positions past the table clamp)."""
    cols = (kv_pos // block_size).clamp(max=tables.shape[-1] - 1)
    blocks = tables[..., cols].clamp(min=0)
    return blocks * block_size + kv_pos % block_size


class _OnlineSoftmax:
    """Running (max, sum, acc) per (kv head, token, group head), and the split-order merge of partials."""

    def __init__(self, heads: int, tokens: int, group: int, dim: int, splits: bool) -> None:
        self.m = torch.full((heads, tokens, group), -torch.inf)
        self.l = torch.zeros(heads, tokens, group)
        self.acc = torch.zeros(heads, tokens, group, dim)
        if splits:
            self.merged = (self.m.clone(), self.l.clone(), self.acc.clone())

    def _merge(self, rows: slice | torch.Tensor) -> None:
        big_m, big_l, big_acc = (t[:, rows] for t in self.merged)
        m, denom, acc = self.m[:, rows], self.l[:, rows], self.acc[:, rows]
        new_m = torch.maximum(big_m, m)
        a, b = torch.exp(big_m - new_m), torch.exp(m - new_m)
        merged = (new_m, big_l * a + denom * b, big_acc * a[..., None] + acc * b[..., None])
        for store, value in zip(self.merged, merged, strict=True):
            store[:, rows] = value

    def step(self, rows: slice | torch.Tensor, scores: torch.Tensor, values_fn, new_split: bool) -> None:
        """Fold one KV tile into `rows`.  scores: [Hkv, n, G, tile] (masked: -inf); values_fn(p) -> pv."""
        if new_split:
            self._merge(rows)
            self.m[:, rows], self.l[:, rows], self.acc[:, rows] = -torch.inf, 0.0, 0.0
        m_old = self.m[:, rows]
        m_new = torch.maximum(m_old, scores.amax(-1))
        alpha = torch.exp(m_old - m_new)
        p = torch.exp(scores - m_new[..., None])
        self.l[:, rows] = self.l[:, rows] * alpha + p.sum(-1)
        self.acc[:, rows] = self.acc[:, rows] * alpha[..., None] + values_fn(p)
        self.m[:, rows] = m_new

    def result(self) -> torch.Tensor:
        """[Hkv, T, G, D] fp32 output: merges the last split of every token first."""
        if hasattr(self, "merged"):
            self._merge(slice(None))
            return self.merged[2] / self.merged[1][..., None]
        return self.acc / self.l[..., None]


class _Batch(NamedTuple):
    """What every tile needs: fp32 pre-scaled queries, flat caches and each token's sequence and position."""

    qs: torch.Tensor  # [Hkv, T, G, D] fp32, q * scale
    k_flat: torch.Tensor  # [slots, Hkv, D]
    v_flat: torch.Tensor  # [slots, Hkv, D]
    tok_seq: torch.Tensor  # [T] sequence index of each query token
    tok_pos: torch.Tensor  # [T] absolute position of each query token
    meta: AttentionMetadata
    block_size: int


def _shared_tile(b: _Batch, state: _OnlineSoftmax, seq: int, rows: slice, kv_pos, new_split: bool) -> None:
    """One tile for >= _SHARED_MIN_TOKENS tokens of one sequence: K/V gathered once, expanded (stride 0)."""
    kv_heads, n, group, dim = b.qs.shape[0], rows.stop - rows.start, b.qs.shape[2], b.qs.shape[3]
    tile = kv_pos.shape[0]
    slots = _tile_slots(b.meta.block_tables[seq], kv_pos, b.block_size)
    valid = (kv_pos < b.meta.seq_lens[seq])[None, :, None]
    k_t = b.k_flat[slots].float().permute(1, 0, 2).contiguous()  # [Hkv, tile, D]
    v_t = torch.where(valid, b.v_flat[slots].float().permute(1, 0, 2), 0.0).contiguous()  # [Hkv, tile, D]
    scores = torch.empty(kv_heads, n, group, tile)
    for h in range(kv_heads):  # batch n >= 2, elements [G, D] x [D, tile]
        torch.bmm(b.qs[h, rows], k_t[h].t().expand(n, dim, tile), out=scores[h])
    mask = (kv_pos[None, :] <= b.tok_pos[rows, None])[None, :, None, :]

    def values(p: torch.Tensor) -> torch.Tensor:
        out = torch.empty(kv_heads, n, group, dim)
        for h in range(kv_heads):  # elements [G, tile] x [tile, D]
            torch.bmm(p[h], v_t[h].expand(n, tile, dim), out=out[h])
        return out

    state.step(rows, scores.masked_fill_(~mask, -torch.inf), values, new_split)


def _gathered_tile(b: _Batch, state: _OnlineSoftmax, idx: torch.Tensor, kv_pos, new_split: bool) -> None:
    """One tile for arbitrary tokens idx [n] (decode, short chunks): K/V gathered per token, one bmm."""
    kv_heads, n, group, dim = b.qs.shape[0], idx.numel(), b.qs.shape[2], b.qs.shape[3]
    tile = kv_pos.shape[0]
    seqs = b.tok_seq[idx]
    slots = _tile_slots(b.meta.block_tables[seqs], kv_pos, b.block_size)  # [n, tile]
    valid = (kv_pos[None, :] < b.meta.seq_lens[seqs, None])[..., None, None]
    k_g = b.k_flat[slots].float().permute(2, 0, 1, 3).reshape(kv_heads * n, tile, dim)
    v_g = torch.where(valid, b.v_flat[slots].float(), 0.0).permute(2, 0, 1,
                                                                   3).reshape(kv_heads * n, tile, dim)
    q_g = b.qs[:, idx].view(kv_heads * n, group, dim)
    scores = _bmm(q_g, k_g.transpose(1, 2)).view(kv_heads, n, group, tile)
    mask = (kv_pos[None, :] <= b.tok_pos[idx, None])[None, :, None, :]

    def values(p: torch.Tensor) -> torch.Tensor:
        return _bmm(p.reshape(kv_heads * n, group, tile), v_g).view(kv_heads, n, group, dim)

    state.step(idx, scores.masked_fill_(~mask, -torch.inf), values, new_split)


def _tiled_attention(q, k_cache, v_cache, meta: AttentionMetadata, scale: float, params: AttentionParams):
    tokens, q_heads, dim = q.shape
    kv_heads = k_cache.shape[2]
    group, tile = q_heads // kv_heads, params.kv_tile
    cu, ctx, lens = meta.cu_seqlens_q.tolist(), meta.context_lens.tolist(), meta.seq_lens.tolist()
    tok_seq = torch.repeat_interleave(torch.arange(len(ctx)), meta.cu_seqlens_q.diff())
    batch = _Batch(
        qs=(q.float() * scale).view(tokens, kv_heads, group, dim).permute(1, 0, 2, 3).contiguous(),
        k_flat=k_cache.view(-1, kv_heads, dim),
        v_flat=v_cache.view(-1, kv_heads, dim),
        tok_seq=tok_seq,
        tok_pos=meta.context_lens[tok_seq] + torch.arange(tokens) - meta.cu_seqlens_q[tok_seq],
        meta=meta,
        block_size=k_cache.shape[1],
    )
    state = _OnlineSoftmax(kv_heads, tokens, group, dim, splits=params.split_stride > 0)
    for j in range(-(-max(lens, default=0) // tile)):
        start = j * tile
        kv_pos = start + torch.arange(tile)
        new_split = params.split_stride > 0 and j > 0 and j % params.tiles_per_split == 0
        shared = torch.zeros(len(ctx), dtype=torch.bool)
        for i in range(len(ctx)):
            first = cu[i] + max(0, start - ctx[i])  # this sequence's first token at position >= start
            if cu[i + 1] - first >= _SHARED_MIN_TOKENS:
                shared[i] = True
                _shared_tile(batch, state, i, slice(first, cu[i + 1]), kv_pos, new_split)
        idx = ((batch.tok_pos >= start) & ~shared[tok_seq]).nonzero().squeeze(1)
        if idx.numel():
            _gathered_tile(batch, state, idx, kv_pos, new_split)
    return state.result().permute(1, 0, 2, 3).reshape(tokens, q_heads, dim).to(q.dtype)


def _stock_attention(q, k_cache, v_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """What a stock engine does on CPU: pad the batch to (max_seqlen_q, max_seqlen_k), mask, one SDPA."""
    tokens, q_heads, dim = q.shape
    block_size, kv_heads = k_cache.shape[1], k_cache.shape[2]
    num_seqs, max_q, max_k = meta.num_seqs, meta.max_seqlen_q, meta.max_seqlen_k
    q_lens = meta.cu_seqlens_q.diff()
    dev = q.device
    tok_seq = torch.repeat_interleave(torch.arange(num_seqs, device=dev), q_lens)
    tok_row = torch.arange(tokens, device=dev) - meta.cu_seqlens_q[tok_seq]
    q_pad = q.new_zeros(num_seqs, max_q, q_heads, dim)
    q_pad[tok_seq, tok_row] = q
    kv_pos = torch.arange(max_k, device=dev)
    slots = _tile_slots(meta.block_tables, kv_pos, block_size)  # [S, max_k]
    valid = kv_pos[None, :] < meta.seq_lens[:, None]  # [S, max_k]
    k = torch.where(valid[..., None, None], k_cache.view(-1, kv_heads, dim)[slots], 0).to(q.dtype)
    v = torch.where(valid[..., None, None], v_cache.view(-1, kv_heads, dim)[slots], 0).to(q.dtype)
    q_pos = meta.context_lens[:, None] + torch.arange(max_q, device=dev)[None, :]  # [S, max_q]
    mask = (kv_pos[None, None, :] <= q_pos[..., None]) & valid[:, None, :]
    mask[:, :, 0] = True  # padded query rows: attend somewhere rather than produce NaN
    repeat = q_heads // kv_heads
    out = F.scaled_dot_product_attention(
        q_pad.transpose(1, 2),
        k.transpose(1, 2).repeat_interleave(repeat, dim=1),
        v.transpose(1, 2).repeat_interleave(repeat, dim=1),
        attn_mask=mask[:, None],
        scale=scale,
    )  # [S, Hq, max_q, D]
    return out.transpose(1, 2)[tok_seq, tok_row]


@torch.no_grad()
def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    *,
    scale: float,
    params: AttentionParams | None = None,
) -> torch.Tensor:
    """Causal GQA attention of q: [T, Hq, D] over the paged caches [num_blocks, block_size, Hkv, D].

    A query token at absolute position p attends to its own sequence's KV positions 0..p (its own KV must
    already be written, see write_kv). Returns [T, Hq, D] in q's dtype. params=None is stock (batch-variant
    on purpose); with params a token's output bits depend only on its q, its sequence's KV at positions
    0..p, p itself and params (module docstring).
    """
    if q.dim() != 3 or k_cache.dim() != 4 or q.shape[-1] != k_cache.shape[-1]:
        raise BadInput(f"paged_attention: q {tuple(q.shape)} and cache {tuple(k_cache.shape)} do not match")
    if q.shape[1] % k_cache.shape[2]:
        raise BadInput(f"query heads {q.shape[1]} are not a multiple of KV heads {k_cache.shape[2]}")
    if q.shape[0] != meta.num_tokens:
        raise BadInput(f"q has {q.shape[0]} tokens, metadata {meta.num_tokens}")
    if q.shape[0] == 0:
        return q.clone()
    if params is None:
        return _stock_attention(q, k_cache, v_cache, meta, scale)
    return _tiled_attention(q, k_cache, v_cache, meta, scale, params)
