"""GPU tier: the Triton row-local kernels (RMSNorm with the residual add, SiLU-and-mul, the attention
prologue) give a row the same bits alone and in any batch, and agree with the fp32 math of the CPU ops.
Skipped without CUDA and Triton."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)
tr = pytest.importorskip("detent_audit.kernels.triton_rowlocal")

from detent_audit.kernels import rowlocal  # noqa: E402

DT = torch.bfloat16
MS = (1, 2, 7, 64, 300)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.mark.parametrize("n", [64, 2048, 4096, 5120])
def test_rms_norm_rows_are_batch_invariant(n: int) -> None:
    g = torch.Generator(device="cuda").manual_seed(n)
    x = torch.randn(300, n, device="cuda", dtype=DT, generator=g)
    r = torch.randn(300, n, device="cuda", dtype=DT, generator=g)
    w = 1 + 0.1 * torch.randn(n, device="cuda", dtype=DT, generator=g)
    full = tr.rms_norm(x, w, 1e-6)
    normed, total = tr.add_rms_norm(x, r, w, 1e-6)
    for m in MS:
        assert torch.equal(tr.rms_norm(x[:m], w, 1e-6), full[:m])
        a, b = tr.add_rms_norm(x[-m:], r[-m:], w, 1e-6)
        assert torch.equal(a, normed[-m:]) and torch.equal(b, total[-m:])
    assert torch.equal(total, x + r)  # one bf16 rounding, as torch's add
    assert _rel(full, rowlocal.rms_norm(x.float(), w.float(), 1e-6)) < 1e-2
    assert _rel(normed, rowlocal.rms_norm((x + r).float(), w.float(), 1e-6)) < 1e-2


@pytest.mark.parametrize("inter", [256, 1536, 14336])
def test_silu_and_mul_rows_are_batch_invariant(inter: int) -> None:
    g = torch.Generator(device="cuda").manual_seed(inter)
    x = torch.randn(300, 2 * inter, device="cuda", dtype=DT, generator=g)
    full = tr.silu_and_mul(x)
    for m in MS:
        assert torch.equal(tr.silu_and_mul(x[-m:]), full[-m:])
    assert _rel(full, rowlocal.silu_and_mul(x.float())) < 1e-2


@pytest.mark.parametrize(("h", "hkv", "d", "norm"),
                         [(32, 8, 128, False), (32, 8, 64, False), (32, 4, 128, True)])
def test_qkv_prologue_matches_the_cpu_ops_and_is_batch_invariant(h: int, hkv: int, d: int,
                                                                 norm: bool) -> None:
    g = torch.Generator(device="cuda").manual_seed(h * d + norm)
    t, page, blocks = 300, 16, 40
    qkv = torch.randn(t, (h + 2 * hkv) * d, device="cuda", dtype=DT, generator=g)
    positions = torch.randint(0, 4000, (t,), device="cuda", generator=g)
    slots = torch.randperm(blocks * page, device="cuda", generator=g)[:t]
    rope = rowlocal.RopeCache.build(d, 500000.0, 4096)
    cos, sin = rope.cos.cuda(), rope.sin.cuda()
    qn = (1 + 0.1 * torch.randn(d, device="cuda", dtype=DT, generator=g)) if norm else None
    kn = (1 + 0.1 * torch.randn(d, device="cuda", dtype=DT, generator=g)) if norm else None

    def run(rows: slice):
        kc = torch.full((blocks, page, hkv, d), float("nan"), device="cuda", dtype=DT)
        vc = torch.full_like(kc, float("nan"))
        q = tr.qkv_prologue(qkv[rows], positions[rows], cos, sin, (h, hkv, d), kc, vc, slots[rows], qn,
                            kn, 1e-6)
        return q, kc.view(-1, hkv, d)[slots[rows]], vc.view(-1, hkv, d)[slots[rows]]

    q, k, v = run(slice(0, t))
    for m in MS:
        qm, km, vm = run(slice(t - m, t))
        assert torch.equal(qm, q[-m:]) and torch.equal(km, k[-m:]) and torch.equal(vm, v[-m:])
    # against the CPU ops' fp32 math
    qf, kf, vf = qkv.float().split([h * d, hkv * d, hkv * d], -1)
    qf, kf, vf = qf.reshape(t, h, d), kf.reshape(t, hkv, d), vf.reshape(t, hkv, d)
    if norm:
        qf = rowlocal.rms_norm(qf.reshape(-1, d), qn.float(), 1e-6).view(t, h, d)
        kf = rowlocal.rms_norm(kf.reshape(-1, d), kn.float(), 1e-6).view(t, hkv, d)
    rq, rk = rowlocal.rope(qf.cpu(), kf.cpu(), positions.cpu(), rope)
    assert _rel(q.cpu(), rq) < 1e-2 and _rel(k.cpu(), rk) < 1e-2
    assert torch.equal(v, vf.to(DT))  # v is copied, not rounded again
