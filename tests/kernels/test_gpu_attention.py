"""GPU tier: the Triton paged attention gives a token the same bits prefilled whole, in chunks, decoded, and
beside other sequences (benchmarks/gpu_attention.py measures speed). Skipped without CUDA and Triton."""

from __future__ import annotations

import dataclasses

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)
ta = pytest.importorskip("detent_audit.kernels.triton_attention")
IN_PROGRAM_DEFAULT = ta.IN_PROGRAM_MIN_PROGRAMS
SPLIT_PROGRAMS_DEFAULT = ta.SPLIT_PROGRAMS

H, HKV, D, PAGE = 8, 2, 64, 16


def _setup(lens: list[int], seed: int):
    g = torch.Generator(device="cuda").manual_seed(seed)
    pages = [-(-n // PAGE) for n in lens]
    total = sum(pages) + 3
    k = torch.randn(total, PAGE, HKV, D, device="cuda", dtype=torch.bfloat16, generator=g)
    v = torch.randn_like(k)
    perm = torch.randperm(total, device="cuda", generator=g)
    tables = torch.zeros(len(lens), max(pages), dtype=torch.int32, device="cuda")
    off = 0
    for i, p in enumerate(pages):
        tables[i, :p] = perm[off:off + p].to(torch.int32)
        off += p
    q = [torch.randn(n, H, D, device="cuda", dtype=torch.bfloat16, generator=g) for n in lens]
    return k, v, tables, q


def _run(k, v, tables, q, seqs, starts, ends, cfg):
    qq = torch.cat([q[s][a:b] for s, a, b in zip(seqs, starts, ends)])
    sizes = [b - a for a, b in zip(starts, ends)]
    cu = torch.tensor([0, *torch.tensor(sizes).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    out = ta.paged_attention(qq, k, v, cu, torch.tensor(starts, dtype=torch.int32, device="cuda"),
                             tables[seqs], D ** -0.5, cfg)
    return list(out.split(sizes))


@pytest.mark.parametrize("cfg",
                         [ta.TritonAttentionConfig(64, 64, 256, 4, 2),
                          ta.TritonAttentionConfig(64, 32, 64, 4, 2)])
def test_token_bits_do_not_depend_on_chunking_decode_or_neighbours(cfg) -> None:
    lens = [1, 40, 300, 777]
    k, v, tables, q = _setup(lens, seed=3)
    n = len(lens)
    alone = [_run(k, v, tables, q, [s], [0], [lens[s]], cfg)[0] for s in range(n)]
    batch = _run(k, v, tables, q, list(range(n)), [0] * n, lens, cfg)
    for s in range(n):
        assert torch.equal(batch[s], alone[s])
        parts, a = [], 0
        while a < lens[s]:
            parts.append(_run(k, v, tables, q, [s], [a], [min(lens[s], a + 29)], cfg)[0])
            a += 29
        assert torch.equal(torch.cat(parts), alone[s])
        last = _run(k, v, tables, q, [s], [lens[s] - 1], [lens[s]], cfg)[0]
        assert torch.equal(last, alone[s][-1:])
    # fp32 reference
    s = 3
    idx = tables[s, : -(-lens[s] // PAGE)].long()
    kk = k[idx].reshape(-1, HKV, D)[: lens[s]].float().repeat_interleave(H // HKV, 1).transpose(0, 1)
    vv = v[idx].reshape(-1, HKV, D)[: lens[s]].float().repeat_interleave(H // HKV, 1).transpose(0, 1)
    qq = q[s].float().transpose(0, 1)
    ref = torch.nn.functional.scaled_dot_product_attention(qq, kk, vv, is_causal=True)
    err = ((alone[s].float() - ref.transpose(0, 1)).norm() / ref.norm()).item()
    assert err < 1e-2


@pytest.mark.parametrize("one_pass", [False, True], ids=["loop-per-split", "one-pass"])
@pytest.mark.parametrize("cfg", [ta.TritonAttentionConfig(64, 64, 256, 4, 2, streaming=True),
                                 ta.TritonAttentionConfig(64, 32, 64, 8, 2, streaming=True)])
def test_streaming_mode_folds_alike_in_one_program_and_across_programs(cfg, one_pass, monkeypatch) -> None:
    """Streaming mode: a tile's splits folded in one program (prefill; a loop per split or one pass over the
    tiles) and split programs folded by the streaming combine (decode) give the same bits; so does every
    chunking and batching."""
    lens = [1, 40, 300, 777]
    k, v, tables, q = _setup(lens, seed=5)
    n = len(lens)
    runs = []
    monkeypatch.setattr(ta, "FOLD_IN_ONE_PASS", one_pass)
    # always in one program per tile; in parallel splits (the launch's 144 (tile, KV head) pairs), all of a
    # tile's in one program, up to two to a program and one each
    for threshold, split_programs in ((0, 1), (1 << 30, 1), (1 << 30, 288), (1 << 30, 1 << 30)):
        monkeypatch.setattr(ta, "IN_PROGRAM_MIN_PROGRAMS", threshold)
        monkeypatch.setattr(ta, "SPLIT_PROGRAMS", split_programs)
        runs.append(_run(k, v, tables, q, list(range(n)), [0] * n, lens, cfg))
    assert all(torch.equal(a, b) for run in runs[1:] for a, b in zip(runs[0], run))
    monkeypatch.setattr(ta, "IN_PROGRAM_MIN_PROGRAMS", IN_PROGRAM_DEFAULT)
    monkeypatch.setattr(ta, "SPLIT_PROGRAMS", SPLIT_PROGRAMS_DEFAULT)
    for s in range(n):
        alone = _run(k, v, tables, q, [s], [0], [lens[s]], cfg)[0]
        assert torch.equal(alone, runs[0][s])
        last = _run(k, v, tables, q, [s], [lens[s] - 1], [lens[s]], cfg)[0]
        assert torch.equal(last, alone[-1:])


def test_the_split_fold_is_the_same_at_every_launch_and_leaves_its_counters_at_zero(monkeypatch) -> None:
    """Decode rows in parallel splits: whichever program stores a tile's last partial folds them, a race at
    every launch. Two different sets of queries alternate over 50 launches of one plan (so a fold that read
    a partial before it was stored would read the other set's, left in the same buffers): each launch gives
    its set's bits, every counter is back at 0 after it, and each row equals its own prefill's last token
    (the fold in one program)."""
    lens = [1, 63, 64, 65, 700, 1500, 2049, 4000]
    k, v, tables, q = _setup(lens, seed=9)
    cfg = ta.TritonAttentionConfig(64, 64, 64, 4, 2, streaming=True)
    sets = [torch.cat([x[-1:] for x in q]), torch.randn(len(lens), H, D, device="cuda", dtype=torch.bfloat16)]
    cu = torch.arange(len(lens) + 1, dtype=torch.int32, device="cuda")
    ctx = torch.tensor([n - 1 for n in lens], dtype=torch.int32, device="cuda")
    plan = ta.plan_step(cu, ctx, tables, cfg, sets[0].device, H // HKV)
    assert plan.one_row_each and plan.num_tiles * HKV < ta.IN_PROGRAM_MIN_PROGRAMS < plan.num_tiles * HKV * 63
    launched = []

    class Counted:  # the split fold's launches, counted
        def __getitem__(self, grid):
            launched.append(grid)
            return split_fold[grid]

    split_fold = ta._attn_split_fold
    monkeypatch.setattr(ta, "_attn_split_fold", Counted())

    def attend(x: torch.Tensor) -> torch.Tensor:
        return ta.paged_attention(x, k, v, cu, ctx, tables, D ** -0.5, cfg, plan=plan)

    first = [attend(x) for x in sets]
    assert not torch.equal(first[0], first[1]) and len(launched) == 2  # the split fold ran
    for i in range(50):
        assert torch.equal(attend(sets[i % 2]), first[i % 2])
        assert not plan.counters.any()
    for s, n in enumerate(lens):
        assert torch.equal(_run(k, v, tables, q, [s], [0], [n], cfg)[0][-1], first[0][s])


@pytest.mark.parametrize("launch", [{"num_stages": 3}, {"num_stages": 1}], ids=["stages3", "stages1"])
@pytest.mark.parametrize("split", [64, 4096])
def test_launch_shape_changes_no_bit(launch, split, monkeypatch) -> None:
    """Pipeline stages shape a launch, not its arithmetic (benchmarks/gpu_attention.py's tile check on the
    H200): a token gets the default launch's bits, prefilled whole or decoded, its splits folded in one
    program or one split."""
    base = ta.TritonAttentionConfig(64, 32, split, 4, 2, streaming=True)
    other = dataclasses.replace(base, **launch)
    lens = [1, 40, 300, 777]
    k, v, tables, q = _setup(lens, seed=7)
    n = len(lens)
    monkeypatch.setattr(ta, "IN_PROGRAM_MIN_PROGRAMS", 0)  # every launch folds in one program, as the
    whole = _run(k, v, tables, q, list(range(n)), [0] * n, lens, base)  # decode graphs of 16+ rows do
    assert all(torch.equal(a, b) for a, b in zip(_run(k, v, tables, q, list(range(n)), [0] * n, lens, other),
                                                 whole))
    for s in range(n):
        last = _run(k, v, tables, q, [s], [lens[s] - 1], [lens[s]], other)[0]
        assert torch.equal(last, whole[s][-1:])
