"""CUDA graphs of the decode step (GPU), wrapping the same model and kernels as the eager step.

A decode-only step of B sequences replays the graph captured for the smallest capture size >= B. The rows
past B are padding: they read and write one scratch KV block and their outputs are dropped. Padding cannot
change a real row's bits: GEMM rows are independent of M and of the tile (measured), attention is per row,
and the graph's attention launches the splits of the longest context the engine allows, of which a row's
empty splits are exact no-ops. So a replay gives exactly the eager step's bits; eager always works
(`EngineConfig.cuda_graphs=False`, or any step that is not decode-only or is larger than the largest size).
"""

from __future__ import annotations

import torch

from detent_audit.engine.model import CausalLM
from detent_audit.kernels.attention_metadata import AttentionMetadata

CAPTURE_SIZES = (1, 2, 4, 8, 16, 32)


class DecodeGraphs:
    """Captured decode steps by batch size. `run` returns the logits [B, V] of a decode step, or None when
    the step must run eagerly."""

    def __init__(self, model: CausalLM, kernels, kv_caches: list, block_size: int, max_model_len: int,
                 scratch_block: int, device: str, sizes: tuple[int, ...] = CAPTURE_SIZES) -> None:
        self.model, self.kernels, self.kv_caches = model, kernels, kv_caches
        self.block_size, self.scratch_block, self.device = block_size, scratch_block, device
        self.max_blocks = -(-max_model_len // block_size)
        self.max_model_len = max_model_len
        self.sizes = tuple(sorted(sizes))
        self.graphs: dict[int, tuple] = {}

    def _capture(self, b: int) -> tuple:
        from detent_audit.kernels.triton_attention import StepPlan

        dev = self.device
        ids = torch.zeros(b, dtype=torch.int64, device=dev)
        pos = torch.zeros(b, dtype=torch.int64, device=dev)
        tables = torch.full((b, self.max_blocks), self.scratch_block, dtype=torch.int64, device=dev)
        slots = torch.full((b,), self.scratch_block * self.block_size, dtype=torch.int64, device=dev)
        cu = torch.arange(b + 1, dtype=torch.int64, device=dev)
        meta = AttentionMetadata(cu_seqlens_q=cu, context_lens=pos, seq_lens=pos + 1, block_tables=tables,
                                 slot_mapping=slots, max_seqlen_q=1, max_seqlen_k=self.max_model_len)
        c = self.model.config
        # the launch's selection at the capture size and the longest context (stock: FA3's split for it)
        cfg = self.kernels.attention_config(b, 1, self.max_model_len, c.num_key_value_heads,
                                            c.num_attention_heads // c.num_key_value_heads)
        rows = torch.arange(b, dtype=torch.int32, device=dev)
        plan = StepPlan(tile_seq=rows, tile_row=rows, tile_len=torch.ones(b, dtype=torch.int32, device=dev),
                        cu=cu.to(torch.int32), context_lens=torch.zeros(b, dtype=torch.int32, device=dev),
                        block_tables=torch.zeros((b, self.max_blocks), dtype=torch.int32, device=dev),
                        num_tiles=b, num_splits=-(-self.max_model_len // cfg.split))

        def step() -> torch.Tensor:
            plan.context_lens.copy_(pos)  # int64 -> int32 views the kernel reads, refreshed inside the graph
            plan.block_tables.copy_(tables)
            self.kernels._plan = (meta, cfg, plan)
            hidden = self.model(ids, pos, meta, self.kv_caches, self.kernels)
            return self.model.compute_logits(hidden, self.kernels)

        step()  # compile and warm up outside the graph
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            logits = step()
        return graph, ids, pos, tables, slots, meta, plan, logits

    def run(self, ids: list[int], positions: list[int], tables: list[list[int]], slots: list[int]
            ) -> torch.Tensor | None:
        b = len(ids)
        size = next((s for s in self.sizes if s >= b), None)
        if size is None or max(len(t) for t in tables) > self.max_blocks:
            return None
        if size not in self.graphs:
            self.graphs[size] = self._capture(size)
        graph, s_ids, s_pos, s_tables, s_slots, _, _, logits = self.graphs[size]
        pad = size - b
        s_ids.copy_(torch.tensor(ids + [0] * pad, dtype=torch.int64), non_blocking=True)
        s_pos.copy_(torch.tensor(positions + [0] * pad, dtype=torch.int64), non_blocking=True)
        full = [t + [self.scratch_block] * (self.max_blocks - len(t)) for t in tables]
        full += [[self.scratch_block] * self.max_blocks] * pad
        s_tables.copy_(torch.tensor(full, dtype=torch.int64), non_blocking=True)
        s_slots.copy_(torch.tensor(slots + [self.scratch_block * self.block_size] * pad, dtype=torch.int64),
                      non_blocking=True)
        graph.replay()
        return logits[:b]
