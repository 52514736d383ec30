"""Batch-invariant kernels by family, and the KernelSet the model calls for every one of them.

A family's contract: for fixed parameters, a row's output bits depend only on that row's inputs (attention:
on its own KV and absolute positions). The CPU implementations are torch; a later GPU tier adds Triton
kernels behind the same signatures. What a kernel relies on of torch or the device is a fact its tests
check where they run (tests/kernels/), with what was measured.

`KernelSet` holds one *selector* per family: a callable from the call's runtime inputs to that family's
params. `stock` selectors return None (vendor kernels on the whole batch, batch-variant), `det` selectors
return one conservative setting, and `detent` selectors are the compiled SelIR selectors (with pins, they
return constants; `KernelSet.fixed` builds that case directly). Selector keyword arguments are part of the
interface: select_gemm(num_tokens=), select_attention(num_seqs=, max_seqlen_q=, max_seqlen_k=),
select_moe(num_tokens=).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Protocol

import torch

from detent_audit.enums import Mode
from detent_audit.errors import DetentError
from detent_audit.kernels import attention, attention_c, gemm, gemm_c, moe, rowlocal, rowlocal_c
from detent_audit.kernels.attention_metadata import AttentionMetadata
from detent_audit.kernels.params import AttentionParams, BadParams, GemmParams, MoeParams
from detent_audit.kernels.rowlocal import RopeCache, RotatedQK

MODES = tuple(m.value for m in Mode)

DET_GEMM = GemmParams(chunk_rows=16)
DET_ATTENTION = AttentionParams(kv_tile=64, split_stride=0)
DET_MOE = MoeParams(gemm=DET_GEMM)


class SelectorError(DetentError):
    """A selector returned params the family cannot use (or none, outside stock mode)."""

    remedy = "check the compiled selector for this family; stock mode is the only one without params"


def params_list(values) -> list[dict]:
    """Params objects as plain dicts (nested params as nested dicts), sorted, without repeats."""
    out = {repr(sorted(asdict(v).items())): asdict(v) for v in values}
    return [out[k] for k in sorted(out)]


def _constant(value):
    return lambda **_: value


class Kernels(Protocol):
    """The calls the model makes, every reduction inside one: what a kernel set on any device provides (the
    CPU `KernelSet` here, `gpu.GpuKernelSet` on CUDA; the type checker holds both to it). Mutates only the KV
    cache (`qkv_prologue`)."""

    @property
    def mode(self) -> str: ...

    def linear(self, x: torch.Tensor, weight: torch.Tensor,
               bias: torch.Tensor | None = None) -> torch.Tensor: ...
    def attention(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  meta: AttentionMetadata, scale: float) -> torch.Tensor: ...
    def qkv_prologue(self, qkv: torch.Tensor, positions: torch.Tensor, cos_sin: RopeCache,
                     heads: tuple[int, int, int], kv_cache: tuple[torch.Tensor, torch.Tensor],
                     slot_mapping: torch.Tensor, q_norm: torch.Tensor | None = None,
                     k_norm: torch.Tensor | None = None, eps: float = 0.0) -> torch.Tensor: ...
    def moe(self, x: torch.Tensor, router_logits: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
            top_k: int, renormalize: bool) -> torch.Tensor: ...
    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor: ...
    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
                     ) -> tuple[torch.Tensor, torch.Tensor]: ...
    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor: ...
    def log_softmax(self, x: torch.Tensor) -> torch.Tensor: ...


@dataclass(frozen=True)
class KernelSet:
    """What the model calls for every kernel. Immutable; selectors run at every call."""

    mode: str
    select_gemm: Callable[..., GemmParams | None]
    select_attention: Callable[..., AttentionParams | None]
    select_moe: Callable[..., MoeParams | None]
    # the portable ISA setting's kernels: the CPU attention and SiLU in C, every operation's order written out
    # (attention_c.py, rowlocal_c.py: the same bits on every CPU), not torch's (MKL's products, torch's exp)
    fixed_order: bool = False
    # family -> the params its kernels were called with so far (what the kernels report, not a configuration)
    called: dict[str, set] = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise BadParams(f"kernel mode must be one of {MODES}, got {self.mode!r}")
        for name in ("select_gemm", "select_attention", "select_moe"):
            if not callable(getattr(self, name)):
                raise BadParams(f"KernelSet.{name} must be callable")

    @classmethod
    def stock(cls) -> KernelSet:
        return cls(Mode.STOCK, _constant(None), _constant(None), _constant(None))

    @classmethod
    def det(cls) -> KernelSet:
        return cls(Mode.DET, _constant(DET_GEMM), _constant(DET_ATTENTION), _constant(DET_MOE))

    @classmethod
    def fixed(
        cls, gemm: GemmParams, attention: AttentionParams, moe: MoeParams | None = None
    ) -> KernelSet:
        """Constant params (a compiled detent selector whose pins fix every selection point)."""
        moe = moe if moe is not None else MoeParams(gemm=gemm)
        for value, kind in ((gemm, GemmParams), (attention, AttentionParams), (moe, MoeParams)):
            if not isinstance(value, kind):
                raise BadParams(f"KernelSet.fixed expects {kind.__name__}, got {type(value).__name__}")
        return cls(Mode.DETENT, _constant(gemm), _constant(attention), _constant(moe))

    def _checked(self, params, kind: type, family: str):
        if params is None and self.mode != Mode.STOCK:
            raise SelectorError(f"the {family} selector returned no params in {self.mode} mode")
        if params is not None and not isinstance(params, kind):
            raise SelectorError(f"the {family} selector returned {type(params).__name__}, "
                                f"not {kind.__name__}")
        if params is not None:
            self.called.setdefault(family, set()).add(params)
        return params

    def params_called(self) -> dict[str, list[dict]]:
        """family -> the params its kernels were called with so far, as sorted plain dicts."""
        # copies first: the engine thread may add to these while a signing thread reads them
        return {family: params_list(tuple(values)) for family, values in sorted(list(self.called.items()))}

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        num_tokens = x.numel() // x.shape[-1] if x.shape[-1] else 0
        params = self._checked(self.select_gemm(num_tokens=num_tokens), GemmParams, "gemm")
        return gemm.linear(x, weight, bias, params=params)

    def attention(
        self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
        scale: float
    ) -> torch.Tensor:
        selected = self.select_attention(
            num_seqs=meta.num_seqs, max_seqlen_q=meta.max_seqlen_q, max_seqlen_k=meta.max_seqlen_k
        )
        params = self._checked(selected, AttentionParams, "attention")
        if self.fixed_order and params is not None:
            return attention_c.paged_attention(q, k_cache, v_cache, meta, scale=scale, params=params)
        return attention.paged_attention(q, k_cache, v_cache, meta, scale=scale, params=params)

    def write_kv(self, k, v, k_cache, v_cache, slot_mapping) -> None:
        attention.write_kv(k, v, k_cache, v_cache, slot_mapping)

    def moe(self, x, router_logits, w13, w2, top_k: int, renormalize: bool) -> torch.Tensor:
        params = self._checked(self.select_moe(num_tokens=x.shape[0]), MoeParams, "moe")
        return moe.fused_moe(x, router_logits, w13, w2, top_k, renormalize, params=params)

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return rowlocal.rms_norm(x, weight, eps)

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        """(rms_norm(residual + x), residual + x): the residual add and the next norm (one launch on a
        GPU)."""
        total = residual + x
        return self.rms_norm(total.reshape(-1, total.shape[-1]), weight, eps).view(total.shape), total

    def qkv_prologue(self, qkv: torch.Tensor, positions: torch.Tensor, cos_sin: RopeCache,
                     heads: tuple[int, int, int], kv_cache: tuple[torch.Tensor, torch.Tensor],
                     slot_mapping: torch.Tensor, q_norm: torch.Tensor | None = None,
                     k_norm: torch.Tensor | None = None, eps: float = 0.0) -> torch.Tensor:
        """qkv: [T, (H + 2 HKV) D] -> q: [T, H, D]; splits q/k/v, applies the per-head norms (Qwen3) and RoPE,
        writes k and v into the cache. Mutates kv_cache. One launch on a GPU (kernels/triton_rowlocal.py)."""
        t = qkv.shape[0]
        h, hkv, d = heads
        q, k, v = qkv.split([h * d, hkv * d, hkv * d], dim=-1)
        q, k, v = q.reshape(t, h, d), k.reshape(t, hkv, d), v.reshape(t, hkv, d)
        if q_norm is not None and k_norm is not None:  # per head, before RoPE
            q = self.rms_norm(q.reshape(-1, d), q_norm, eps).view(t, h, d)
            k = self.rms_norm(k.reshape(-1, d), k_norm, eps).view(t, hkv, d)
        q, k = self.rope(q, k, positions, cos_sin)
        self.write_kv(k, v, kv_cache[0], kv_cache[1], slot_mapping)
        return q

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        if self.fixed_order and x.dtype == torch.float32 and x.device.type == "cpu":
            return rowlocal_c.silu_and_mul(x)
        return rowlocal.silu_and_mul(x)

    def rope(self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor,
             cos_sin: RopeCache) -> RotatedQK:
        return rowlocal.rope(q, k, positions, cos_sin)

    def log_softmax(self, x: torch.Tensor) -> torch.Tensor:
        return rowlocal.log_softmax(x)


def fixed_order_implementations() -> list[str]:
    """The versions of the portable setting's fixed-order C kernels (attention, GEMM, SiLU and the sampler's
    log), as facts record them: an engine that runs all of them names them (`runtime.fixed_order`)."""
    return [attention_c.IMPLEMENTATION, gemm_c.IMPLEMENTATION, rowlocal_c.IMPLEMENTATION]


__all__ = [
    "DET_ATTENTION",
    "DET_GEMM",
    "DET_MOE",
    "MODES",
    "AttentionMetadata",
    "AttentionParams",
    "GemmParams",
    "KernelSet",
    "MoeParams",
    "RopeCache",
    "SelectorError",
    "fixed_order_implementations",
]


if TYPE_CHECKING:
    def _satisfies(kernels: KernelSet) -> Kernels:
        return kernels  # the type checker holds KernelSet to the protocol
