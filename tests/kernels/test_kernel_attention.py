"""paged_attention: a token's bits depend only on its own KV and position, however its prompt is scheduled.

Caches start as NaN, so reading a slot a sequence does not own (or has not written) poisons the output.

What kernels/attention.py relies on, measured on a CPU (torch 2.13 / MKL, fp32, 1-8 threads):
- for a fixed element shape and operand layout, a torch.bmm element's bits do not depend on the batch count B
  nor on whether an operand is an expanded (stride-0) view or a copy, PROVIDED B >= 2: with B == 1 MKL
  threads the single product and splits its M rows (bits change for G = 7 at 2 and 8 threads);
- the operand layout does change bits (a [D, tile] operand given transposed vs contiguous), so both paths
  build Q [G, D] and P [G, tile] contiguous, K^T as the transpose of a contiguous [tile, D], V a contiguous
  [tile, D];
- exp, amax/sum over the last dim and the elementwise updates are position-invariant
  (test_kernel_rowlocal.py);
- stock SDPA: a sequence's bits change when a longer neighbour raises max_seqlen_k (fp32 and bf16, 1 and 2
  threads), and in fp32 a token decoded alone differs from the same token's row in its prefill.
The group-7 case below makes a lone decode token one bmm element, so the padding is exercised.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import pytest
import torch

from detent_audit.errors import BadInput
from detent_audit.kernels import reference
from detent_audit.kernels.attention import AttentionMetadata, paged_attention, write_kv
from detent_audit.kernels.params import AttentionParams

PARAMS = [AttentionParams(16), AttentionParams(16, split_stride=32), AttentionParams(32, split_stride=64)]
# (Hq, Hkv, D): GQA group 2, and group 7 with one KV head (a lone decode token is then one bmm element).
HEADS = [(4, 2, 32), (7, 1, 64)]
BLOCK = 8
# Against float64 from the same inputs: fp32 rounding is ~1e-7 per op on O(1) values; bf16 outputs are
# rounded to 8 bits (|out| < 4, so <= 2^-6 absolute).
TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.bfloat16: dict(rtol=1e-2, atol=2e-2)}


class Seq(NamedTuple):
    q: torch.Tensor  # [L, Hq, D]
    k: torch.Tensor  # [L, Hkv, D]
    v: torch.Tensor  # [L, Hkv, D]


class World:
    """A NaN-filled paged cache; sequences get randomly placed blocks; steps run one varlen call."""

    def __init__(self, gen, heads, dtype, params, num_blocks=4096):
        self.gen, (self.hq, self.hkv, self.dim), self.dtype, self.params = gen, heads, dtype, params
        shape = (num_blocks, BLOCK, self.hkv, self.dim)
        self.k_cache = torch.full(shape, math.nan, dtype=dtype)
        self.v_cache = torch.full(shape, math.nan, dtype=dtype)
        self.free = torch.randperm(num_blocks, generator=gen).tolist()
        self.tables: dict[str, list[int]] = {}

    def seq(self, name: str, length: int) -> Seq:
        self.tables[name] = [self.free.pop() for _ in range(-(-length // BLOCK))]
        noise = lambda h: torch.randn(length, h, self.dim, generator=self.gen).to(self.dtype)  # noqa: E731
        return Seq(noise(self.hq), noise(self.hkv), noise(self.hkv))

    def cache_prefix(self, name: str, seq: Seq, upto: int) -> None:
        """A prefix-cache hit: positions < upto are already in the cache (written by someone else)."""
        slots = torch.tensor([self.tables[name][p // BLOCK] * BLOCK + p % BLOCK for p in range(upto)],
                             dtype=torch.int64)
        write_kv(seq.k[:upto], seq.v[:upto], self.k_cache, self.v_cache, slots)

    def batch(self, entries: list[tuple[str, Seq, int, int]]) -> tuple[torch.Tensor, AttentionMetadata]:
        """entries: (name, seq, start, length) -> the step's queries and metadata, its KV written."""
        width = max(len(self.tables[name]) for name, *_ in entries)
        tables = torch.tensor([self.tables[n] + [-1] * (width - len(self.tables[n])) for n, *_ in entries])
        meta = AttentionMetadata.from_lengths([e[2] for e in entries], [e[3] for e in entries], tables, BLOCK)
        rows = lambda t: torch.cat([getattr(s, t)[a : a + n] for _, s, a, n in entries])  # noqa: E731
        write_kv(rows("k"), rows("v"), self.k_cache, self.v_cache, meta.slot_mapping)
        return rows("q"), meta

    def attend(self, q: torch.Tensor, meta: AttentionMetadata, params: AttentionParams) -> torch.Tensor:
        """The attention under test (the torch one here)."""
        return paged_attention(q, self.k_cache, self.v_cache, meta, scale=self.dim**-0.5, params=params)

    def step(self, entries: list[tuple[str, Seq, int, int]], params=None) -> list[torch.Tensor]:
        """entries: (name, seq, start, length) -> each entry's attention output [length, Hq, D]."""
        q, meta = self.batch(entries)
        out = self.attend(q, meta, self.params if params is None else params)
        return list(out.split([e[3] for e in entries]))


