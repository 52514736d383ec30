"""Paged KV block manager with prefix caching over chained block hashes.

Every physical block id in [0, num_blocks) is in exactly one state:
- free: ref_count 0, no hash, in the free list (FIFO);
- cached-idle: ref_count 0, hashed, in the LRU (least recently released first); a prefix hit can still reuse
  it, until a new allocation finds the free list empty and evicts it;
- in use: ref_count = the number of live block tables holding it (> 1 only for shared prefix blocks).

Prefix cache: full block i of a sequence has hash SHA-256(hash of block i-1 (32 zero bytes for i = 0) ||
its `block_size` token ids as little-endian uint32), so a hash names the whole prefix up to the block's end.
Only full blocks whose KV is computed are registered (`commit_full_blocks`); a registered block is never
written again, so sharing it is safe. A hit also compares token ids, so a hash collision is a miss.

Methods come in check/commit pairs (`can_allocate`/`allocate`, `can_append`/`append_slots`): the check never
mutates, and the commit raises `ValueError` where its check would have said no, leaving the state unchanged.
"""

from __future__ import annotations

import hashlib
import math
import struct
from collections import OrderedDict, deque
from collections.abc import Sequence as SequenceOf
from dataclasses import dataclass
from typing import NamedTuple

from detent_audit.engine.sequence import Sequence
from detent_audit.errors import BadInput
from detent_audit.runtime.sampling_params import is_int

ROOT_HASH = bytes(32)  # the parent hash of a sequence's first block


def block_hash(parent_hash: bytes, token_ids: SequenceOf[int]) -> bytes:
    """Chained content hash of one full block (the hash of its parent block, then its token ids)."""
    return hashlib.sha256(parent_hash + struct.pack(f"<{len(token_ids)}I", *token_ids)).digest()


class IntegrityError(RuntimeError):
    """An invariant of the block manager does not hold: a bug, never a user error."""


class PrefixMatch(NamedTuple):
    """The cached blocks a sequence can reuse at admission, in table order, with their chained hashes."""

    block_ids: tuple[int, ...]
    hashes: tuple[bytes, ...]


class BlockStats(NamedTuple):
    num_free_blocks: int
    num_cached_idle_blocks: int
    num_used_blocks: int
    prefix_query_tokens: int  # tokens of every admitted sequence (prompt plus outputs after a preemption)
    prefix_hit_tokens: int  # of which served from the prefix cache
    num_evictions: int


@dataclass(slots=True)
class _Block:
    ref_count: int = 0
    hash: bytes | None = None
    token_ids: tuple[int, ...] | None = None  # set exactly when `hash` is


