"""BlockManager: allocation, prefix caching with chained hashes, LRU eviction, and `check_integrity`."""

from __future__ import annotations

import random

import pytest

from detent_audit.engine.block_manager import ROOT_HASH, BlockManager, IntegrityError, block_hash
from detent_audit.engine.sequence import ScoreSpec, Sequence
from detent_audit.errors import BadInput
from detent_audit.runtime.sampling_params import SamplingParams

BS = 4
PARAMS = SamplingParams(max_tokens=8)


def make_seq(seq_id: int, tokens: list[int]) -> Sequence:
    return Sequence(seq_id, tokens, PARAMS)


def compute(bm: BlockManager, seq: Sequence, num_tokens: int | None = None) -> None:
    """Pretend the runner computed the next `num_tokens` tokens (all by default), then commit."""
    num_tokens = seq.num_uncomputed_tokens if num_tokens is None else num_tokens
    bm.append_slots(seq, num_tokens)
    seq.num_computed_tokens += num_tokens
    bm.commit_full_blocks(seq)
    bm.check_integrity()


def random_tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(1000) for _ in range(n)]


def test_allocate_and_free_return_every_block() -> None:
    rng = random.Random(1)
    bm = BlockManager(num_blocks=8, block_size=BS)
    seq = make_seq(0, random_tokens(rng, 10))
    assert bm.can_allocate(seq)
    bm.allocate(seq)
    assert len(seq.block_table) == 3 and seq.num_cached_tokens == seq.num_computed_tokens == 0
    compute(bm, seq)
    assert bm.stats.num_used_blocks == 3
    bm.free(seq)
    bm.check_integrity()
    # the 2 full blocks stay cached (idle), the partial one is free again
    assert seq.block_table == [] and bm.stats.num_cached_idle_blocks == 2 and bm.stats.num_free_blocks == 6


def test_prefix_hit_shares_full_blocks_and_recomputes_the_last_token() -> None:
    rng = random.Random(2)
    bm = BlockManager(num_blocks=16, block_size=BS)
    prefix = random_tokens(rng, 3 * BS)
    a = make_seq(0, prefix + random_tokens(rng, 2))
    bm.allocate(a)
    compute(bm, a)
    b = make_seq(1, prefix + random_tokens(rng, 5))
    bm.allocate(b)
    bm.check_integrity()
    assert b.block_table[:3] == a.block_table[:3] and b.num_cached_tokens == b.num_computed_tokens == 3 * BS
    assert bm.stats.prefix_hit_tokens == 3 * BS
    # a prompt of exactly 3 cached blocks hits only 2: its last token must be recomputed for its logits
    c = make_seq(2, list(prefix))
    bm.allocate(c)
    assert c.num_cached_tokens == 2 * BS and c.block_table[:2] == a.block_table[:2]
    assert c.block_table[2] != a.block_table[2]
    bm.check_integrity()
    # the cached blocks hold the prefix's tokens, block by block
    cached = bm.cached_blocks()
    for i in range(3):
        assert cached[a.block_table[i]] == tuple(prefix[i * BS:(i + 1) * BS])
    # a different first block breaks the chain even where later blocks are equal
    d = make_seq(3, random_tokens(rng, BS) + prefix[BS:] + [7])
    assert bm.match_prefix(d).block_ids == ()


@pytest.mark.parametrize("first", [1, 2, BS + 1, 2 * BS, 2 * BS + 3])
def test_a_scoring_sequence_reuses_no_cached_block_whose_logits_it_scores(first: int) -> None:
    """The hit stops before the first position whose logits score a target (`Sequence.cache_hit_limit`), so
    those rows are computed, never served from another request's cache; a prefix-caching block manager off
    reuses nothing."""
    rng = random.Random()
    bm = BlockManager(num_blocks=32, block_size=BS)
    prefix = random_tokens(rng, 4 * BS)
    a = make_seq(0, prefix + [1])
    bm.allocate(a)
    compute(bm, a)
    tokens = prefix + random_tokens(rng, 3)
    scored = Sequence(1, tokens, PARAMS, score=ScoreSpec(first, PARAMS, tuple(tokens[first:]) + (5,)))
    assert scored.cache_hit_limit == first - 1
    bm.allocate(scored)
    assert scored.num_cached_tokens == (first - 1) // BS * BS <= first - 1
    assert make_seq(2, tokens).cache_hit_limit == len(tokens) - 1  # a plain request: all but its last token
    off = BlockManager(num_blocks=32, block_size=BS, prefix_caching=False)
    assert off.match_prefix(make_seq(3, tokens)).block_ids == ()


def test_chained_hash_names_the_whole_prefix() -> None:
    rng = random.Random(3)
    first, second = random_tokens(rng, BS), random_tokens(rng, BS)
    h1 = block_hash(ROOT_HASH, first)
    assert block_hash(h1, second) != block_hash(ROOT_HASH, second)
    assert block_hash(h1, second) == block_hash(block_hash(ROOT_HASH, list(first)), tuple(second))