def _neighbours(world: World, gen, count: int) -> list[tuple[str, Seq, int, int]]:
    """Random other sequences: some decoding, some mid-prefill, with context already cached."""
    entries = []
    for _ in range(count):
        name = f"n{len(world.tables)}"
        context = int(torch.randint(0, 60, (1,), generator=gen))
        qlen = 1 if torch.rand(1, generator=gen) < 0.5 else int(torch.randint(2, 20, (1,), generator=gen))
        seq = world.seq(name, context + qlen)
        world.cache_prefix(name, seq, context)
        entries.append((name, seq, context, qlen))
    return entries


def outputs_per_schedule(world_type: type[World], gen, heads, dtype, params, *, length: int,
                         hit: int) -> dict[str, torch.Tensor]:
    """One prompt of `length` tokens in every schedule (`_schedules`), alone and among random neighbours at a
    random row of each step, and after a prefix-cache hit of `hit` tokens: schedule -> its outputs."""
    outputs: dict[str, torch.Tensor] = {}
    template = World(gen, heads, dtype, params).seq("t", length)
    for label, schedule in _schedules(gen, length).items():
        for crowded in (False, True):
            world = world_type(gen, heads, dtype, params)
            seq = world.seq("t", length)._replace(**template._asdict())
            got = []
            for start, end in schedule:
                others = _neighbours(world, gen,
                                     int(torch.randint(1, 5, (1,), generator=gen))) if crowded else []
                at = int(torch.randint(0, len(others) + 1, (1,), generator=gen))
                entries = others[:at] + [("t", seq, start, end - start)] + others[at:]
                got.append(world.step(entries)[at])
            outputs[f"{label}{'+neighbours' if crowded else ''}"] = torch.cat(got)
    for crowded in (False, True):
        world = world_type(gen, heads, dtype, params)
        seq = world.seq("t", length)._replace(**template._asdict())
        world.cache_prefix("t", seq, hit)
        others = _neighbours(world, gen, 3) if crowded else []
        after = world.step(others + [("t", seq, hit, length - hit)])[-1]
        name = f"prefix_hit{'+neighbours' if crowded else ''}"
        outputs[name] = torch.cat([outputs["one_chunk"][:hit], after])
    return outputs


def _schedules(gen, length: int) -> dict[str, list[list[int]]]:
    """Ways to process one prompt: lists of chunk boundaries [start, end) per step."""
    cuts = sorted(set(torch.randint(1, length, (5,), generator=gen).tolist()))
    bounds = [0, *cuts, length]
    return {
        "one_chunk": [[0, length]],
        "random_chunks": [[a, b] for a, b in zip(bounds, bounds[1:], strict=False)],
        "decode": [[0, 1]] + [[p, p + 1] for p in range(1, length)],
    }


F32, BF16 = torch.float32, torch.bfloat16
CASES = [(F32, HEADS[0], p) for p in PARAMS] + [(BF16, HEADS[0], PARAMS[1]), (F32, HEADS[1], PARAMS[0]),
                                                (BF16, HEADS[1], PARAMS[2])]


