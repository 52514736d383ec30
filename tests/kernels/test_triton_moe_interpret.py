"""The Triton fused MoE's logic on the CPU, through Triton's interpreter (TRITON_INTERPRET=1), tiny shapes.

Opt-in (CI skips it): DETENT_TRITON_INTERPRET=1 .venv/bin/pytest -q tests/kernels/test_triton_moe_interpret.py
Run this file on its own: it sets TRITON_INTERPRET=1 for the process before Triton decorates the kernels.
Checks routing ids against kernels/moe.route, the alignment's invariants, and the result against the CPU
kernels (fp32) and a float64 reference (fp32 and bf16). The interpreter's bits say nothing about the GPU's:
bit invariance on the device is tests/kernels/test_gpu_moe.py's job.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

if os.environ.get("DETENT_TRITON_INTERPRET") != "1":
    pytest.skip("set DETENT_TRITON_INTERPRET=1 to run the Triton interpreter tests", allow_module_level=True)
os.environ["TRITON_INTERPRET"] = "1"
pytest.importorskip("triton")
tl = pytest.importorskip("triton.language")
interpreter = pytest.importorskip("triton.runtime.interpreter")
triton_moe = pytest.importorskip("detent_audit.kernels.triton_moe")
if not isinstance(triton_moe._route_kernel, interpreter.InterpretedFunction):
    pytest.skip("triton_moe was imported before TRITON_INTERPRET=1 was set", allow_module_level=True)
pytestmark = pytest.mark.usefixtures("interpreter_loop_bounds")  # tests/kernels/conftest.py

from detent_audit.kernels import moe  # noqa: E402
from detent_audit.kernels.params import GemmParams, MoeParams  # noqa: E402

# Interpreter exp and division are numpy's fp32 (correctly rounded); vs torch's softmax: a few ulps.
WEIGHT_RTOL, WEIGHT_ATOL = 2e-6, 1e-7
# ||out - ref|| / ||ref|| against float64: fp32 GEMM chains ~1e-6; bf16 rounds hidden and expert outputs.
REL_TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}
CONFIGS = [triton_moe.TritonMoeConfig(16, 16, 16, 1, 4, 1), triton_moe.TritonMoeConfig(32, 32, 16, 2, 4, 1)]


@pytest.fixture
def bf16_fixes(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two bf16 faults of Triton 3.6's interpreter, patched for the test: (1) create_dot multiplies bf16
    operands as their raw uint16 bits (it converts only 8-bit floats): convert them to fp32 first (exact,
    what the GPU's bf16 MMA multiplies); (2) fp32 -> bf16 casts truncate: round to nearest even, as the
    GPU's cvt.rn.bf16.f32 does (torch's conversion)."""
    original_dot = interpreter.InterpreterBuilder.create_dot
    original_cast = interpreter.InterpreterBuilder.cast_impl

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        a = self.cast_impl(a, tl.float32) if a.dtype.scalar == tl.bfloat16 else a
        b = self.cast_impl(b, tl.float32) if b.dtype.scalar == tl.bfloat16 else b
        return original_dot(self, a, b, d, input_precision, max_num_imprecise_acc)

    def cast_impl(self, src, dst_type):
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
            rounded = torch.from_numpy(src.data.copy()).to(torch.bfloat16).view(torch.int16).numpy()
            return interpreter.TensorHandle(rounded.view(np.uint16), tl.bfloat16)
        return original_cast(self, src, dst_type)

    monkeypatch.setattr(interpreter.InterpreterBuilder, "create_dot", create_dot)
    monkeypatch.setattr(interpreter.InterpreterBuilder, "cast_impl", cast_impl)


def _problem(randn, m: int, e: int, h: int, inter: int, dtype: torch.dtype):
    x, logits = randn(m, h, dtype=dtype), randn(m, e, dtype=dtype, scale=2.0)
    w13 = randn(e, 2 * inter, h, dtype=dtype, scale=h**-0.5)
    w2 = randn(e, h, inter, dtype=dtype, scale=inter**-0.5)
    return x, logits, w13, w2


@pytest.mark.parametrize(("e", "top_k"), [(8, 2), (6, 3), (20, 8), (128, 8)])
@pytest.mark.parametrize("renormalize", [True, False])
def test_routing_ids_equal_moe_route(randn, e: int, top_k: int, renormalize: bool) -> None:
    logits = randn(33, e, dtype=torch.bfloat16, scale=2.0)  # bf16: equal logits (ties) do occur
    logits[0, :] = 1.5  # a row of ties: experts 0..k-1
    got = triton_moe.route(logits, top_k, renormalize)
    want = moe.route(logits, top_k, renormalize)
    assert got.ids.dtype == torch.int32 and got.weights.dtype == torch.float32
    assert torch.equal(got.ids.long(), want.ids)
    torch.testing.assert_close(got.weights, want.weights, rtol=WEIGHT_RTOL, atol=WEIGHT_ATOL)


def test_routing_ties_go_to_the_lower_expert() -> None:
    logits = torch.tensor([[1.0, 3.0, 3.0, 0.0, 3.0], [2.0, 2.0, 2.0, 2.0, 2.0]])
    routing = triton_moe.route(logits, 2, renormalize=True)
    assert routing.ids.tolist() == [[1, 2], [0, 1]]
    assert torch.equal(routing.weights, torch.full((2, 2), 0.5))


@pytest.mark.parametrize(("m", "e", "top_k", "block_m"), [(1, 8, 2, 16), (5, 8, 2, 16), (40, 6, 3, 16),
                                                           (64, 128, 8, 64), (3, 128, 8, 16)])