def test_lru_evicts_least_recently_released_and_tail_first() -> None:
    rng = random.Random(4)
    bm = BlockManager(num_blocks=4, block_size=BS)
    a = make_seq(0, random_tokens(rng, 2 * BS + 1))
    bm.allocate(a)
    compute(bm, a)
    a_blocks = list(a.block_table)
    bm.free(a)
    assert bm.stats.num_cached_idle_blocks == 2 and bm.stats.num_free_blocks == 2
    # a new 3-block sequence takes the 2 free blocks, then evicts a's *tail* block, keeping its head cached
    b = make_seq(1, random_tokens(rng, 3 * BS))
    bm.allocate(b)
    bm.check_integrity()
    assert bm.stats.num_evictions == 1 and a_blocks[1] in b.block_table
    assert list(bm.cached_blocks()) == [a_blocks[0]]
    # a's head block is still a prefix hit
    a2 = make_seq(2, a.token_ids[:BS] + [5])
    assert bm.match_prefix(a2).block_ids == (a_blocks[0],)
    assert not bm.can_allocate(a2)  # the hit is free of charge, but no block is left for its tail
    bm.free(b)
    bm.allocate(a2)
    assert a2.num_cached_tokens == BS and a2.block_table[0] == a_blocks[0]
    bm.check_integrity()


def test_can_allocate_does_not_count_idle_hit_blocks_as_available() -> None:
    rng = random.Random(5)
    bm = BlockManager(num_blocks=3, block_size=BS)
    a = make_seq(0, random_tokens(rng, 2 * BS))
    bm.allocate(a)
    compute(bm, a)
    bm.free(a)
    # 1 free + 2 idle cached; a 4-block sequence hitting 1 cached block needs 3 more, only 2 remain
    b = make_seq(1, a.token_ids[:BS] + random_tokens(rng, 3 * BS))
    assert len(bm.match_prefix(b).block_ids) == 1 and not bm.can_allocate(b)
    with pytest.raises(ValueError, match="needs 1 more blocks"):
        bm.allocate(b)
    bm.check_integrity()
    assert b.block_table == [] and bm.stats.num_cached_idle_blocks == 2


def test_same_content_computed_twice_keeps_the_first_copy_cached() -> None:
    rng = random.Random(6)
    bm = BlockManager(num_blocks=8, block_size=BS)
    prompt = random_tokens(rng, 2 * BS + 1)
    a, b = make_seq(0, prompt), make_seq(1, prompt)
    bm.allocate(a)
    bm.allocate(b)  # a has computed nothing yet: no hit
    assert b.num_cached_tokens == 0
    compute(bm, a)
    compute(bm, b)
    assert sorted(bm.cached_blocks()) == sorted(a.block_table[:2])
    bm.free(b)
    bm.free(a)
    bm.check_integrity()
    assert bm.stats.num_cached_idle_blocks == 2 and bm.stats.num_free_blocks == 6


