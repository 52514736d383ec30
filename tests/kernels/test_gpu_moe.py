"""GPU tier: the Triton fused MoE (kernels/triton_moe.py). For a fixed config a row's bits depend only on its
own x row and router logits: not on M, the other rows or their order; the whole call is capturable in a CUDA
graph. Skipped without CUDA and Triton. Which config fields change the bits is measured by
benchmarks/gpu_moe.py, not asserted here: configs are only compared within tolerance."""

from __future__ import annotations

import pytest
import torch

from detent_audit.kernels import moe

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)
triton_moe = pytest.importorskip("detent_audit.kernels.triton_moe")

TOP_K = 8
# (E, H, I): Qwen3-30B-A3B's layer (128, 2048, 768) and smaller ones with its proportions; I=192 leaves a
# partial BLOCK_K chunk for BLOCK_K 128
SHAPES = [(128, 2048, 768), (64, 512, 192), (32, 256, 128)]
CONFIGS = [triton_moe.TritonMoeConfig(), triton_moe.TritonMoeConfig(16, 32, 64, 1, 4, 3),
           triton_moe.TritonMoeConfig(64, 128, 64, 8, 4, 4)]
# ||out - ref|| / ||ref|| against float64 math on the same bf16 inputs and the same (fp32) routing: bf16
# rounds the hidden, activated and expert outputs (~3 roundings of 2^-9)
REL_TOL = 1e-2
# routing weights against kernels/moe.route: fp32 softmax with the GPU's approximate exp and division
WEIGHT_RTOL, WEIGHT_ATOL = 1e-5, 1e-7


def _rnd(seed: int):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return lambda *shape, scale=1.0: (torch.randn(*shape, device="cuda",
                                                  generator=g) * scale).to(torch.bfloat16)


def _rows(shape, rows: int, seed: int):
    """Fresh random x: [rows, H] and router logits: [rows, E] (bf16, never zeros)."""
    rnd = _rnd(seed)
    return rnd(rows, shape[1]), rnd(rows, shape[0], scale=2.0)


def _problem(shape, rows: int, seed: int):
    """x, logits and the experts' weights w13: [E, 2I, H], w2: [E, H, I] at a Qwen3-MoE-like scale."""
    e, h, inter = shape
    rnd = _rnd(seed + 1000)
    return (*_rows(shape, rows, seed), rnd(e, 2 * inter, h, scale=h**-0.5),
            rnd(e, h, inter, scale=inter**-0.5))


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: f"m{c.block_m}n{c.block_n}k{c.block_k}")
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"E{s[0]}H{s[1]}I{s[2]}")
def test_rows_do_not_depend_on_the_batch(shape, config) -> None:
    x, logits, w13, w2 = _problem(shape, 300, seed=sum(shape))
    run = lambda a, b: triton_moe.fused_moe(a, b, w13, w2, TOP_K, True, config)  # noqa: E731
    full = run(x, logits)
    assert full.shape == x.shape and full.dtype == torch.bfloat16
    # (1) prefixes
    for m in (1, 3, 17, 64, 299):
        assert torch.equal(run(x[:m], logits[:m]), full[:m]), m
    # (2) permuted rows -> permuted outputs
    perm = torch.randperm(300, device="cuda", generator=torch.Generator(device="cuda").manual_seed(1))
    assert torch.equal(run(x[perm], logits[perm]), full[perm])
    # a row among fresh random rows, at a random position, in batches of several sizes
    for size in (2, 16, 129):
        bx, bl = _rows(shape, size, seed=size)
        at = size // 3
        bx[at], bl[at] = x[5], logits[5]
        assert torch.equal(run(bx, bl)[at], full[5]), size


