"""Row-local ops: RMSNorm, SiLU-and-mul, RoPE, log_softmax. Batch-invariant by construction.

Each op reads one row (one token) and writes one row; the only care needed is that torch's own kernel for
each step is row-local in its *bits*. Two are not (tests/kernels/test_kernel_rowlocal.py holds both facts and
what was measured): a wide sum over the last dim, which threads split for a lone row but not for a row in a
batch, so `_row_sum` reduces in fixed 4096-wide blocks, then over the blocks; and fp32 sigmoid/SiLU, whose
bits depend on where an element falls in the vectorised loop, so SiLU is computed as g / (1 + exp(-g)).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F

from detent_audit import isa
from detent_audit.errors import BadInput
from detent_audit.kernels.rowlocal_c import sincos

# Below torch's GRAIN_SIZE (32768): one output of width <= this is always reduced by a single thread.
_SUM_BLOCK = 4096


def _row_sum(x: torch.Tensor) -> torch.Tensor:
    """Sum over the last dim with a reduction order fixed by the width alone.  x: [..., D] -> [..., 1]."""
    width = x.shape[-1]
    if width <= _SUM_BLOCK:
        return x.sum(-1, keepdim=True)
    blocks = -(-width // _SUM_BLOCK)
    padded = F.pad(x, (0, blocks * _SUM_BLOCK - width))  # + 0.0 is exact
    return padded.unflatten(-1, (blocks, _SUM_BLOCK)).sum(-1).sum(-1, keepdim=True)


@torch.no_grad()
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF Llama/Qwen RMSNorm.  x: [..., D], weight: [D] -> [..., D] in x's dtype.

    Math in fp32; the normalised row is cast to x's dtype before the weight multiply, as HF does.
    """
    xf = x.float()
    variance = _row_sum(xf * xf) / x.shape[-1]
    normed = xf * torch.rsqrt(variance + eps)
    return weight * normed.to(x.dtype)