def test_append_slots_grows_at_block_boundaries() -> None:
    rng = random.Random(7)
    bm = BlockManager(num_blocks=4, block_size=BS)
    seq = make_seq(0, random_tokens(rng, BS))
    bm.allocate(seq)
    compute(bm, seq)
    for step in range(2 * BS):
        seq.append_token(rng.randrange(1000))
        blocks_before = len(seq.block_table)
        compute(bm, seq, 1)
        position = BS + step
        assert len(seq.block_table) == blocks_before + (position % BS == 0)
    assert bm.slot_mapping(seq, 0, seq.num_computed_tokens) == [
        seq.block_table[p // BS] * BS + p % BS for p in range(seq.num_computed_tokens)
    ]
    # 12 tokens computed in 3 blocks: the 13th needs a 4th block, the last one in the pool
    seq.append_token(rng.randrange(1000))
    assert len(seq.block_table) == 3 and bm.can_append(seq, 1)
    other = make_seq(1, random_tokens(rng, 2))
    bm.allocate(other)
    assert not bm.can_append(seq, 1)
    with pytest.raises(ValueError, match="append_slots\\(1\\) without free blocks"):
        bm.append_slots(seq, 1)
    bm.check_integrity()


def test_misuse_raises_with_the_reason() -> None:
    rng = random.Random(8)
    with pytest.raises(BadInput, match="num_blocks must be an integer >= 1, got 0"):
        BlockManager(0, BS)
    with pytest.raises(BadInput, match="block_size must be an integer >= 1, got 2.0"):
        BlockManager(4, 2.0)  # type: ignore[arg-type]
    bm = BlockManager(num_blocks=4, block_size=BS)
    seq = make_seq(0, random_tokens(rng, 5))
    with pytest.raises(ValueError, match="seq 0: holds no blocks"):
        bm.free(seq)
    bm.allocate(seq)
    with pytest.raises(ValueError, match="seq 0: already holds blocks"):
        bm.allocate(seq)
    with pytest.raises(ValueError, match=r"positions \[0, 9\) outside its 2 blocks of 4"):
        bm.slot_mapping(seq, 0, 9)
    with pytest.raises(ValueError, match="cannot compute 6 tokens from position 0 of 5"):
        bm.append_slots(seq, 6)


def _corrupt_refcount(bm: BlockManager) -> None:
    bm._blocks[0].ref_count += 1


def _corrupt_free_twice(bm: BlockManager) -> None:
    bm._free.append(bm._free[0])


def _corrupt_free_and_lru(bm: BlockManager) -> None:
    block_id = next(iter(bm._lru))
    bm._free.append(block_id)


def _corrupt_hash_map(bm: BlockManager) -> None:
    h = next(iter(bm._hash_to_block))
    bm._hash_to_block[h] = (bm._hash_to_block[h] + 1) % bm.num_blocks


def _corrupt_out_of_range(bm: BlockManager) -> None:
    seq = next(iter(bm._live.values()))
    seq.block_table.append(bm.num_blocks)


def _corrupt_lost_block(bm: BlockManager) -> None:
    bm._free.pop()


def _corrupt_cached_tokens(bm: BlockManager) -> None:
    seq = next(iter(bm._live.values()))
    seq.token_ids[0] += 1


@pytest.mark.parametrize(
    ("corrupt", "message"),
    [
        (_corrupt_refcount, r"block 0: ref_count 2 but held by 1 live block tables \(seqs \[1\]\)"),
        (_corrupt_free_twice, r"free list .* holds a block twice"),
        (_corrupt_free_and_lru, r"block \d+: in states \['free', 'cached-idle'\]"),
        (_corrupt_hash_map, r"maps to block \d+, which does not carry it|its hash maps to block"),
        (_corrupt_out_of_range, r"seq 1: block id 8 out of range \[0, 8\)"),
        (_corrupt_lost_block, r"block 2: in states none"),
        (_corrupt_cached_tokens, r"seq 1: hash of block 0 does not match its tokens"),
    ],
)
def test_check_integrity_names_the_broken_invariant(corrupt, message: str) -> None:
    rng = random.Random(9)
    bm = BlockManager(num_blocks=8, block_size=BS)
    first = make_seq(0, random_tokens(rng, 2 * BS + 1))
    bm.allocate(first)
    compute(bm, first)
    bm.free(first)  # 2 cached-idle blocks
    live = make_seq(1, first.token_ids[:BS] + random_tokens(rng, 3))  # hits block 0 of `first`
    bm.allocate(live)
    bm.check_integrity()
    assert live.block_table[0] == 0
    corrupt(bm)
    with pytest.raises(IntegrityError, match=message):
        bm.check_integrity()


@pytest.mark.parametrize("seed", range(6))
def test_random_operations_keep_every_invariant(seed: int) -> None:
    """Random admissions, chunks, decodes and releases over a small pool with shared prefixes; after every
    operation the invariants hold and every cached block holds exactly the tokens written into its slots."""
    rng = random.Random(seed)
    bm = BlockManager(num_blocks=rng.randint(6, 14), block_size=rng.choice([1, 2, 4]))
    size = bm.block_size
    prefixes = [random_tokens(rng, rng.randint(1, 3 * size)) for _ in range(3)]
    written: dict[int, int] = {}  # slot -> token id whose KV the fake runner wrote there
    live: list[Sequence] = []
    hits = 0
    for seq_id in range(300):
        op = rng.random()
        if op < 0.3 or not live:
            tokens = rng.choice(prefixes) + random_tokens(rng, rng.randint(1, 2 * size))
            seq = make_seq(seq_id, tokens[: bm.num_blocks * size])
            if bm.can_allocate(seq):
                bm.allocate(seq)
                assert seq.num_cached_tokens % size == 0 and seq.num_cached_tokens <= seq.num_tokens - 1
                hits += seq.num_cached_tokens > 0
                live.append(seq)
            else:
                with pytest.raises(ValueError):
                    bm.allocate(seq)
        elif op < 0.8:
            seq = rng.choice(live)
            if seq.num_uncomputed_tokens == 0:
                seq.append_token(rng.randrange(1000))
            n = rng.randint(1, seq.num_uncomputed_tokens)
            if bm.can_append(seq, n):
                bm.append_slots(seq, n)
                cached_before = bm.cached_blocks()
                for pos, slot in zip(
                    range(seq.num_computed_tokens, seq.num_computed_tokens + n),
                    bm.slot_mapping(seq, seq.num_computed_tokens, seq.num_computed_tokens + n),
                    strict=True,
                ):
                    assert slot // size not in cached_before, "wrote into a cached block"
                    written[slot] = seq.token_ids[pos]
                seq.num_computed_tokens += n
                bm.commit_full_blocks(seq)
        else:
            seq = live.pop(rng.randrange(len(live)))
            bm.free(seq)
        bm.check_integrity()
        for block_id, tokens in bm.cached_blocks().items():
            assert tuple(written[block_id * size + i] for i in range(size)) == tokens
        for seq in live:  # a live sequence reads back its own tokens through its block table
            slots = bm.slot_mapping(seq, 0, seq.num_computed_tokens)
            assert [written[s] for s in slots] == seq.token_ids[: seq.num_computed_tokens]
    assert hits > 0 and bm.stats.prefix_hit_tokens > 0
