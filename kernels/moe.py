"""Top-k routing and fused MoE experts (Qwen3-MoE's rule), batch-invariant with MoeParams.

route: softmax over experts in fp32, top-k with ties broken towards the lower expert id (a stable
descending sort, not torch.topk, whose tie order is unspecified), optional renormalisation over the k kept
weights. Every step is row-local (softmax and sort over the last dim were measured row-invariant).

fused_moe with params: rows are grouped by expert; each expert's two GEMMs run through gemm.linear with the
params' GemmParams, so a row's expert output does not depend on which (or how many) other rows chose the
same expert: the chunking fixes M. The k expert outputs of a row are then summed in slot order (slot 0 first)
in fp32, weighted by the fp32 routing weights, and cast to x's dtype once.
params=None (stock): the same grouping with F.linear on each expert's whole group (M = group size, which the
batch decides) and HF's accumulation (index_add_ in x's dtype, in expert order).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from detent_audit.errors import BadInput
from detent_audit.kernels.gemm import linear
from detent_audit.kernels.params import MoeParams
from detent_audit.kernels.rowlocal import silu_and_mul


class Routing(NamedTuple):
    weights: torch.Tensor  # [M, k] fp32, slot order = descending probability, ties by lower expert id
    ids: torch.Tensor  # [M, k] int64 expert ids


@torch.no_grad()
def route(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> Routing:
    """router_logits: [M, E] -> the top_k experts of every row and their weights."""
    num_experts = router_logits.shape[-1]
    if not 1 <= top_k <= num_experts:
        raise BadInput(f"top_k={top_k} outside 1..{num_experts} experts")
    probs = torch.softmax(router_logits.float(), dim=-1)
    sorted_probs, order = torch.sort(probs, dim=-1, descending=True, stable=True)
    weights, ids = sorted_probs[:, :top_k], order[:, :top_k]
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return Routing(weights.contiguous(), ids.contiguous())


def _expert_mlp(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                params: MoeParams | None) -> torch.Tensor:
    """x: [n, H], w13: [2I, H] (gate then up), w2: [H, I] -> [n, H]."""
    gemm_params = params.gemm if params is not None else None
    hidden = linear(x, w13, params=gemm_params)
    return linear(silu_and_mul(hidden), w2, params=gemm_params)


@torch.no_grad()
def fused_moe(
    x: torch.Tensor,
    router_logits: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    top_k: int,
    renormalize: bool,
    *,
    params: MoeParams | None = None,
) -> torch.Tensor:
    """x: [M, H], router_logits: [M, E], w13: [E, 2I, H], w2: [E, H, I] -> [M, H] in x's dtype.

    With params, row i of the output depends only on x[i], router_logits[i] and the weights.
    """
    tokens, hidden = x.shape
    if w13.shape[0] != router_logits.shape[-1] or w2.shape[0] != w13.shape[0]:
        raise BadInput(f"{router_logits.shape[-1]} router logits for {w13.shape[0]} / {w2.shape[0]} experts")
    weights, ids = route(router_logits, top_k, renormalize)
    flat_ids = ids.flatten()  # [M*k], entry r*k + s is row r's slot s
    order = torch.sort(flat_ids, stable=True).indices  # grouped by expert, rows ascending within a group
    counts = torch.bincount(flat_ids, minlength=w13.shape[0]).tolist()
    if params is None:
        out = torch.zeros_like(x)
        start = 0
        for expert, count in enumerate(counts):
            entries = order[start : start + count]
            start += count
            if count:
                rows = entries // top_k
                y = _expert_mlp(x[rows], w13[expert], w2[expert], None)
                out.index_add_(0, rows, y * weights.flatten()[entries, None].to(x.dtype))
        return out
    slot_out = x.new_empty(tokens * top_k, hidden)  # [M*k, H], row r slot s at r*k + s
    start = 0
    for expert, count in enumerate(counts):
        entries = order[start : start + count]
        start += count
        if count:
            slot_out[entries] = _expert_mlp(x[entries // top_k], w13[expert], w2[expert], params)
    slot_out = slot_out.view(tokens, top_k, hidden).float()
    total = slot_out[:, 0] * weights[:, :1]
    for slot in range(1, top_k):
        total = total + slot_out[:, slot] * weights[:, slot : slot + 1]
    return total.to(x.dtype)

