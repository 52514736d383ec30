"""Fixtures for the engine's model tests: tiny checkpoints in temporary folders and a hand-built paged KV."""

from __future__ import annotations

import math
from collections.abc import Sequence

import pytest
import torch

from detent_audit.kernels import AttentionMetadata
from detent_audit.runtime.model_config import ModelConfig


class PagedKV:
    """A paged KV cache for a fixed set of sequences, with one block table per sequence.

    Blocks are handed out in a seeded random order (so tables are not contiguous) and the caches start as
    noise, never zeros, so a kernel that reads past a sequence's length shows up in the logits.
    """

    def __init__(self, config: ModelConfig, num_seqs: int, max_len: int, block_size: int = 4,
                 dtype: torch.dtype = torch.float32, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        blocks_per_seq = math.ceil(max_len / block_size)
        num_blocks = num_seqs * blocks_per_seq + 2
        order = torch.randperm(num_blocks, generator=g)[: num_seqs * blocks_per_seq]
        self.block_size = block_size
        self.block_tables = order.view(num_seqs, blocks_per_seq).to(torch.int32)
        shape = (num_blocks, block_size, config.num_key_value_heads, config.head_dim)
        self.kv_caches = [(torch.randn(shape, generator=g).to(dtype),
                           torch.randn(shape, generator=g).to(dtype))
                          for _ in range(config.num_hidden_layers)]
        self.lens = [0] * num_seqs

    def step(self, chunks: Sequence[Sequence[int]]) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """Append chunks[i] to sequence i (every sequence is scheduled) -> input_ids, positions, meta."""
        context_lens, query_lens = list(self.lens), [len(c) for c in chunks]
        positions = [p for start, n in zip(context_lens, query_lens, strict=True)
                     for p in range(start, start + n)]
        self.lens = [start + n for start, n in zip(context_lens, query_lens, strict=True)]
        meta = AttentionMetadata.from_lengths(context_lens, query_lens, self.block_tables, self.block_size)
        ids = torch.tensor([t for chunk in chunks for t in chunk], dtype=torch.int64)
        return ids, torch.tensor(positions, dtype=torch.int64), meta


@pytest.fixture(scope="session")
def paged_kv() -> type[PagedKV]:
    return PagedKV


def _step_until_queued_ahead(llm, handle, seed: int) -> None:
    """Step `llm` until a step queued ahead (`LLM._ahead`) holds `handle`'s request."""
    for _ in range(200):
        if llm._ahead is not None and any(e.seq is handle for e in llm._ahead[0].scheduled):
            return
        llm.step()
    raise AssertionError(f"no step was queued ahead with request {handle.seq_id} in it (seed {seed})")


@pytest.fixture(scope="session")
def until_queued_ahead():
    """`until_queued_ahead(llm, handle, seed)`: step until a step queued ahead holds that request."""
    return _step_until_queued_ahead
