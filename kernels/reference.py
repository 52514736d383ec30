"""float64 references with the kernels' signatures: what every kernel approximates.

Each takes the same arguments as its kernel (params are accepted and ignored) and returns float64. They are
written for clarity (dense, per sequence), not speed, and are used only by tests and the GPU tier.
"""

from __future__ import annotations

import torch

from detent_audit.kernels.attention_metadata import AttentionMetadata
from detent_audit.kernels.moe import Routing
from detent_audit.kernels.rowlocal import RopeCache, RotatedQK

D = torch.float64


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
           params=None) -> torch.Tensor:
    out = x.to(D) @ weight.to(D).t()
    return out if bias is None else out + bias.to(D)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xd = x.to(D)
    return weight.to(D) * xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + eps)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.to(D).chunk(2, dim=-1)
    return gate * torch.sigmoid(gate) * up


def log_softmax(x: torch.Tensor) -> torch.Tensor:
    return torch.log_softmax(x.to(D), dim=-1)


def rope(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin: RopeCache) -> RotatedQK:
    """Applies the same tables (they define the model, fp32 as HF builds them) in float64."""
    cos = cos_sin.cos[positions].to(D).unsqueeze(1)
    sin = cos_sin.sin[positions].to(D).unsqueeze(1)

    def rotate(x: torch.Tensor) -> torch.Tensor:
        x1, x2 = x.to(D).chunk(2, dim=-1)
        return x.to(D) * cos + torch.cat((-x2, x1), dim=-1) * sin

    return RotatedQK(rotate(q), rotate(k))


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    *,
    scale: float,
    params=None,
) -> torch.Tensor:
    """Dense causal softmax(q k^T * scale) v per sequence, KV read back from the paged cache."""
    tokens, q_heads, dim = q.shape
    block_size, kv_heads = k_cache.shape[1], k_cache.shape[2]
    out = torch.empty(tokens, q_heads, dim, dtype=D)
    cu, ctx, lens = meta.cu_seqlens_q.tolist(), meta.context_lens.tolist(), meta.seq_lens.tolist()
    for i in range(meta.num_seqs):
        pos = torch.arange(lens[i])
        slots = meta.block_tables[i, pos // block_size] * block_size + pos % block_size
        k = k_cache.view(-1, kv_heads, dim)[slots].to(D).repeat_interleave(q_heads // kv_heads, dim=1)
        v = v_cache.view(-1, kv_heads, dim)[slots].to(D).repeat_interleave(q_heads // kv_heads, dim=1)
        qi = q[cu[i] : cu[i + 1]].to(D)  # [n, Hq, D]
        scores = torch.einsum("nhd,khd->hnk", qi, k) * scale
        q_pos = ctx[i] + torch.arange(cu[i + 1] - cu[i])
        scores = scores.masked_fill(pos[None, None, :] > q_pos[None, :, None], -torch.inf)
        out[cu[i] : cu[i + 1]] = torch.einsum("hnk,khd->nhd", torch.softmax(scores, dim=-1), v)
    return out


def route(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> Routing:
    probs = torch.softmax(router_logits.to(D), dim=-1)
    weights, ids = torch.sort(probs, dim=-1, descending=True, stable=True)
    weights, ids = weights[:, :top_k], ids[:, :top_k]
    return Routing(weights / weights.sum(-1, keepdim=True) if renormalize else weights, ids)


def fused_moe(
    x: torch.Tensor,
    router_logits: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    top_k: int,
    renormalize: bool,
    *,
    params=None,
) -> torch.Tensor:
    weights, ids = route(router_logits, top_k, renormalize)
    out = torch.zeros(x.shape, dtype=D)
    for row in range(x.shape[0]):
        for slot in range(top_k):
            expert = int(ids[row, slot])
            hidden = silu_and_mul(linear(x[row : row + 1], w13[expert]))
            out[row] += weights[row, slot] * linear(hidden, w2[expert])[0]
    return out