def _case_id(case) -> str:
    dtype, (hq, hkv, _), p = case
    return f"{str(dtype)[6:]}-hq{hq}-hkv{hkv}-tile{p.kv_tile}-split{p.split_stride}"


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_token_bits_do_not_depend_on_scheduling_or_neighbours(threads, gen, case):
    """One chunk, random chunks, token-by-token decode, a prefix-cache hit; each alone and among random
    neighbours (prefills and decodes) at a random row of the varlen batch: every token's bits agree."""
    dtype, heads, params = case
    outputs = outputs_per_schedule(World, gen, heads, dtype, params, length=50, hit=29)
    first = outputs["one_chunk"]
    assert not first.isnan().any()
    for label, out in outputs.items():
        assert torch.equal(out, first), label


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("params", [None, *PARAMS, AttentionParams(64)], ids=str)
def test_close_to_float64_reference(gen, dtype, params):
    world = World(gen, (4, 2, 32), dtype, params)
    entries = _neighbours(world, gen, 6)
    out = torch.cat(world.step(entries))
    meta_entries = [(c, n) for _, _, c, n in entries]
    width = max(len(t) for t in world.tables.values())
    tables = torch.tensor([world.tables[e[0]] + [-1] * (width - len(world.tables[e[0]])) for e in entries])
    meta = AttentionMetadata.from_lengths([c for c, _ in meta_entries], [n for _, n in meta_entries],
                                          tables, BLOCK)
    q = torch.cat([s.q[a : a + n] for _, s, a, n in entries])
    ref = reference.paged_attention(q, world.k_cache, world.v_cache, meta, scale=32**-0.5)
    torch.testing.assert_close(out.double(), ref, **TOL[dtype])


def test_stock_is_batch_variant(gen):
    """Recorded fact: stock pads to the batch's max_seqlen_k, and SDPA's bits move with the padding."""
    world = World(gen, (4, 2, 32), torch.float32, None)
    seq = world.seq("t", 60)
    alone = world.step([("t", seq, 0, 60)])[0]
    long = world.seq("long", 150)
    world.cache_prefix("long", long, 149)
    crowded = world.step([("t", seq, 0, 60), ("long", long, 149, 1)])[0]
    if torch.equal(alone, crowded):
        pytest.skip("stock SDPA happened to be invariant to max_seqlen_k padding here")
    assert not torch.equal(alone, crowded)


def test_write_kv_writes_its_slots_only(randn):
    k_cache, v_cache = randn(4, 4, 2, 8), randn(4, 4, 2, 8)
    before_k, before_v = k_cache.clone(), v_cache.clone()
    k, v = randn(3, 2, 8, dtype=torch.bfloat16), randn(3, 2, 8, dtype=torch.bfloat16)
    write_kv(k, v, k_cache, v_cache, torch.tensor([5, -1, 14]))
    flat_k, flat_v = k_cache.view(16, 2, 8), v_cache.view(16, 2, 8)
    assert torch.equal(flat_k[[5, 14]], k[[0, 2]].float()) and torch.equal(flat_v[[5, 14]], v[[0, 2]].float())
    untouched = [i for i in range(16) if i not in (5, 14)]
    assert torch.equal(flat_k[untouched], before_k.view(16, 2, 8)[untouched])
    assert torch.equal(flat_v[untouched], before_v.view(16, 2, 8)[untouched])


def test_metadata_validation_and_int32_inputs():
    tables = torch.tensor([[3, 1], [0, 2]], dtype=torch.int32)
    meta = AttentionMetadata.from_lengths([2, 0], [3, 1], tables, 4)
    assert meta.slot_mapping.tolist() == [14, 15, 4, 0] and meta.cu_seqlens_q.tolist() == [0, 3, 4]
    assert (meta.max_seqlen_q, meta.max_seqlen_k, meta.num_seqs, meta.num_tokens) == (3, 5, 2, 4)
    as_int32 = AttentionMetadata(
        cu_seqlens_q=meta.cu_seqlens_q.int(), context_lens=meta.context_lens.int(),
                                 seq_lens=meta.seq_lens.int(),
        block_tables=tables, slot_mapping=meta.slot_mapping, max_seqlen_q=3, max_seqlen_k=5)
    assert as_int32.block_tables.dtype == torch.int64 and as_int32.context_lens.dtype == torch.int64
    with pytest.raises(BadInput):
        AttentionMetadata.from_lengths([0], [9], torch.tensor([[0, 1]]), 4)
    with pytest.raises(BadInput):
        AttentionMetadata(meta.cu_seqlens_q[:2], meta.context_lens, meta.seq_lens, meta.block_tables,
                          meta.slot_mapping, 3, 5)
    with pytest.raises(BadInput):
        paged_attention(torch.zeros(4, 3, 8), torch.zeros(4, 4, 2, 8), torch.zeros(4, 4, 2, 8), meta,
                        scale=1.0, params=AttentionParams(16))
