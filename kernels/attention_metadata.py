"""The varlen, paged batch one attention call sees, and the KV-cache write.

Layout (as vLLM/nano-vllm): the KV cache is `[num_blocks, block_size, Hkv, D]`; sequence i owns the
physical blocks `block_tables[i]`, and its KV token at absolute position p lives in slot
`block_tables[i, p // block_size] * block_size + p % block_size`. Query tokens of all sequences are
concatenated: sequence i's are rows `cu_seqlens_q[i]:cu_seqlens_q[i+1]`, at absolute positions
`context_lens[i] + 0, 1, ...` (prefill chunks and decode tokens alike; a decode token is a 1-token chunk).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from detent_audit.errors import BadInput


@dataclass(frozen=True)
class AttentionMetadata:
    """One attention call's batch. Integer tensors (int32 accepted, stored as int64) on the q device.

    cu_seqlens_q: [S+1] query row offsets; context_lens: [S] KV tokens already cached before this step's
    queries (= absolute position of the first query token); seq_lens: [S] = context_lens + query lens;
    block_tables: [S, max_blocks] physical block ids (entries past a sequence's last block are ignored);
    slot_mapping: [T] cache slot of each query token; max_seqlen_q / max_seqlen_k: batch maxima (stock
    attention pads to them, which is what makes it batch-variant).
    """

    cu_seqlens_q: torch.Tensor
    context_lens: torch.Tensor
    seq_lens: torch.Tensor
    block_tables: torch.Tensor
    slot_mapping: torch.Tensor
    max_seqlen_q: int
    max_seqlen_k: int

    def __post_init__(self) -> None:
        num_seqs = self.context_lens.shape[0] if self.context_lens.dim() == 1 else -1
        checks = [
            (self.cu_seqlens_q.dim() == 1 and self.cu_seqlens_q.shape[0] == num_seqs + 1,
             "cu_seqlens_q [S+1]"),
            (self.seq_lens.shape == (num_seqs,), "seq_lens [S]"),
            (self.block_tables.dim() == 2 and self.block_tables.shape[0] == num_seqs, "block_tables [S, B]"),
            (self.slot_mapping.dim() == 1, "slot_mapping [T]"),
            (self.max_seqlen_q >= 0 and self.max_seqlen_k >= 0, "max_seqlen_q/k >= 0"),
        ]
        for ok, what in checks:
            if not ok:
                raise BadInput(f"AttentionMetadata: expected {what}", remedy="build it with from_lengths()")
        for name in ("cu_seqlens_q", "context_lens", "seq_lens", "block_tables", "slot_mapping"):
            value = getattr(self, name)
            if value.dtype not in (torch.int32, torch.int64):
                raise BadInput(f"AttentionMetadata.{name} must be int32 or int64, got {value.dtype}")
            if value.dtype != torch.int64:  # normalised once here so kernels index with int64 only
                object.__setattr__(self, name, value.to(torch.int64))

    @property
    def num_seqs(self) -> int:
        return self.context_lens.shape[0]

    @property
    def num_tokens(self) -> int:
        return self.slot_mapping.shape[0]

    @classmethod
    def from_lengths(
        cls,
        context_lens: Sequence[int],
        query_lens: Sequence[int],
        block_tables: torch.Tensor,
        block_size: int,
    ) -> AttentionMetadata:
        """Derive offsets, sequence lengths and slots from per-sequence lengths and block tables."""
        if len(context_lens) != len(query_lens) or len(query_lens) != block_tables.shape[0]:
            raise BadInput("context_lens, query_lens and block_tables disagree on the number of sequences")
        seq_lens = [c + q for c, q in zip(context_lens, query_lens, strict=True)]
        if any(s > block_tables.shape[1] * block_size for s in seq_lens):
            raise BadInput("a sequence is longer than its block table", remedy="allocate more blocks")
        cu = [0]
        slots: list[int] = []
        table = block_tables.tolist()
        for i, (ctx, qlen) in enumerate(zip(context_lens, query_lens, strict=True)):
            cu.append(cu[-1] + qlen)
            slots += [table[i][p // block_size] * block_size + p % block_size for p in range(ctx, ctx + qlen)]
        as_long = lambda xs: torch.tensor(xs, dtype=torch.int64)  # noqa: E731
        return cls(
            cu_seqlens_q=as_long(cu),
            context_lens=as_long(list(context_lens)),
            seq_lens=as_long(seq_lens),
            block_tables=block_tables.to(torch.int64),
            slot_mapping=as_long(slots),
            max_seqlen_q=max(query_lens, default=0),
            max_seqlen_k=max(seq_lens, default=0),
        )


@torch.no_grad()
def write_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Store k, v: [T, Hkv, D] into the caches [num_blocks, block_size, Hkv, D] at slot_mapping [T].

    Mutates k_cache and v_cache in place (cast to the cache dtype). Tokens with a negative slot are skipped
    (padding tokens, as in vLLM).
    """
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise BadInput("the KV cache must be contiguous", remedy="allocate it with torch.empty/zeros")
    slot_mapping = slot_mapping.to(device=k.device, dtype=torch.int64)
    keep = slot_mapping >= 0
    if not bool(keep.all()):
        k, v, slot_mapping = k[keep], v[keep], slot_mapping[keep]
    heads, dim = k_cache.shape[2], k_cache.shape[3]
    k_cache.view(-1, heads, dim).index_copy_(0, slot_mapping, k.to(k_cache.dtype))
    v_cache.view(-1, heads, dim).index_copy_(0, slot_mapping, v.to(v_cache.dtype))