@torch.no_grad()
def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x: [..., 2I] (gate then up) -> silu(gate) * up: [..., I] in x's dtype.

    silu is g / (1 + exp(-g)) in fp32 (torch's fp32 sigmoid is position-dependent, see module docstring),
    cast to x's dtype, then multiplied by up in x's dtype (HF's rounding points).
    """
    gate, up = x.chunk(2, dim=-1)
    g = gate.float()
    act = g / (1.0 + torch.exp(-g))
    return act.to(x.dtype) * up


@torch.no_grad()
def log_softmax(x: torch.Tensor) -> torch.Tensor:
    """log_softmax over the last dim in fp32 (torch's kernel; measured row-invariant at every width)."""
    return torch.log_softmax(x.float(), dim=-1)


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    """HF `_compute_llama3_parameters`: rescale long wavelengths, interpolate the middle band."""
    try:
        factor = float(scaling["factor"])
        low = float(scaling["low_freq_factor"])
        high = float(scaling["high_freq_factor"])
        old_context = float(scaling["original_max_position_embeddings"])
    except KeyError as missing:
        raise BadInput(f"llama3 rope_scaling lacks {missing}",
                       remedy="copy rope_scaling from config.json") from None
    low_wavelen, high_wavelen = old_context / low, old_context / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


@dataclass(frozen=True)
class RopeCache:
    """cos/sin tables for neox-style (rotate_half) RoPE, as HF Llama/Qwen compute them, in fp32.

    cos, sin: [max_positions, head_dim] (the half-dim frequencies repeated twice). A row is looked up by
    absolute position, so a token's rotation depends only on its position.
    """

    cos: torch.Tensor
    sin: torch.Tensor

    @classmethod
    def build(
        cls, head_dim: int, rope_theta: float, max_positions: int, rope_scaling: dict | None = None
    ) -> RopeCache:
        if head_dim % 2 or head_dim <= 0 or max_positions <= 0:
            raise BadInput(f"RoPE needs an even head_dim and max_positions > 0, "
                           f"got {head_dim}, {max_positions}")
        inv_freq = 1.0 / (rope_theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
        rope_type = (rope_scaling or {}).get("rope_type", (rope_scaling or {}).get("type", "default"))
        if rope_type == "llama3":
            inv_freq = _llama3_inv_freq(inv_freq, rope_scaling or {})
        elif rope_type != "default":
            raise BadInput(f"unsupported rope_scaling type {rope_type!r}", remedy="use 'default' or 'llama3'")
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        if isa.capped():  # torch's sin and cos are MKL's, which choose code by the CPU (docs/isa.md)
            cos, sin = sincos(emb)
            return cls(cos=cos, sin=sin)
        return cls(cos=emb.cos(), sin=emb.sin())

    @property
    def max_positions(self) -> int:
        return self.cos.shape[0]


def fixed_order_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """A hosted engine's RoPE table, [positions, 2 * len(inv_freq)]: cos then sin of each position times each
    frequency (one float32 product, as vLLM's and SGLang's `einsum("i,j -> ij")` makes it), in the C order
    (`rowlocal_c.sincos`): what replaces their torch cos and sin (MKL's) under the portable setting."""
    cos, sin = sincos(torch.outer(positions.float(), inv_freq.float()))
    return torch.cat((cos, sin), dim=-1)


def rewrite_rope_tables(model: torch.nn.Module, rope_class: type[torch.nn.Module], engine: str) -> int:
    """Every RoPE table of a hosted engine's `model` (its modules of `rope_class`, vLLM's or SGLang's, each
    once: layers share one) rewritten in place by `fixed_order_cos_sin`, over the table's own rows from the
    module's `position_start` (0 where it has none), with the module's own frequencies. A class that builds
    its table its own way (a scaled variant overrides `_compute_cos_sin_cache`) is refused, and so is a model
    without a table. The number of tables rewritten."""
    done: set[int] = set()
    for module in model.modules():
        if not isinstance(module, rope_class) or id(module) in done:
            continue
        # class attributes the engines' classes have and nn.Module's type does not declare (hence getattr)
        own_table = getattr(type(module), "_compute_cos_sin_cache")  # noqa: B009
        if own_table is not getattr(rope_class, "_compute_cos_sin_cache"):  # noqa: B009
            raise NotImplementedError(f"{type(module).__name__} builds its RoPE table its own way: the "
                                      "portable setting covers the plain and llama3 RoPE")
        start = getattr(module, "position_start", 0)
        rows = module.cos_sin_cache.shape[0]  # SGLang's table may run past the model's positions
        positions = torch.arange(start, start + rows, dtype=torch.float32)
        table = fixed_order_cos_sin(positions, module._compute_inv_freq(module.base))
        module.cos_sin_cache.copy_(table.to(module.cos_sin_cache.dtype))
        done.add(id(module))
    if not done:
        raise RuntimeError(f"the portable setting found no RoPE table to replace in {engine}'s model")
    return len(done)


class RotatedQK(NamedTuple):
    q: torch.Tensor  # [T, H, D]
    k: torch.Tensor  # [T, Hkv, D]


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, H, D] (any dtype), cos/sin: [T, 1, D] fp32 -> [T, H, D] in x's dtype."""
    xf = x.float()
    x1, x2 = xf.chunk(2, dim=-1)
    rotated = torch.cat((-x2, x1), dim=-1)
    return (xf * cos + rotated * sin).to(x.dtype)


@torch.no_grad()
def rope(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin: RopeCache) -> RotatedQK:
    """Rotate q: [T, H, D] and k: [T, Hkv, D] by their absolute positions [T] (fp32 math, cast back)."""
    if positions.numel() and int(positions.max()) >= cos_sin.max_positions:
        raise BadInput(
            f"position {int(positions.max())} beyond the RoPE table ({cos_sin.max_positions})",
            remedy="build the RopeCache with max_positions >= the model's context length",
        )
    cos = cos_sin.cos[positions].unsqueeze(1)
    sin = cos_sin.sin[positions].unsqueeze(1)
    return RotatedQK(_rotate(q, cos, sin), _rotate(k, cos, sin))
