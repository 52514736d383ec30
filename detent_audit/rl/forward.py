"""The differentiable forward: the engine's decoder (`CausalLM`) in plain torch ops, for the backward pass.

It reads the same parameters the serving kernels read (a trainer's optimizer updating them updates both) and
computes what they compute, in the order Hugging Face's Llama/Qwen modules do: RMSNorm, fused q/k/v with
optional bias and q/k-norm, neox RoPE from the model's own cos/sin table, causal SDPA with grouped KV heads,
SiLU-gated MLP, tied or separate LM head. Its values are close to the serving ones, not equal (any kernels);
`scorer.py` takes its gradients and the serving kernels' values. A batch is right-padded: with a causal mask
no real token attends to padding, so no attention mask is needed. MoE layers are not supported here.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch
import torch.nn.functional as F

from detent_audit.engine.model import MLP, CausalLM, RMSNorm
from detent_audit.errors import BadInput

Pair = tuple[Sequence[int], Sequence[int]]  # (prompt ids, completion ids)


class TokenScores(NamedTuple):
    """Per pair: the completion tokens' logprobs [n] and, if asked, the entropy of each position's
    distribution [n] (both in the compute dtype, fp32 at least)."""

    logprobs: list[torch.Tensor]
    entropies: list[torch.Tensor] | None


def _rms(x: torch.Tensor, norm: RMSNorm) -> torch.Tensor:
    xf = x.to(torch.promote_types(x.dtype, torch.float32))
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + norm.eps)).to(x.dtype) * norm.weight


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [B, L, H, D]; cos/sin: [L, 1, D] -> x rotated (neox: the halves swapped, the first negated)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def hidden_states(model: CausalLM, ids: torch.Tensor) -> torch.Tensor:
    """ids: [B, L] (right-padded) -> final-normed hidden states [B, L, H], differentiable in the weights."""
    if model.rope is None:
        raise RuntimeError("CausalLM.build_rope(device) was not called after loading")
    b, length = ids.shape
    x = F.embedding(ids, model.embed_tokens.weight)  # [B, L, H]
    cos = model.rope.cos[:length].to(x.dtype).unsqueeze(1)  # [L, 1, D]
    sin = model.rope.sin[:length].to(x.dtype).unsqueeze(1)
    for layer in model.layers:
        attn = layer.self_attn
        h = _rms(x, layer.input_layernorm)
        qkv = F.linear(h, attn.qkv_proj.weight, attn.qkv_proj.bias)  # [B, L, (Hq + 2 Hkv) D]
        q, k, v = qkv.split([attn.q_size, attn.kv_size, attn.kv_size], dim=-1)
        q = q.reshape(b, length, attn.num_heads, attn.head_dim)
        k = k.reshape(b, length, attn.num_kv_heads, attn.head_dim)
        v = v.reshape(b, length, attn.num_kv_heads, attn.head_dim)
        if attn.q_norm is not None and attn.k_norm is not None:
            q, k = _rms(q, attn.q_norm), _rms(k, attn.k_norm)
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                           is_causal=True, scale=attn.scale, enable_gqa=True)  # [B, Hq, L, D]
        o = o.transpose(1, 2).reshape(b, length, attn.q_size)  # [B, L, Hq D]
        x = x + F.linear(o, attn.o_proj.weight, attn.o_proj.bias)
        h = _rms(x, layer.post_attention_layernorm)
        if not isinstance(layer.mlp, MLP):
            raise BadInput("the differentiable forward has no MoE layer", remedy="score a dense model")
        gate, up = F.linear(h, layer.mlp.gate_up_proj.weight).chunk(2, dim=-1)
        x = x + F.linear(F.silu(gate) * up, layer.mlp.down_proj.weight)
    return _rms(x, model.norm)


def token_scores(model: CausalLM, pairs: Sequence[Pair], *, entropy: bool = False) -> TokenScores:
    """Teacher-forced logprobs of each pair's completion after its prompt, in one padded forward."""
    if not pairs:
        return TokenScores([], [] if entropy else None)
    for prompt, completion in pairs:
        if not prompt or not completion:
            raise BadInput("each pair needs at least one prompt and one completion token")
    seqs = [list(p) + list(c)[:-1] for p, c in pairs]  # the last completion token is only a target
    width = max(len(s) for s in seqs)
    device = model.embed_tokens.weight.device
    ids = torch.tensor([s + [0] * (width - len(s)) for s in seqs], dtype=torch.int64, device=device)
    hidden = hidden_states(model, ids)
    head = model.embed_tokens.weight if model.lm_head is None else model.lm_head.weight
    logprobs, entropies = [], []
    for row, (prompt, completion) in enumerate(pairs):
        # the logits at position len(prompt) - 1 + i predict completion[i]
        rows = hidden[row, len(prompt) - 1:len(prompt) - 1 + len(completion)]  # [n, H]
        logits = F.linear(rows, head)
        logits = logits.to(torch.promote_types(logits.dtype, torch.float32))  # [n, V]
        logp = torch.log_softmax(logits, dim=-1)
        targets = torch.tensor(list(completion), dtype=torch.int64, device=device)
        logprobs.append(logp.gather(1, targets[:, None]).squeeze(1))
        if entropy:
            entropies.append(-(logp.exp() * logp).sum(-1))
    return TokenScores(logprobs, entropies if entropy else None)
