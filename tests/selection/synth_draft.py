"""Draft synthetic families (will be merged into test_tuner.py)."""
from __future__ import annotations

import math
import random
import zlib

from detent_audit.selection.tuner import FamilyGrid, Workload

SMS = 132
PEAK_SM = 989e12 / SMS     # flop/s per SM
BW = 4.8e12                # bytes/s
SMEM = 228 * 1024
POW2 = 1.02


def _noise(seed, a, call, sigma):
    h = zlib.crc32(repr((seed, a.key, call)).encode())
    return 1.0 + sigma * random.Random(h).gauss(0.0, 1.0)


def _gemm(rng, seed):
    choices = {
        "block_m": (16, 32, 64, 128, 256),
        "block_n": (16, 32, 64, 128, 256),
        "block_k": (16, 32, 64, 128),
        "num_warps": (1, 2, 4, 8),
        "num_stages": (1, 2, 3, 4, 5),
    }
    fixed = {"block_m": 64, "block_n": 64, "block_k": 64, "num_warps": 4, "num_stages": 3}
    n_axes = rng.choice((3, 4))
    names = ["block_m", "block_n"] + rng.sample(["block_k", "num_warps", "num_stages"], n_axes - 2)
    axes = {n: choices[n] for n in names}
    if n_axes == 3:
        axes["block_m"] = axes["block_n"] = (16, 32, 48, 64, 96, 128, 192, 256)
    nk = [(rng.choice((1024, 2048, 4096, 8192, 14336)), rng.choice((1024, 2048, 4096, 8192)))
          for _ in range(rng.randint(1, 3))]
    ai = rng.uniform(8, 32)         # arithmetic-intensity half point
    wexp = rng.uniform(0.05, 0.25)  # penalty for a warp count off its best
    t_iter = rng.uniform(0.3e-6, 1.0e-6)
    sigma = rng.uniform(0.0, 0.01)

    def full(a):
        return {**fixed, **a}

    def legal_if(a):
        p = full(a)
        smem = (p["block_m"] + p["block_n"]) * p["block_k"] * 2 * max(1, p["num_stages"])
        regs = p["block_m"] * p["block_n"] / (32 * p["num_warps"])
        return smem <= SMEM and regs <= 256

    def cost(a, call):
        p = full(a)
        m, n, k = call
        bm, bn, bk, w, s = p["block_m"], p["block_n"], p["block_k"], p["num_warps"], p["num_stages"]
        tiles = math.ceil(m / bm) * math.ceil(n / bn)
        waves = math.ceil(tiles / SMS)
        intensity = bm * bn / (bm + bn)
        w_best = max(1, min(8, bm * bn // 4096))
        eff = intensity / (intensity + ai) / (1 + wexp * abs(math.log2(w / w_best)))
        compute = 2 * bm * bn * k / (PEAK_SM * eff)
        memory = (bm + bn) * k * 2 / (BW / SMS) * (1 + 1.0 / s)
        iters = math.ceil(k / bk) * t_iter * (1 + 2.0 / s) * (64 / bk) ** 0.3
        t = waves * (max(compute, memory) + iters) + 4e-6
        return t * _noise(seed, a, call, sigma)

    calls = {}
    for _ in range(rng.randint(4, 40)):
        m = int(math.exp(rng.uniform(0, math.log(8192))))
        n, k = rng.choice(nk)
        calls[(m, n, k)] = 1 + int(rng.paretovariate(1.1) * 10)
    return axes, legal_if, cost, Workload.from_counts(calls)


def _attention(rng, seed):
    choices = {
        "split_stride": (128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768),
        "block_n": (16, 32, 64, 128, 256),
        "num_warps": (1, 2, 4, 8),
        "num_stages": (1, 2, 3),
    }
    fixed = {"split_stride": 2048, "block_n": 64, "num_warps": 4, "num_stages": 2}
    n_axes = rng.choice((3, 4))
    names = ["split_stride", "block_n"] + rng.sample(["num_warps", "num_stages"], n_axes - 2)
    axes = {n: choices[n] for n in names}
    kv_heads = rng.choice((1, 2, 4, 8))
    head_dim = rng.choice((64, 128, 256))
    max_ctx = rng.choice((32768, 131072))
    t_comb = rng.uniform(0.5e-6, 3e-6)
    sigma = rng.uniform(0.0, 0.01)

    def full(a):
        return {**fixed, **a}

    def legal_if(a):
        p = full(a)
        return (p["block_n"] * head_dim * 2 * 2 * p["num_stages"] <= SMEM and p["split_stride"] >= p["block_n"]
                and math.ceil(max_ctx / p["split_stride"]) <= 256)

    def cost(a, call):
        p = full(a)
        seqs, kv = call
        stride, bn, w, s = p["split_stride"], p["block_n"], p["num_warps"], p["num_stages"]
        splits = math.ceil(kv / stride)
        units = seqs * kv_heads * splits
        waves = math.ceil(units / SMS)
        tiles = math.ceil(min(stride, kv) / bn)
        tile_bytes = bn * head_dim * 2 * 2
        bw_eff = (BW / SMS) * min(1.0, 0.35 + 0.65 * w * s / 12) * bn / (bn + 24)
        compute = 4 * bn * head_dim * 8 / (PEAK_SM * 0.3) * (1 + 0.2 * abs(math.log2(w / 4)))
        t = waves * tiles * (max(tile_bytes / bw_eff, compute) + 0.15e-6) + 3e-6
        if splits > 1:
            t += t_comb + seqs * kv_heads * splits * 2e-9 * head_dim / 64
        return t * _noise(seed, a, call, sigma)

    calls = {}
    for _ in range(rng.randint(4, 40)):
        seqs = rng.choice((1, 2, 4, 8, 16, 32, 64, 128, 256))
        kv = int(math.exp(rng.uniform(math.log(64), math.log(max_ctx))))
        calls[(seqs, kv)] = 1 + int(rng.paretovariate(1.1) * 10)
    return axes, legal_if, cost, Workload.from_counts(calls)


def _tile2d(rng, seed):
    step = 16
    axes = {"block_m": tuple(range(step, 257, step)), "block_n": tuple(range(step, 257, step))}
    nk = [(rng.choice((2048, 4096, 8192)), rng.choice((2048, 4096)))]
    ai = rng.uniform(8, 32)
    sigma = rng.uniform(0.0, 0.01)

    def legal_if(a):
        return a["block_m"] * a["block_n"] <= 128 * 256

    def cost(a, call):
        m, n, k = call
        bm, bn = a["block_m"], a["block_n"]
        tiles = math.ceil(m / bm) * math.ceil(n / bn)
        waves = math.ceil(tiles / SMS)
        pow2 = 1.0 if (bm & (bm - 1)) == 0 and (bn & (bn - 1)) == 0 else POW2
        intensity = bm * bn / (bm + bn)
        compute = 2 * bm * bn * k / (PEAK_SM * intensity / (intensity + ai)) * pow2
        memory = (bm + bn) * k * 2 / (BW / SMS)
        t = waves * max(compute, memory) + 4e-6
        return t * _noise(seed, a, call, sigma)

    calls = {}
    for _ in range(rng.randint(4, 40)):
        m = int(math.exp(rng.uniform(0, math.log(8192))))
        n, k = nk[0]
        calls[(m, n, k)] = 1 + int(rng.paretovariate(1.1) * 10)
    return axes, legal_if, cost, Workload.from_counts(calls)


KINDS = (_gemm, _attention, _tile2d)


def synthetic_family(seed):
    rng = random.Random(seed)
    kind = KINDS[seed % len(KINDS)]
    while True:
        axes, legal_if, cost, workload = kind(rng, seed)
        legal = [a for a in FamilyGrid.product("x", axes, {n: v[0] for n, v in axes.items()}, None).legal
                 if legal_if(a)]
        if len(legal) >= 200:
            break
    default = rng.choice(legal)
    grid = FamilyGrid(f"{kind.__name__[1:]}{seed}", axes, tuple(legal), default)
    return grid, workload, cost