def test_alignment_invariants(gen, m: int, e: int, top_k: int, block_m: int) -> None:
    ids = torch.stack([torch.randperm(e, generator=gen)[:top_k] for _ in range(m)]).to(torch.int32)
    align = triton_moe.moe_align(ids, e, block_m)
    entries, owners = align.sorted_entries, align.block_expert
    num_entries, blocks = m * top_k, triton_moe.max_blocks(m * top_k, e, block_m)
    # shapes set by (M, k, E, BLOCK_M) alone, at most M*k + E*(BLOCK_M-1) entries rounded up to BLOCK_M
    assert entries.shape == (blocks * block_m,) and owners.shape == (blocks,)
    assert blocks * block_m <= -(-(num_entries + e * (block_m - 1)) // block_m) * block_m
    # every entry exactly once; the rest is the invalid id
    valid = entries[entries < num_entries]
    assert torch.equal(valid.sort().values, torch.arange(num_entries, dtype=torch.int32))
    assert torch.all(entries[entries >= num_entries] == num_entries)
    # the first num_valid blocks belong to experts in ascending order, one run per used expert; the rest -1
    counts = torch.bincount(ids.flatten().long(), minlength=e)
    want_owners = torch.repeat_interleave(torch.arange(e), (counts + block_m - 1) // block_m)
    num_valid = int(align.num_valid_blocks)
    assert num_valid == len(want_owners)
    assert torch.equal(owners[:num_valid].long(), want_owners)
    assert torch.all(owners[num_valid:] == -1)
    # each block's entries are its expert's, rows ascending within an expert (a stable grouping)
    flat = ids.flatten()
    for b in range(num_valid):
        block = entries[b * block_m : (b + 1) * block_m]
        block = block[block < num_entries]
        assert len(block) > 0 and torch.all(flat[block.long()] == owners[b])
    for expert in range(e):
        mine = valid[flat[valid.long()] == expert]
        assert torch.equal(mine, mine.sort().values)


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: f"m{c.block_m}n{c.block_n}k{c.block_k}")
@pytest.mark.parametrize("renormalize", [True, False])
def test_fp32_close_to_the_cpu_kernels_and_float64(randn, config, renormalize: bool) -> None:
    x, logits, w13, w2 = _problem(randn, 11, 8, 40, 24, torch.float32)  # K 40 and 24: masked K chunks
    got = triton_moe.fused_moe(x, logits, w13, w2, 3, renormalize, config)
    assert got.shape == x.shape and got.dtype == x.dtype
    cpu = moe.fused_moe(x, logits, w13, w2, 3, renormalize, params=MoeParams(GemmParams(4)))
    ref = moe.fused_moe(x.double(), logits, w13.double(), w2.double(), 3, renormalize)  # fp32 routing
    assert ((got.double() - ref).norm() / ref.norm()).item() < REL_TOL[torch.float32]
    torch.testing.assert_close(got, cpu, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: f"m{c.block_m}n{c.block_n}k{c.block_k}")
def test_bf16_close_to_float64(randn, bf16_fixes, config) -> None:
    x, logits, w13, w2 = _problem(randn, 13, 12, 48, 32, torch.bfloat16)
    got = triton_moe.fused_moe(x, logits, w13, w2, 4, True, config)
    assert got.dtype == torch.bfloat16
    ref = moe.fused_moe(x.double(), logits, w13.double(), w2.double(), 4, True)
    assert ((got.double() - ref).norm() / ref.norm()).item() < REL_TOL[torch.bfloat16]


def test_rows_keep_their_bits_in_the_interpreter(randn, gen, bf16_fixes) -> None:
    """The kernels' logic gathers and scatters the right rows: prefixes and permutations give the same
    rows."""
    x, logits, w13, w2 = _problem(randn, 17, 8, 32, 16, torch.bfloat16)
    run = lambda a, b: triton_moe.fused_moe(a, b, w13, w2, 2, True, CONFIGS[0])  # noqa: E731
    full = run(x, logits)
    for m in (1, 3, 16):
        assert torch.equal(run(x[:m], logits[:m]), full[:m]), m
    perm = torch.randperm(17, generator=gen)
    assert torch.equal(run(x[perm], logits[perm]), full[perm])


def test_shape_errors_and_empty() -> None:
    x, logits = torch.randn(2, 16), torch.randn(2, 4)
    w13, w2 = torch.randn(4, 32, 16), torch.randn(4, 16, 16)
    assert triton_moe.fused_moe(x[:0], logits[:0], w13, w2, 2, True, CONFIGS[0]).shape == (0, 16)
    with pytest.raises(ValueError, match="do not fit"):
        triton_moe.fused_moe(x, logits[:, :3], w13, w2, 2, True, CONFIGS[0])
    with pytest.raises(ValueError, match="power of two"):
        triton_moe.TritonMoeConfig(block_m=8)


@pytest.mark.parametrize(("rows", "top_k", "experts", "block_m"),
                         [(1, 8, 128, 64), (3, 2, 8, 16), (32, 8, 128, 16), (17, 4, 20, 32), (64, 4, 6, 16)])
def test_the_one_launch_alignment_equals_the_torch_one(rows: int, top_k: int, experts: int,
                                                       block_m: int) -> None:
    g = torch.Generator().manual_seed(rows * experts + block_m)
    ids = torch.stack([torch.randperm(experts, generator=g)[:top_k] for _ in range(rows)]).to(torch.int32)
    assert ids.numel() <= triton_moe.ALIGN_KERNEL_MAX_ENTRIES
    small = triton_moe._align_small(ids, experts, block_m)
    reference = triton_moe._align_torch(ids, experts, block_m)
    for a, b in zip(small, reference):
        assert torch.equal(a.to(torch.int64), b.to(torch.int64))
