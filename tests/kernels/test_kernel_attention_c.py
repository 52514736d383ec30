"""The C attention (kernels/attention_c.py): a token's bits depend on its own KV and position only,
however its prompt is scheduled, at 1 and 2 threads, with or without -mavx2; close to float64; refuses what
it cannot run.

The same worlds as test_kernel_attention.py (NaN-filled caches, random block placement, random neighbours).
"""

from __future__ import annotations

import pytest
import torch

from detent_audit.errors import BadInput
from detent_audit.kernels import attention_c, reference
from detent_audit.kernels.attention import AttentionMetadata
from detent_audit.kernels.params import AttentionParams
from tests.kernels.test_kernel_attention import BLOCK, HEADS, World, _neighbours, outputs_per_schedule

pytestmark = pytest.mark.skipif(not attention_c.available(),
                                reason="no C compiler builds the C attention here")
PARAMS = [AttentionParams(16), AttentionParams(16, split_stride=32), AttentionParams(32, split_stride=64),
          AttentionParams(64, split_stride=4096)]


class CWorld(World):
    """World whose steps run the C attention (threads: torch's count unless given)."""

    arch_flags: tuple[str, ...] | None = None

    def attend(self, q, meta, params):
        return attention_c.paged_attention(q, self.k_cache, self.v_cache, meta, scale=self.dim**-0.5,
                                           params=params, arch_flags=self.arch_flags)


@pytest.mark.parametrize("heads", HEADS, ids=lambda h: f"hq{h[0]}-hkv{h[1]}-d{h[2]}")
@pytest.mark.parametrize("params", PARAMS, ids=str)
def test_token_bits_do_not_depend_on_scheduling_or_neighbours(threads, gen, heads, params):
    """One chunk, random chunks, token-by-token decode, a prefix-cache hit; each alone and among random
    neighbours at a random row: every token's bits agree (torch.equal), and none reads a NaN slot."""
    outputs = outputs_per_schedule(CWorld, gen, heads, torch.float32, params, length=70, hit=41)
    first = outputs["one_chunk"]
    assert not first.isnan().any()
    for label, out in outputs.items():
        assert torch.equal(out, first), label


def _random_step(gen, params, heads=(9, 3, 64), count=8):
    world = CWorld(gen, heads, torch.float32, params)
    q, meta = world.batch(_neighbours(world, gen, count))
    return q, world, meta


@pytest.mark.parametrize("params", PARAMS, ids=str)
def test_close_to_float64_reference(gen, params):
    q, world, meta = _random_step(gen, params)
    out = attention_c.paged_attention(q, world.k_cache, world.v_cache, meta, scale=64**-0.5, params=params)
    ref = reference.paged_attention(q, world.k_cache, world.v_cache, meta, scale=64**-0.5)
    assert not out.isnan().any()
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)


def test_thread_count_and_avx2_do_not_change_bits(gen):
    """The bits are the C source's: 1, 2 and 3 threads, the -mavx2 build and the baseline x86-64 build
    agree."""
    params = AttentionParams(32, split_stride=64)
    q, world, meta = _random_step(gen, params, count=12)
    runs = [attention_c.paged_attention(q, world.k_cache, world.v_cache, meta, scale=0.125, params=params,
                                        threads=t, arch_flags=flags)
            for t in (1, 2, 3) for flags in ((), ("-mavx2",) if _has_avx2() else ())]
    for out in runs[1:]:
        assert torch.equal(out, runs[0])


def _has_avx2() -> bool:
    return torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512")


def test_a_flipped_kv_bit_changes_only_the_tokens_that_read_it(gen):
    """Adversarial: the result is a function of the KV a token reads: flip one bit of one cached value and
    exactly the tokens whose context holds that position change."""
    params = AttentionParams(16)
    world = CWorld(gen, (4, 2, 32), torch.float32, params)
    seq = world.seq("t", 40)
    before = world.step([("t", seq, 0, 40)])[0]
    slot = world.tables["t"][25 // BLOCK] * BLOCK + 25 % BLOCK
    flat = world.v_cache.view(-1, 2, 32)
    flat[slot, 1, 3] = (flat[slot, 1, 3].view(torch.int32) ^ (1 << 20)).view(torch.float32)
    meta = AttentionMetadata.from_lengths([0], [40], torch.tensor([world.tables["t"]]), BLOCK)
    after = attention_c.paged_attention(seq.q, world.k_cache, world.v_cache, meta, scale=32**-0.5,
                                        params=params)
    changed = (after != before).any(-1).any(-1)
    assert not changed[:25].any() and changed[25:].any()
    # only KV head 1 read it: query heads 2 and 3 (group 2)
    assert torch.equal(after[:, :2], before[:, :2])


def test_refuses_what_it_cannot_run():
    meta = AttentionMetadata.from_lengths([0], [3], torch.tensor([[0]]), 4)
    cache = torch.zeros(1, 4, 1, 8)
    with pytest.raises(BadInput, match="float32"):
        attention_c.paged_attention(torch.zeros(3, 1, 8, dtype=torch.bfloat16), cache, cache, meta, scale=1.0,
                                    params=AttentionParams(16))
    with pytest.raises(BadInput, match="multiple of KV heads"):
        attention_c.paged_attention(torch.zeros(3, 3, 8), torch.zeros(1, 4, 2, 8), torch.zeros(1, 4, 2, 8),
                                    meta, scale=1.0, params=AttentionParams(16))
    with pytest.raises(BadInput, match="head size"):
        attention_c.paged_attention(torch.zeros(3, 1, 12), torch.zeros(1, 4, 1, 12), torch.zeros(1, 4, 1, 12),
                                    meta, scale=1.0, params=AttentionParams(16))
    with pytest.raises(BadInput, match="tokens"):
        attention_c.paged_attention(torch.zeros(2, 1, 8), cache, cache, meta, scale=1.0,
                                    params=AttentionParams(16))
    with pytest.raises(BadInput, match="block table"):
        attention_c.paged_attention(torch.zeros(3, 1, 8), cache, cache,
                                    AttentionMetadata.from_lengths([2], [1], torch.tensor([[0]]), 2),
                                    scale=1.0, params=AttentionParams(16))


def test_no_compiler_is_a_clear_error(monkeypatch, tmp_path):
    monkeypatch.setenv(attention_c.ENV_CC, "no-such-cc")
    monkeypatch.setenv(attention_c.ENV_CACHE, str(tmp_path))
    with pytest.raises(attention_c.Unavailable, match="no C compiler") as info:
        attention_c.build(("-DDETENT_TEST_NO_CC",))
    assert info.value.remedy
