"""CUDA graphs of the decode step (GPU), wrapping the same model and kernels as the eager step.

A decode-only step of B sequences replays the graph captured for the smallest capture size >= B. The rows
past B are padding: they read and write one scratch KV block and their outputs are dropped. Padding cannot
change a real row's bits: GEMM rows are independent of M and of the tile (measured), attention is per row,
and the graph's attention launches the splits of the longest context the engine allows, of which a row's
empty splits are exact no-ops. So a replay gives exactly the eager step's bits; eager always works
(`EngineConfig.cuda_graphs=False`, or any step that is not decode-only or is larger than the largest size).

The step's inputs live on the device between steps (`DecodeRows`): each decoding sequence keeps a row of
the token, position and block-table buffers the graphs read, the sampled tokens and the next positions are
written there on the device, and the host writes only what changed (a block appended, a sequence admitted,
finished or back from an eager step). The KV slots are computed inside the graph from the table and the
position.
"""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Sequence as SequenceOf
from typing import NamedTuple

import torch

from detent_audit.engine.model import CausalLM
from detent_audit.engine.sequence import Sequence
from detent_audit.kernels.attention_metadata import AttentionMetadata


def capture_sizes(max_size: int) -> tuple[int, ...]:
    """The decode batch sizes captured up to `max_size`: 1, 2, 4, then every multiple of 8 (vLLM's list), and
    `max_size` itself; a batch pads to the next one, so padding wastes at most 7 rows past 8."""
    if max_size < 1:
        raise ValueError(f"max_size must be >= 1, got {max_size}")
    sizes = [s for s in (1, 2, 4) if s < max_size] + list(range(8, max_size, 8))
    return (*sizes, max_size)


