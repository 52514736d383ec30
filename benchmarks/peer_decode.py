"""An outside peer for the decode step: a plain Llama decode step written for speed alone, as gpt-fast writes
one. bf16 weights (random, the engine's shape), a static KV cache [B, kv_heads, max_len, head_dim] per layer
attended through with a position mask (SDPA), the rest of each layer `torch.compile`d, the whole step
(embedding, layers, LM head, argmax) captured in one CUDA graph. No paging, no scheduler, no batch
invariance: the speed a serving engine's decode step is measured against.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class Shape:
    hidden: int
    inter: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    eps: float = 1e-5
    theta: float = 500000.0

    @classmethod
    def of(cls, c) -> Shape:
        """From a `ModelConfig` (the engine's)."""
        return cls(c.hidden_size, c.intermediate_size, c.num_hidden_layers, c.num_attention_heads,
                   c.num_key_value_heads, c.head_dim, c.vocab_size, c.rms_norm_eps)


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * w


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.float().chunk(2, dim=-1)  # x: [B, heads, D]; cos/sin: [B, 1, D/2]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)


def pre_attention(x, w_norm, w_qkv, cos, sin, s: Shape):
    """x [B, H] -> q [B, Hkv, G, D] (the G query heads of each KV head), k, v [B, Hkv, D]."""
    b = x.shape[0]
    qkv = _rms(x, w_norm, s.eps) @ w_qkv.t()
    q, k, v = qkv.split([s.heads * s.head_dim, s.kv_heads * s.head_dim, s.kv_heads * s.head_dim], dim=-1)
    q = _rope(q.view(b, s.heads, s.head_dim), cos, sin)
    k = _rope(k.view(b, s.kv_heads, s.head_dim), cos, sin)
    return q.view(b, s.kv_heads, s.heads // s.kv_heads, s.head_dim), k, v.view(b, s.kv_heads, s.head_dim)


def post_attention(x, o, w_o, w_norm, w_gu, w_down, s: Shape):
    """The output projection and the MLP, with their residuals: x [B, H], o [B, Hkv, G, D]."""
    x = x + o.reshape(x.shape[0], -1) @ w_o.t()
    gate, up = (_rms(x, w_norm, s.eps) @ w_gu.t()).chunk(2, dim=-1)
    return x + (F.silu(gate) * up) @ w_down.t()


class PeerDecoder:
    """Random weights of `shape` and a static KV cache of `batch` x `max_len` on `device`; `step()` replays
    one decode step of every row at its own position (the tokens and positions live on the device)."""

    def __init__(self, shape: Shape, batch: int, max_len: int, device: str = "cuda", seed: int = 0) -> None:
        g = torch.Generator(device=device).manual_seed(seed)
        s, dt = shape, torch.bfloat16

        def w(*size: int) -> torch.Tensor:
            return (0.02 * torch.randn(*size, generator=g, device=device)).to(dt)

        qkv = (s.heads + 2 * s.kv_heads) * s.head_dim
        self.shape, self.batch, self.max_len = s, batch, max_len
        self.embed, self.lm_head = w(s.vocab, s.hidden), w(s.vocab, s.hidden)
        self.norm = torch.ones(s.hidden, dtype=dt, device=device)
        self.layers = [(torch.ones(s.hidden, dtype=dt, device=device), w(qkv, s.hidden),
                        w(s.hidden, s.heads * s.head_dim), torch.ones(s.hidden, dtype=dt, device=device),
                        w(2 * s.inter, s.hidden), w(s.hidden, s.inter)) for _ in range(s.layers)]
        kv = (batch, s.kv_heads, max_len, s.head_dim)
        self.k = [torch.randn(kv, generator=g, device=device).to(dt) for _ in range(s.layers)]
        self.v = [torch.randn(kv, generator=g, device=device).to(dt) for _ in range(s.layers)]
        self.ids = torch.randint(0, s.vocab, (batch,), generator=g, device=device)
        self.pos = torch.zeros(batch, dtype=torch.int64, device=device)
        inv = 1.0 / (s.theta ** (torch.arange(0, s.head_dim, 2, device=device).float() / s.head_dim))
        self.inv_freq = inv
        self.span = torch.arange(max_len, device=device)
        self.pre = torch.compile(pre_attention, fullgraph=True, dynamic=False)
        self.post = torch.compile(post_attention, fullgraph=True, dynamic=False)
        self.graph: torch.cuda.CUDAGraph | None = None

    def _forward(self) -> torch.Tensor:
        s = self.shape
        angles = self.pos.float()[:, None] * self.inv_freq[None, :]
        cos, sin = angles.cos()[:, None, :], angles.sin()[:, None, :]
        mask = (self.span[None, :] <= self.pos[:, None])[:, None, None, :]  # [B, 1, 1, S]
        x = self.embed[self.ids]
        rows = torch.arange(self.batch, device=x.device)
        for (n1, w_qkv, w_o, n2, gu, down), k_cache, v_cache in zip(self.layers, self.k, self.v):
            q, k, v = self.pre(x, n1, w_qkv, cos, sin, s)
            k_cache[rows, :, self.pos] = k  # the static cache, written at each row's position
            v_cache[rows, :, self.pos] = v
            o = F.scaled_dot_product_attention(q, k_cache, v_cache, attn_mask=mask)  # [B, Hkv, G, D]
            x = self.post(x, o, w_o, n2, gu, down, s)
        logits = _rms(x, self.norm, s.eps) @ self.lm_head.t()
        next_ids = logits.argmax(-1)
        self.ids.copy_(next_ids)
        self.pos.add_(1)
        return next_ids

    def capture(self, position: int) -> None:
        """Compile, warm up and capture the step, every row at `position`."""
        self.pos.fill_(position)
        for _ in range(3):
            self._forward()
        torch.cuda.synchronize()
        self.pos.fill_(position)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.tokens = self._forward()
        self.pos.fill_(position)

    def step(self) -> list[int]:
        """One decode step; its tokens to the host (as a server's loop needs them)."""
        assert self.graph is not None
        self.graph.replay()
        return self.tokens.tolist()

    def weight_bytes(self) -> int:
        """What a step must read of the weights (the embedding table: one row per token, not counted)."""
        return sum(t.numel() * t.element_size() for layer in self.layers for t in layer) + \
            self.lm_head.numel() * self.lm_head.element_size()