@pytest.mark.parametrize("renormalize", [True, False])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"E{s[0]}H{s[1]}I{s[2]}")
def test_routing_equals_moe_route(shape, renormalize: bool) -> None:
    _, logits = _rows(shape, 500, seed=7)  # bf16 logits: equal values (ties) occur
    logits[0] = 1.5  # a row of ties: experts 0..k-1
    got = triton_moe.route(logits, TOP_K, renormalize)
    want = moe.route(logits, TOP_K, renormalize)
    assert torch.equal(got.ids.long(), want.ids)
    torch.testing.assert_close(got.weights, want.weights, rtol=WEIGHT_RTOL, atol=WEIGHT_ATOL)


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: f"m{c.block_m}n{c.block_n}k{c.block_k}")
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"E{s[0]}H{s[1]}I{s[2]}")
def test_close_to_float64(shape, config) -> None:
    x, logits, w13, w2 = _problem(shape, 64, seed=3)
    got = triton_moe.fused_moe(x, logits, w13, w2, TOP_K, True, config)
    # kernels/moe's math on upcast inputs: the same fp32 routing, float64 GEMMs, SiLU and combine
    ref = moe.fused_moe(x.double(), logits, w13.double(), w2.double(), TOP_K, True)
    assert ((got.double() - ref).norm() / ref.norm()).item() < REL_TOL


@pytest.mark.parametrize("rows", [1, 8, 96])
def test_cuda_graph_replay_equals_eager(rows: int) -> None:
    x, logits, w13, w2 = _problem(SHAPES[1], rows, seed=11)
    config = CONFIGS[0]
    static_x, static_logits = x.clone(), logits.clone()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up off the capture: Triton compiles, the allocator settles
        triton_moe.fused_moe(static_x, static_logits, w13, w2, TOP_K, True, config)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = triton_moe.fused_moe(static_x, static_logits, w13, w2, TOP_K, True, config)
    for seed in (12, 13):
        new_x, new_logits = _rows(SHAPES[1], rows, seed=seed)
        static_x.copy_(new_x)
        static_logits.copy_(new_logits)
        graph.replay()
        eager = triton_moe.fused_moe(new_x, new_logits, w13, w2, TOP_K, True, config)
        assert torch.equal(static_out, eager), seed


def test_stock_config_reads_the_batch_and_shapes_are_checked() -> None:
    assert triton_moe.stock_config(128, 128, 2048, 768, 8) == triton_moe.TritonMoeConfig(16, 32, 64, 1, 4, 3)
    assert triton_moe.stock_config(129, 128, 2048, 768, 8) == triton_moe.TritonMoeConfig(64, 64, 32, 8, 4, 3)
    x, logits, w13, w2 = _problem(SHAPES[2], 4, seed=5)
    assert triton_moe.fused_moe(x[:0], logits[:0], w13, w2, TOP_K, True, CONFIGS[0]).shape == (0, x.shape[1])
    with pytest.raises(ValueError, match="do not fit"):
        triton_moe.fused_moe(x, logits, w13, w2.transpose(1, 2), TOP_K, True, CONFIGS[0])


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"E{s[0]}H{s[1]}I{s[2]}")
def test_rows_keep_their_bits_when_the_tile_follows_m(shape) -> None:
    """detent and stock take the MoE tile from M (kernels.gpu.moe_tile, vLLM's rule: another tile past M = E);
    a row must keep its bits on both sides of the switch, alone and in any batch."""
    from detent_audit.kernels.gpu import moe_tile

    e = shape[0]
    rows = 2 * e + 5
    x, logits, w13, w2 = _problem(shape, rows, seed=7 * sum(shape))
    assert moe_tile(1, e, shape[1], shape[2], TOP_K) != moe_tile(rows, e, shape[1], shape[2], TOP_K)

    def run(m: int, perm=None):
        xx, ll = (x[:m], logits[:m]) if perm is None else (x[perm], logits[perm])
        return triton_moe.fused_moe(xx, ll, w13, w2, TOP_K, True,
                                    moe_tile(xx.shape[0], e, shape[1], shape[2], TOP_K))

    full = run(rows)
    for m in (1, 2, 7, e - 1, e, e + 1, rows - 1):
        assert torch.equal(run(m), full[:m]), m
    alone = torch.cat([run(1, torch.tensor([i], device="cuda")) for i in range(0, rows, 37)])
    assert torch.equal(alone, full[0:rows:37])
