"""Opt-in CPU tier (Triton's interpreter): the paged attention's logic, and its streaming mode's claim that
the in-program fold and the parallel splits with a streaming combine give a token the same bits. The
interpreter computes in numpy, not in the GPU's instructions, so this checks the arithmetic is the same
arithmetic, not the device's bits (tests/kernels/test_gpu_attention.py does that on a GPU).

Runs only with DETENT_TRITON_INTERPRET=1 and Triton importable:
    DETENT_TRITON_INTERPRET=1 .venv/bin/pytest -q tests/kernels/test_triton_attention_interpret.py
"""

from __future__ import annotations

import os

import pytest
import torch

if os.environ.get("DETENT_TRITON_INTERPRET") != "1":
    pytest.skip("the Triton-interpreter tier is opt-in (DETENT_TRITON_INTERPRET=1)", allow_module_level=True)
os.environ["TRITON_INTERPRET"] = "1"
pytest.importorskip("triton.runtime.interpreter")

pytestmark = pytest.mark.usefixtures("interpreter_loop_bounds")  # tests/kernels/conftest.py

from detent_audit.kernels import triton_attention as ta  # noqa: E402

H, HKV, D, PAGE = 4, 2, 16, 4


def _cache(lens: list[int], seed: int):
    g = torch.Generator().manual_seed(seed)
    pages = [-(-n // PAGE) for n in lens]
    total = sum(pages) + 2
    k = torch.randn(total, PAGE, HKV, D, generator=g)
    v = torch.randn(total, PAGE, HKV, D, generator=g)
    perm = torch.randperm(total, generator=g)
    tables = torch.zeros(len(lens), max(pages), dtype=torch.int32)
    off = 0
    for i, p in enumerate(pages):
        tables[i, :p] = perm[off:off + p].to(torch.int32)
        off += p
    q = [torch.randn(n, H, D, generator=g) for n in lens]
    return k, v, tables, q


def _run(k, v, tables, q, seqs, starts, ends, cfg):
    qq = torch.cat([q[s][a:b] for s, a, b in zip(seqs, starts, ends)])
    sizes = [b - a for a, b in zip(starts, ends)]
    cu = torch.tensor([0, *torch.tensor(sizes).cumsum(0).tolist()], dtype=torch.int32)
    out = ta.paged_attention(qq, k, v, cu, torch.tensor(starts, dtype=torch.int32), tables[seqs],
                             D ** -0.5, cfg)
    return list(out.split(sizes))


def _reference(k, v, tables, q, s: int, n: int) -> torch.Tensor:
    idx = tables[s, : -(-n // PAGE)].long()
    kk = k[idx].reshape(-1, HKV, D)[:n].double().repeat_interleave(H // HKV, 1).transpose(0, 1)
    vv = v[idx].reshape(-1, HKV, D)[:n].double().repeat_interleave(H // HKV, 1).transpose(0, 1)
    qq = q[s].double().transpose(0, 1)
    return torch.nn.functional.scaled_dot_product_attention(qq, kk, vv, is_causal=True).transpose(0, 1)


@pytest.mark.parametrize("streaming", [False, True])
@pytest.mark.parametrize("in_program",
                         [0, 1 << 30])  # the streaming mode's threshold: always / never fold in one
def test_streaming_fold_gives_a_token_the_same_bits(streaming: bool, in_program: int, monkeypatch) -> None:
    monkeypatch.setattr(ta, "IN_PROGRAM_MIN_PROGRAMS", in_program)
    lens = [3, 13, 22]
    k, v, tables, q = _cache(lens, seed=len(lens) + in_program % 7)
    cfg = ta.TritonAttentionConfig(block_m=16, block_n=4, split=8, num_warps=1, num_stages=1,
                                   streaming=streaming)
    n = len(lens)
    alone = [_run(k, v, tables, q, [s], [0], [lens[s]], cfg)[0] for s in range(n)]
    batch = _run(k, v, tables, q, list(range(n)), [0] * n, lens, cfg)
    for s in range(n):
        assert ((alone[s].double() - _reference(k, v, tables, q, s, lens[s])).abs().max()) < 1e-5
        assert torch.equal(batch[s], alone[s])
        decode = torch.cat([_run(k, v, tables, q, [s], [p], [p + 1], cfg)[0] for p in range(lens[s])])
        assert torch.equal(decode, alone[s])


def test_the_two_streaming_paths_agree_bit_for_bit(monkeypatch) -> None:
    lens = [9, 30]
    k, v, tables, q = _cache(lens, seed=11)
    cfg = ta.TritonAttentionConfig(block_m=16, block_n=4, split=8, num_warps=1, num_stages=1, streaming=True)
    outs = []
    # in one program per tile; in parallel splits (the launch's 12 (tile, KV head) pairs of up to 4 splits):
    # all four in one program, two to a program and one each, the program that stores the last partial
    # folding them
    for threshold, split_programs in ((0, 1), (1 << 30, 1), (1 << 30, 24), (1 << 30, 1 << 30)):
        monkeypatch.setattr(ta, "IN_PROGRAM_MIN_PROGRAMS", threshold)
        monkeypatch.setattr(ta, "SPLIT_PROGRAMS", split_programs)
        outs.append(_run(k, v, tables, q, [0, 1], [0, 0], lens, cfg))
    assert all(torch.equal(a, b) for run in outs[1:] for a, b in zip(outs[0], run))


@pytest.mark.parametrize(("block_n", "split"), [(4, 8), (4, 4), (8, 24)])
def test_the_one_pass_fold_gives_the_loop_per_split_bits(block_n: int, split: int, monkeypatch) -> None:
    """`_attn_folded_one_pass` (folds where a split ends, one pass over the tiles) against `_attn_folded` (a
    loop per split) and against the parallel splits with the streaming combine: the same bits for every token,
    prefilled whole, in chunks and decoded, with splits of one tile and of several."""
    lens = [1, 7, 29, 40]
    k, v, tables, q = _cache(lens, seed=split + block_n)
    cfg = ta.TritonAttentionConfig(block_m=16, block_n=block_n, split=split, num_warps=1, num_stages=1,
                                   streaming=True)
    n = len(lens)
    monkeypatch.setattr(ta, "IN_PROGRAM_MIN_PROGRAMS", 0)
    runs = {}
    for one_pass in (False, True):
        monkeypatch.setattr(ta, "FOLD_IN_ONE_PASS", one_pass)
        runs[one_pass] = _run(k, v, tables, q, list(range(n)), [0] * n, lens, cfg)
    monkeypatch.setattr(ta, "IN_PROGRAM_MIN_PROGRAMS", 1 << 30)
    combined = _run(k, v, tables, q, list(range(n)), [0] * n, lens, cfg)
    monkeypatch.setattr(ta, "IN_PROGRAM_MIN_PROGRAMS", 0)
    for s in range(n):
        assert torch.equal(runs[True][s], runs[False][s]) and torch.equal(runs[True][s], combined[s])
        assert ((runs[True][s].double() - _reference(k, v, tables, q, s, lens[s])).abs().max()) < 1e-5
        chunks = torch.cat([_run(k, v, tables, q, [s], [a], [min(lens[s], a + 5)], cfg)[0]
                            for a in range(0, lens[s], 5)])
        assert torch.equal(chunks, runs[True][s])