def slots_of(tables: torch.Tensor, positions: torch.Tensor, block_size: int, out: torch.Tensor
             ) -> torch.Tensor:
    """The cache slot of each row's token into `out` [B]: its block (`tables` [B, blocks]) at `positions` [B],
    times the block size, plus the offset in the block (what `BlockManager.slot_mapping` gives)."""
    block = tables.gather(1, (positions // block_size).unsqueeze(1)).squeeze(1)
    return torch.add(block * block_size, positions % block_size, out=out)


class DecodeRows:
    """The decode step's inputs as persistent tensors, one row per decoding sequence, rows [0, B) in use.

    `ids`, `positions` [R] and `tables` [R, max_blocks] (int64, on `device`): row r holds its sequence's
    next input token, that token's position and its block table padded with `scratch_block`; a row past the
    batch is padding (token 0, position 0, every block the scratch block). `place` assigns rows for one step
    and writes what changed since the last (host work O(rows changed) besides one pass over the batch);
    `advance` writes the tokens a step sampled and the next positions on the device.

    Invariant after `place(seqs, positions)` returned `order`: `ids[r]`, `positions[r]`, `tables[r]` are
    `order[r]`'s token at its position, that position and its block table, for r < len(order); padding past.
    """

    def __init__(self, num_rows: int, max_blocks: int, scratch_block: int, device: str) -> None:
        self.max_blocks, self.scratch_block = max_blocks, scratch_block
        self.ids = torch.zeros(num_rows, dtype=torch.int64, device=device)
        self.positions = torch.zeros(num_rows, dtype=torch.int64, device=device)
        self.tables = torch.full((num_rows, max_blocks), scratch_block, dtype=torch.int64, device=device)
        self.device = device
        # the host's mirror of each row: its sequence, the position its device row holds, the block table
        # list it was written from (a preempted sequence gets a new one), how many of its blocks are written
        self.seq_at: list[Sequence | None] = [None] * num_rows
        self._row_of: dict[int, int] = {}  # seq_id -> row
        self._pos = [0] * num_rows  # the row's position minus `_epoch` (`advance` moves every row at once)
        self._epoch = 0
        self._table: list[list[int] | None] = [None] * num_rows
        self._blocks = [0] * num_rows
        self.num_rows_used = 0  # rows [0, num_rows_used) may hold a sequence; past it every row is padding

    def clear(self) -> None:
        """Every row padding and no sequence held, in the same buffers (the graphs read them)."""
        self.ids.zero_()
        self.positions.zero_()
        self.tables.fill_(self.scratch_block)
        n = len(self.seq_at)
        self.seq_at, self._row_of = [None] * n, {}
        self._pos, self._epoch, self._table, self._blocks = [0] * n, 0, [None] * n, [0] * n
        self.num_rows_used = 0

    def place(self, seqs: SequenceOf[Sequence], positions: SequenceOf[int]) -> list[Sequence]:
        """Rows for a decode step of `seqs` (each feeding its token at `positions[i]`): returns the sequences
        in row order, rows [0, len(seqs)). Sequences no longer decoding give their rows up; the last rows
        move into the holes, so the rows in use stay [0, B)."""
        b = len(seqs)
        live = {s.seq_id: s for s in seqs}
        for sid in [sid for sid in self._row_of if sid not in live]:
            self.seq_at[self._row_of.pop(sid)] = None
        holes = [r for r in range(b) if self.seq_at[r] is None]
        movers = [r for r in range(b, self.num_rows_used) if self.seq_at[r] is not None]
        src, dst = movers, holes[:len(movers)]
        if src:  # compact: rows past the batch move into the holes below it
            s, d = (torch.tensor(x, dtype=torch.int64).to(self.device, non_blocking=True) for x in (src, dst))
            for buf in (self.ids, self.positions, self.tables):
                buf[d] = buf[s]
            for r_src, r_dst in zip(src, dst):
                seq = self.seq_at[r_src]
                assert seq is not None
                self.seq_at[r_dst], self.seq_at[r_src] = seq, None
                self._row_of[seq.seq_id] = r_dst
                self._pos[r_dst], self._table[r_dst], self._blocks[r_dst] = (
                    self._pos[r_src], self._table[r_src], self._blocks[r_src])
        if self.num_rows_used > b:  # the rows past the batch become padding
            self.ids[b:self.num_rows_used] = 0
            self.positions[b:self.num_rows_used] = 0
            self.tables[b:self.num_rows_used] = self.scratch_block
            for padding in range(b, self.num_rows_used):
                self._table[padding] = None
        free = iter(holes[len(movers):])
        rewrite: list[int] = []           # rows whose whole table is written
        appended: list[tuple[int, int, int]] = []  # (row, column, block) of blocks appended since
        restart: list[tuple[int, int, int]] = []   # (row, position, token) of rows not fed by the device
        for seq, pos in zip(seqs, positions):
            held = self._row_of.get(seq.seq_id)
            r = next(free) if held is None else held
            if held is None:
                self._row_of[seq.seq_id], self.seq_at[r] = r, seq
                self._table[r] = None
            table = seq.block_table
            if self._table[r] is not table:  # a new row, or the sequence got a new table (preempted)
                self._table[r], self._blocks[r] = table, len(table)
                rewrite.append(r)
                self._pos[r] = -1 - self._epoch
            elif len(table) > self._blocks[r]:
                appended += [(r, j, table[j]) for j in range(self._blocks[r], len(table))]
                self._blocks[r] = len(table)
            if self._pos[r] + self._epoch != pos:  # the row does not hold this token (new, or ran eagerly)
                restart.append((r, pos, seq.token_ids[pos]))
                self._pos[r] = pos - self._epoch
        if rewrite:
            pad = self.scratch_block
            rows = [self._table[r] or [] for r in rewrite]
            full = torch.tensor([t + [pad] * (self.max_blocks - len(t)) for t in rows], dtype=torch.int64)
            self.tables[torch.tensor(rewrite).to(self.device)] = full.to(self.device, non_blocking=True)
        if appended:
            r_, c_, v_ = torch.tensor(appended).to(self.device, non_blocking=True).unbind(1)
            self.tables[r_, c_] = v_
        if restart:
            r_, p_, t_ = torch.tensor(restart).to(self.device, non_blocking=True).unbind(1)
            self.positions[r_] = p_
            self.ids[r_] = t_
        self.num_rows_used = b
        return self.seq_at[:b]  # type: ignore[return-value]

    def advance(self, tokens: torch.Tensor) -> None:
        """After a step of the placed rows: each row's next input is the token it sampled (`tokens` [B], on
        the device, in row order), at the next position."""
        b = self.num_rows_used
        if tokens.shape != (b,):
            raise ValueError(f"advance takes one token per placed row ({b}), got {tuple(tokens.shape)}")
        self.ids[:b].copy_(tokens)
        self.positions[:b] += 1
        self._epoch += 1


class Captured(NamedTuple):
    """One size's graph: `replay` runs it, `logits` [size, V] is where it writes, and `step` is the captured
    function, kept alive with the graph: its closure holds the tensors the graph reads that were allocated
    outside the capture (the slots, the step plan). The allocator would hand their memory out again once the
    kernels' current plan moved on, and the replay would read what was written there since."""

    replay: Callable[[], None]
    logits: torch.Tensor
    step: Callable[[], torch.Tensor]


class Replay(NamedTuple):
    """A decode step replayed: the logits [B, V] of the rows in use, and their sequences in row order."""

    logits: torch.Tensor
    seqs: list[Sequence]


class DecodeGraphs:
    """Captured decode steps by batch size over one set of `DecodeRows`. `run` returns the step's logits
    and row order, or None when the step must run eagerly."""

    def __init__(self, model: CausalLM, kernels, kv_caches: list, block_size: int, max_model_len: int,
                 scratch_block: int, device: str, max_size: int = 32) -> None:
        self.model, self.kernels, self.kv_caches = model, kernels, kv_caches
        self.block_size, self.scratch_block, self.device = block_size, scratch_block, device
        self.max_blocks = -(-max_model_len // block_size)
        self.max_model_len = max_model_len
        self.max_size = max_size
        self.sizes = capture_sizes(max_size)
        self.rows = DecodeRows(self.sizes[-1], self.max_blocks, scratch_block, device)
        self.graphs: dict[int, Captured] = {}

    def forget(self) -> None:
        """Every row back to padding and no sequence held (an engine that forgot its requests); the graphs
        are kept, since they read the rows' buffers, which stay."""
        self.rows.clear()

    def _step_at(self, b: int) -> Callable[[], torch.Tensor]:
        """The decode step of rows [0, b): the function a graph captures."""
        from detent_audit.kernels.triton_attention import StepPlan, split_counters

        dev, rows, size = self.device, self.rows, self.block_size
        ids, pos, tables = rows.ids[:b], rows.positions[:b], rows.tables[:b]
        cu = torch.arange(b + 1, dtype=torch.int64, device=dev)
        slots = torch.empty(b, dtype=torch.int64, device=dev)
        meta = AttentionMetadata(cu_seqlens_q=cu, context_lens=pos, seq_lens=pos + 1, block_tables=tables,
                                 slot_mapping=slots, max_seqlen_q=1, max_seqlen_k=self.max_model_len)
        c = self.model.config
        # the launch's selection at the capture size and the longest context (stock: FA3's split for it)
        cfg = self.kernels.attention_config(b, 1, self.max_model_len, c.num_key_value_heads,
                                            c.num_attention_heads // c.num_key_value_heads)
        r = torch.arange(b, dtype=torch.int32, device=dev)
        plan = StepPlan(tile_seq=r, tile_row=r, tile_len=torch.ones(b, dtype=torch.int32, device=dev),
                        cu=cu.to(torch.int32), context_lens=torch.zeros(b, dtype=torch.int32, device=dev),
                        block_tables=torch.zeros((b, self.max_blocks), dtype=torch.int32, device=dev),
                        num_tiles=b, num_splits=-(-self.max_model_len // cfg.split),
                        counters=split_counters(dev), one_row_each=True)

        def step() -> torch.Tensor:
            # the views the kernels read, refreshed inside the graph from the rows
            slots_of(tables, pos, size, slots)
            plan.context_lens.copy_(pos)
            plan.block_tables.copy_(tables)
            self.kernels._plan = (meta, cfg, plan)
            hidden = self.model(ids, pos, meta, self.kv_caches, self.kernels)
            return self.model.compute_logits(hidden, self.kernels)

        return step

    def _capture(self, b: int) -> Captured:
        rows = self.rows
        # the warm-up runs for real: on padding rows only (they write the scratch block), then the rows back
        saved = [buf[:b].clone() for buf in (rows.ids, rows.positions, rows.tables)]
        rows.ids[:b], rows.positions[:b], rows.tables[:b] = 0, 0, self.scratch_block
        step = self._step_at(b)
        step()  # compile and warm up outside the graph
        torch.cuda.synchronize()
        # each size's graph its own memory pool: sizes are captured as batches first reach them and replayed
        # in any order
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            logits = step()
        for buf, old in zip((rows.ids, rows.positions, rows.tables), saved):
            buf[:b] = old
        return Captured(graph.replay, logits, step)

    def size_for(self, b: int) -> int | None:
        """The capture size a step of `b` rows replays (None: larger than every size)."""
        return next((s for s in self.sizes if s >= b), None)

    def run(self, seqs: SequenceOf[Sequence], positions: SequenceOf[int]) -> Replay | None:
        """Replay the decode step of `seqs` (each feeding its token at `positions[i]`); call `rows.advance`
        with the sampled tokens (in row order) before the next step."""
        size = self.size_for(len(seqs))
        if size is None:  # (a block table never outgrows max_blocks: the scheduler keeps max_model_len)
            return None
        order = self.rows.place(seqs, positions)
        if size not in self.graphs:
            self.graphs[size] = self._capture(size)
        captured = self.graphs[size]
        captured.replay()
        return Replay(captured.logits[:len(seqs)], order)