class BlockManager:
    """Owns the physical KV blocks; mutates `block_table`, `num_cached_tokens`, `num_computed_tokens` of the
    sequences it is handed (the last two only in `allocate`)."""

    def __init__(self, num_blocks: int, block_size: int, *, prefix_caching: bool = True) -> None:
        self.prefix_caching = prefix_caching  # off: no sequence reuses cached blocks (--no-prefix-caching)
        if not is_int(num_blocks) or num_blocks < 1:
            raise BadInput(f"num_blocks must be an integer >= 1, got {num_blocks!r}")
        if not is_int(block_size) or block_size < 1:
            raise BadInput(f"block_size must be an integer >= 1, got {block_size!r}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._blocks = [_Block() for _ in range(num_blocks)]
        self._free: deque[int] = deque(range(num_blocks))
        self._lru: OrderedDict[int, None] = OrderedDict()
        self._hash_to_block: dict[bytes, int] = {}
        self._live: dict[int, Sequence] = {}  # seq_id -> sequence holding a block table
        self._chains: dict[int, list[bytes]] = {}  # seq_id -> hashes of its computed full blocks
        self._prefix_query_tokens = 0
        self._prefix_hit_tokens = 0
        self._num_evictions = 0

    @property
    def num_available_blocks(self) -> int:
        """Blocks a new allocation may take: free ones plus evictable cached-idle ones."""
        return len(self._free) + len(self._lru)

    @property
    def stats(self) -> BlockStats:
        return BlockStats(
            num_free_blocks=len(self._free),
            num_cached_idle_blocks=len(self._lru),
            num_used_blocks=self.num_blocks - len(self._free) - len(self._lru),
            prefix_query_tokens=self._prefix_query_tokens,
            prefix_hit_tokens=self._prefix_hit_tokens,
            num_evictions=self._num_evictions,
        )

    def num_blocks_for(self, num_tokens: int) -> int:
        return math.ceil(num_tokens / self.block_size)

    # admission

    def match_prefix(self, seq: Sequence) -> PrefixMatch:
        """The longest chain of cached full blocks that prefixes `seq.token_ids`. Mutates nothing.

        The last token is always recomputed (its logits are needed), so the match covers at most
        `(num_tokens - 1) // block_size` blocks, and never the positions a scoring sequence scores
        (`Sequence.cache_hit_limit`).
        """
        if not self.prefix_caching:
            return PrefixMatch((), ())
        size = self.block_size
        block_ids: list[int] = []
        hashes: list[bytes] = []
        parent = ROOT_HASH
        limit = seq.cache_hit_limit
        for i in range(limit // size):
            tokens = tuple(seq.token_ids[i * size:(i + 1) * size])
            h = block_hash(parent, tokens)
            block_id = self._hash_to_block.get(h)
            if block_id is None or self._blocks[block_id].token_ids != tokens:
                break
            block_ids.append(block_id)
            hashes.append(h)
            parent = h
        return PrefixMatch(tuple(block_ids), tuple(hashes))

    def can_allocate(self, seq: Sequence) -> bool:
        """Whether `allocate(seq)` would succeed now. Mutates nothing."""
        self._require_unallocated(seq)
        return self._num_missing_blocks(seq, self.match_prefix(seq)) <= 0

    def allocate(self, seq: Sequence) -> None:
        """Admit `seq`: reuse its cached prefix, take new blocks for all its other tokens.

        Sets `num_cached_tokens = num_computed_tokens` = the hit (whole blocks). Raises `ValueError` if
        `seq` already holds blocks, has computed tokens, or does not fit (see `can_allocate`).
        """
        self._require_unallocated(seq)
        match = self.match_prefix(seq)
        missing = self._num_missing_blocks(seq, match)
        if missing > 0:
            raise ValueError(f"seq {seq.seq_id}: allocate needs {missing} more blocks than are available")
        for block_id in match.block_ids:  # before taking new blocks, so a hit is never evicted
            block = self._blocks[block_id]
            if block.ref_count == 0:
                del self._lru[block_id]
            block.ref_count += 1
        num_new = self.num_blocks_for(seq.num_tokens) - len(match.block_ids)
        seq.block_table = list(match.block_ids) + [self._take_block() for _ in range(num_new)]
        seq.num_cached_tokens = seq.num_computed_tokens = len(match.block_ids) * self.block_size
        self._live[seq.seq_id] = seq
        self._chains[seq.seq_id] = list(match.hashes)
        self._prefix_query_tokens += seq.num_tokens
        self._prefix_hit_tokens += seq.num_cached_tokens

    # growth, commit and release

    def can_append(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Whether the next `num_new_tokens` tokens of `seq` (from `num_computed_tokens`) can get slots."""
        self._require_live(seq)
        needed = self.num_blocks_for(seq.num_computed_tokens + num_new_tokens) - len(seq.block_table)
        return needed <= self.num_available_blocks

    def append_slots(self, seq: Sequence, num_new_tokens: int) -> None:
        """Grow `seq.block_table` to cover positions [0, num_computed_tokens + num_new_tokens)."""
        self._require_live(seq)
        end = seq.num_computed_tokens + num_new_tokens
        if num_new_tokens < 1 or end > seq.num_tokens:
            raise ValueError(
                f"seq {seq.seq_id}: cannot compute {num_new_tokens} tokens from position "
                f"{seq.num_computed_tokens} of {seq.num_tokens}"
            )
        if not self.can_append(seq, num_new_tokens):
            raise ValueError(f"seq {seq.seq_id}: append_slots({num_new_tokens}) without free blocks")
        self.grow(seq, end)

    def grow(self, seq: Sequence, num_positions: int) -> None:
        """Grow `seq.block_table` to cover positions [0, num_positions), past its tokens (a step scheduled
        ahead writes the KV of a token not yet appended). Raises `ValueError` without free blocks."""
        self._require_live(seq)
        if self.num_blocks_for(num_positions) - len(seq.block_table) > self.num_available_blocks:
            raise ValueError(f"seq {seq.seq_id}: grow({num_positions}) without free blocks")
        while len(seq.block_table) < self.num_blocks_for(num_positions):
            seq.block_table.append(self._take_block())

    def commit_full_blocks(self, seq: Sequence) -> None:
        """Register the full blocks of `seq` whose KV is now computed in the prefix cache.

        A block whose content is already cached in another block (two sequences computed the same prefix
        at once) stays unregistered: the first copy remains the cached one.
        """
        self._require_live(seq)
        chain = self._chains[seq.seq_id]
        size = self.block_size
        if len(chain) >= seq.num_computed_tokens // size:  # no block filled since (most decode steps)
            return
        for i in range(len(chain), seq.num_computed_tokens // size):
            tokens = tuple(seq.token_ids[i * size:(i + 1) * size])
            h = block_hash(chain[-1] if chain else ROOT_HASH, tokens)
            chain.append(h)
            if h in self._hash_to_block:
                continue
            block_id = seq.block_table[i]
            block = self._blocks[block_id]
            block.hash, block.token_ids = h, tokens
            self._hash_to_block[h] = block_id

    def free(self, seq: Sequence) -> None:
        """Release every block of `seq` (last block first, so a prefix's tail is evicted before its head);
        cached blocks whose ref_count drops to 0 go to the LRU, others to the free list."""
        self._require_live(seq)
        for block_id in reversed(seq.block_table):
            block = self._blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                if block.hash is None:
                    self._free.append(block_id)
                else:
                    self._lru[block_id] = None
        seq.block_table = []
        del self._live[seq.seq_id]
        del self._chains[seq.seq_id]

    def slot_mapping(self, seq: Sequence, start: int, end: int) -> list[int]:
        """Cache slots (block_id * block_size + offset) of token positions [start, end) of `seq`."""
        self._require_live(seq)
        if not (0 <= start <= end <= len(seq.block_table) * self.block_size):
            raise ValueError(
                f"seq {seq.seq_id}: positions [{start}, {end}) outside its "
                f"{len(seq.block_table)} blocks of {self.block_size}"
            )
        size, table = self.block_size, seq.block_table
        return [table[pos // size] * size + pos % size for pos in range(start, end)]

    def cached_blocks(self) -> dict[int, tuple[int, ...]]:
        """Block id -> token ids of every block registered in the prefix cache, by block id."""
        return {
            block_id: block.token_ids
            for block_id, block in enumerate(self._blocks)
            if block.token_ids is not None
        }

    # internals

    def _num_missing_blocks(self, seq: Sequence, match: PrefixMatch) -> int:
        idle_hits = sum(1 for b in match.block_ids if self._blocks[b].ref_count == 0)
        needed = self.num_blocks_for(seq.num_tokens) - len(match.block_ids)
        return needed - (self.num_available_blocks - idle_hits)

    def _take_block(self) -> int:
        if self._free:
            block_id = self._free.popleft()
        else:
            block_id, _ = self._lru.popitem(last=False)
            block = self._blocks[block_id]
            assert block.hash is not None, "a block in the LRU is a cached (hashed) one"
            del self._hash_to_block[block.hash]
            block.hash = block.token_ids = None
            self._num_evictions += 1
        self._blocks[block_id].ref_count = 1
        return block_id

    def _require_unallocated(self, seq: Sequence) -> None:
        if seq.seq_id in self._live or seq.block_table or seq.num_computed_tokens:
            raise ValueError(f"seq {seq.seq_id}: already holds blocks or computed tokens")

    def _require_live(self, seq: Sequence) -> None:
        if self._live.get(seq.seq_id) is not seq:
            raise ValueError(f"seq {seq.seq_id}: holds no blocks in this block manager")

    # integrity

    def check_integrity(self) -> None:
        """Raise `IntegrityError` naming the first invariant that fails (see the module docstring)."""
        n, size = self.num_blocks, self.block_size
        holders: dict[int, list[int]] = {}
        if sorted(self._live) != sorted(self._chains):
            raise IntegrityError(f"live seqs {sorted(self._live)} but hash chains for {sorted(self._chains)}")
        for seq_id, seq in sorted(self._live.items()):
            table = seq.block_table
            if seq.seq_id != seq_id:
                raise IntegrityError(f"live entry {seq_id} holds seq {seq.seq_id}")
            for block_id in table:
                if not (is_int(block_id) and 0 <= block_id < n):
                    raise IntegrityError(f"seq {seq_id}: block id {block_id!r} out of range [0, {n})")
                holders.setdefault(block_id, []).append(seq_id)
            if len(set(table)) != len(table):
                raise IntegrityError(f"seq {seq_id}: block table {table} holds a block twice")
            capacity = min(seq.num_tokens, len(table) * size)
            if not (0 <= seq.num_cached_tokens <= seq.num_computed_tokens <= capacity):
                raise IntegrityError(
                    f"seq {seq_id}: need 0 <= cached {seq.num_cached_tokens} <= computed "
                    f"{seq.num_computed_tokens} <= min(tokens {seq.num_tokens}, {len(table)} blocks * {size})"
                )
            chain = self._chains[seq_id]
            if len(chain) > seq.num_computed_tokens // size:
                raise IntegrityError(
                    f"seq {seq_id}: {len(chain)} hashed blocks but only "
                    f"{seq.num_computed_tokens} computed tokens"
                )
            parent = ROOT_HASH
            for i, h in enumerate(chain):
                tokens = tuple(seq.token_ids[i * size:(i + 1) * size])
                if block_hash(parent, tokens) != h:
                    raise IntegrityError(f"seq {seq_id}: hash of block {i} does not match its tokens")
                parent = h
            for i, block_id in enumerate(table):
                block = self._blocks[block_id]
                if block.hash is not None and (i >= len(chain) or block.hash != chain[i]):
                    raise IntegrityError(
                        f"seq {seq_id}: table entry {i} is cached block {block_id} of another prefix"
                    )
        free_set, lru_set = set(self._free), set(self._lru)
        if len(free_set) != len(self._free):
            raise IntegrityError(f"free list {list(self._free)} holds a block twice")
        for block_id in sorted(free_set | lru_set):
            if not (is_int(block_id) and 0 <= block_id < n):
                raise IntegrityError(f"free list or LRU: block id {block_id!r} out of range [0, {n})")
        for block_id, block in enumerate(self._blocks):
            states = [name for name, inside in (
                ("free", block_id in free_set), ("cached-idle", block_id in lru_set),
                ("in use", block.ref_count > 0),
            ) if inside]
            if len(states) != 1:
                raise IntegrityError(
                    f"block {block_id}: in states {states or 'none'} (ref_count {block.ref_count})"
                )
            held_by = holders.get(block_id, [])
            if block.ref_count != len(held_by):
                raise IntegrityError(
                    f"block {block_id}: ref_count {block.ref_count} but held by {len(held_by)} live block "
                    f"tables (seqs {held_by})"
                )
            if (block.hash is None) != (block.token_ids is None):
                raise IntegrityError(f"block {block_id}: hash and token ids must be set together")
            if block.hash is None and block_id in lru_set:
                raise IntegrityError(f"block {block_id}: in the LRU without a hash")
            if block.hash is not None and block_id in free_set:
                raise IntegrityError(f"block {block_id}: in the free list with a hash")
            mapped = self._hash_to_block.get(block.hash) if block.hash is not None else None
            if block.hash is not None and mapped != block_id:
                raise IntegrityError(f"block {block_id}: its hash maps to block {mapped}")
            if block.token_ids is not None and len(block.token_ids) != size:
                raise IntegrityError(
                    f"block {block_id}: cached with {len(block.token_ids)} tokens, not {size}"
                )
        for h, block_id in self._hash_to_block.items():
            if not (0 <= block_id < n) or self._blocks[block_id].hash != h:
                raise IntegrityError(f"hash {h.hex()[:16]} maps to block {block_id}, which does not carry it")
