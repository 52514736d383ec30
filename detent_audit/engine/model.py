"""The decoder: Llama 3.x, Qwen2/2.5, Qwen3 and Qwen3-MoE as one module tree over a `KernelSet`.

Every reduction happens inside a kernel call (`ks.linear`, `ks.attention`, `ks.moe`, `ks.rms_norm`, ...); the
model itself only gathers, splits, reshapes and adds, all row by row, so a token's bits are the kernels'
business alone. Tokens are flattened: a step's input is `[T]` token ids from any mix of prefill chunks and
decode tokens, described by the attention metadata.

Each module owns its parameters' loading: `shard_ids(name)` lists the pieces a parameter is assembled from
(q/k/v of a fused projection, gate/up, one expert's slices), `shard_shape(name, shard)` gives a piece's
checkpoint shape and `weight_loader(name, tensor, shard, source)` copies one piece in, checking that shape
(`BadCheckpoint` naming `source`, the checkpoint tensor). `loader.py` maps checkpoint names onto these.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from detent_audit.kernels.rowlocal import RopeCache
from detent_audit.runtime.errors import BadCheckpoint
from detent_audit.runtime.model_config import ModelConfig

if TYPE_CHECKING:
    from detent_audit.kernels import Kernels
    from detent_audit.kernels.attention import AttentionMetadata

KVCache = tuple[torch.Tensor, torch.Tensor]  # k, v: [num_blocks, block_size, num_kv_heads, head_dim]


def copy_checked(dst: torch.Tensor, src: torch.Tensor, source: str) -> None:
    """Copy `src` into `dst` (casting to its dtype); a shape mismatch is `BadCheckpoint` naming `source`."""
    if tuple(src.shape) != tuple(dst.shape):
        raise BadCheckpoint(f"{source}: shape {tuple(src.shape)} where the model needs {tuple(dst.shape)}")
    with torch.no_grad():
        dst.copy_(src)


class Weights(nn.Module):
    """A module whose parameters each load from one checkpoint tensor (override for fused parameters)."""

    def shard_ids(self, name: str) -> tuple[str | None, ...]:
        return (None,)

    def shard_shape(self, name: str, shard: str | None) -> tuple[int, ...]:
        return tuple(getattr(self, name).shape)

    def weight_loader(self, name: str, loaded: torch.Tensor, shard: str | None, source: str) -> None:
        copy_checked(getattr(self, name), loaded, source)


def _param(*shape: int, dtype: torch.dtype, device: torch.device | str | None) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=dtype, device=device), requires_grad=False)


class Linear(Weights):
    """y = x W^T + b with W: [out, in]. `parts` names the row blocks a fused W is stacked from, in order."""

    def __init__(self, in_features: int, parts: dict[str | None, int], bias: bool, dtype: torch.dtype,
                 device: torch.device | str | None) -> None:
        super().__init__()
        self.parts = dict(parts)
        out_features = sum(self.parts.values())
        self.weight = _param(out_features, in_features, dtype=dtype, device=device)
        self.bias = _param(out_features, dtype=dtype, device=device) if bias else None

    def shard_ids(self, name: str) -> tuple[str | None, ...]:
        return tuple(self.parts)

    def shard_shape(self, name: str, shard: str | None) -> tuple[int, ...]:
        return (self.parts[shard], *getattr(self, name).shape[1:])

    def weight_loader(self, name: str, loaded: torch.Tensor, shard: str | None, source: str) -> None:
        offset = 0
        for part, rows in self.parts.items():
            if part == shard:
                copy_checked(getattr(self, name).narrow(0, offset, rows), loaded, source)
                return
            offset += rows
        raise KeyError(f"{source}: no part {shard!r} in {list(self.parts)}")

    def forward(self, x: torch.Tensor, ks: Kernels) -> torch.Tensor:
        return ks.linear(x, self.weight, self.bias)  # [M, in] -> [M, out]


class RMSNorm(Weights):
    def __init__(self, dim: int, eps: float, dtype: torch.dtype, device: torch.device | str | None) -> None:
        super().__init__()
        self.eps = eps
        self.weight = _param(dim, dtype=dtype, device=device)

    def forward(self, x: torch.Tensor, ks: Kernels) -> torch.Tensor:
        # x: [..., dim]; flattened to rows so the kernel sees a 2-D input
        return ks.rms_norm(x.reshape(-1, x.shape[-1]), self.weight, self.eps).view(x.shape)


class Embedding(Weights):
    def __init__(self, vocab: int, dim: int, dtype: torch.dtype, device: torch.device | str | None) -> None:
        super().__init__()
        self.weight = _param(vocab, dim, dtype=dtype, device=device)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(input_ids, self.weight)  # [T] -> [T, H]: a gather, no arithmetic


class Attention(nn.Module):
    def __init__(self, c: ModelConfig, dtype: torch.dtype, device: torch.device | str | None) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads = c.num_attention_heads, c.num_key_value_heads
        self.head_dim = c.head_dim
        self.q_size, self.kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.scale = self.head_dim ** -0.5
        self.qkv_proj = Linear(c.hidden_size, {"q": self.q_size, "k": self.kv_size, "v": self.kv_size},
                               c.attention_bias, dtype, device)
        self.o_proj = Linear(self.q_size, {None: c.hidden_size}, c.o_proj_bias, dtype, device)
        self.q_norm = RMSNorm(self.head_dim, c.rms_norm_eps, dtype, device) if c.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, c.rms_norm_eps, dtype, device) if c.qk_norm else None

    def forward(self, x: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata, kv_cache: KVCache,
                rope: RopeCache, ks: Kernels) -> torch.Tensor:
        t = x.shape[0]
        qkv = self.qkv_proj(x, ks)  # [T, (Hq + 2 Hkv) D]
        q_norm = self.q_norm.weight if self.q_norm is not None else None
        k_norm = self.k_norm.weight if self.k_norm is not None else None
        eps = self.q_norm.eps if self.q_norm is not None else 0.0
        # q: [T, Hq, D]; k and v (normed and rotated as the model says) are written into the paged cache
        heads = (self.num_heads, self.num_kv_heads, self.head_dim)
        q = ks.qkv_prologue(qkv, positions, rope, heads, kv_cache, meta.slot_mapping, q_norm, k_norm, eps)
        k_cache, v_cache = kv_cache
        o = ks.attention(q, k_cache, v_cache, meta, self.scale)  # [T, Hq, D]
        return self.o_proj(o.reshape(t, self.q_size), ks)  # [T, H]


class MLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int, dtype: torch.dtype,
                 device: torch.device | str | None) -> None:
        super().__init__()
        self.gate_up_proj = Linear(hidden, {"gate": intermediate, "up": intermediate}, False, dtype, device)
        self.down_proj = Linear(intermediate, {None: hidden}, False, dtype, device)

    def forward(self, x: torch.Tensor, ks: Kernels) -> torch.Tensor:
        # [T,H] -> [T,2I] -> [T,I] -> [T,H]
        return self.down_proj(ks.silu_and_mul(self.gate_up_proj(x, ks)), ks)


class Experts(Weights):
    """All experts' weights stacked: w13 [E, 2I, H] (gate rows then up rows), w2 [E, H, I]."""

    def __init__(self, num_experts: int, hidden: int, intermediate: int, dtype: torch.dtype,
                 device: torch.device | str | None) -> None:
        super().__init__()
        self.num_experts, self.intermediate = num_experts, intermediate
        self.w13 = _param(num_experts, 2 * intermediate, hidden, dtype=dtype, device=device)
        self.w2 = _param(num_experts, hidden, intermediate, dtype=dtype, device=device)

    def shard_ids(self, name: str) -> tuple[str | None, ...]:
        if name == "w2":
            return tuple(f"{e}" for e in range(self.num_experts))
        return tuple(f"{e}.{part}" for e in range(self.num_experts) for part in ("gate", "up"))

    def shard_shape(self, name: str, shard: str | None) -> tuple[int, ...]:
        _, hidden, intermediate = self.w2.shape
        return (hidden, intermediate) if name == "w2" else (intermediate, hidden)

    def weight_loader(self, name: str, loaded: torch.Tensor, shard: str | None, source: str) -> None:
        expert, _, part = str(shard).partition(".")
        dst = getattr(self, name)[int(expert)]
        if part:
            dst = dst.narrow(0, 0 if part == "gate" else self.intermediate, self.intermediate)
        copy_checked(dst, loaded, source)


class SparseMoE(nn.Module):
    def __init__(self, c: ModelConfig, dtype: torch.dtype, device: torch.device | str | None) -> None:
        super().__init__()
        self.top_k, self.renormalize = c.num_experts_per_tok, c.norm_topk_prob
        self.gate = Linear(c.hidden_size, {None: c.num_experts}, False, dtype, device)  # the router
        self.experts = Experts(c.num_experts, c.hidden_size, c.moe_intermediate_size, dtype, device)

    def forward(self, x: torch.Tensor, ks: Kernels) -> torch.Tensor:
        router_logits = self.gate(x, ks)  # [T, E]
        return ks.moe(x, router_logits, self.experts.w13, self.experts.w2, self.top_k, self.renormalize)


class DecoderLayer(nn.Module):
    def __init__(self, c: ModelConfig, layer: int, dtype: torch.dtype,
                 device: torch.device | str | None) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps, dtype, device)
        self.self_attn = Attention(c, dtype, device)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps, dtype, device)
        self.mlp: MLP | SparseMoE = (SparseMoE(c, dtype, device) if c.is_moe_layer(layer)
                                     else MLP(c.hidden_size, c.intermediate_size, dtype, device))

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, positions: torch.Tensor,
                meta: AttentionMetadata, kv_cache: KVCache, rope: RopeCache, ks: Kernels
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """(x, residual) -> (this layer's MLP output, the residual stream before it is added). The hidden
        state is residual + x, added by the next norm (one launch on a GPU); the first layer gets
        residual None."""
        if residual is None:
            residual, normed = x, self.input_layernorm(x, ks)
        else:
            norm = self.input_layernorm
            normed, residual = ks.add_rms_norm(x, residual, norm.weight, norm.eps)
        attn = self.self_attn(normed, positions, meta, kv_cache, rope, ks)
        norm = self.post_attention_layernorm
        normed, residual = ks.add_rms_norm(attn, residual, norm.weight, norm.eps)  # h + attn, and its norm
        return self.mlp(normed, ks), residual


class CausalLM(nn.Module):
    """The decoder. Parameters live on `device` ('meta' while loading); `rope` is built by `build_rope`."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype = torch.float32,
                 device: torch.device | str | None = None) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = Embedding(config.vocab_size, config.hidden_size, dtype, device)
        self.layers = nn.ModuleList(DecoderLayer(config, i, dtype, device)
                                    for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype, device)
        self.lm_head = (None if config.tie_word_embeddings
                        else Linear(config.hidden_size, {None: config.vocab_size}, False, dtype, device))
        self.rope: RopeCache | None = None
        if torch.device(device or "cpu").type != "meta":
            self.build_rope(device)

    def build_rope(self, device: torch.device | str | None) -> None:
        """Build the cos/sin table (not a parameter, so building on 'meta' leaves it to this call)."""
        c = self.config
        scaling = c.rope_scaling.as_dict() if c.rope_scaling else None
        table = RopeCache.build(c.head_dim, c.rope_theta, c.max_position_embeddings, scaling)  # fp32, CPU
        self.rope = RopeCache(cos=table.cos.to(device or "cpu"), sin=table.sin.to(device or "cpu"))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                kv_caches: list[KVCache], ks: Kernels) -> torch.Tensor:
        """input_ids, positions: [T] -> final-normed hidden states [T, H]; writes the tokens' K/V in place."""
        if self.rope is None:
            raise RuntimeError("CausalLM.build_rope(device) was not called after loading")
        x, residual = self.embed_tokens(input_ids), None  # [T, H]
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            x, residual = layer(x, residual, positions, meta, kv_cache, self.rope, ks)
        if residual is None:  # no layers
            return self.norm(x, ks)
        return ks.add_rms_norm(x, residual, self.norm.weight, self.norm.eps)[0]

    def new_kv_caches(self, num_blocks: int, block_size: int, device: torch.device | str) -> list[KVCache]:
        """Zeroed paged KV caches, one (k, v) per layer, each [num_blocks, block_size, kv_heads, head_dim]."""
        c, dtype = self.config, self.embed_tokens.weight.dtype
        shape = (num_blocks, block_size, c.num_key_value_heads, c.head_dim)
        return [(torch.zeros(shape, dtype=dtype, device=device),
                 torch.zeros(shape, dtype=dtype, device=device))
                for _ in range(c.num_hidden_layers)]

    def gemm_shapes(self) -> list[tuple[int, int]]:
        """(N, K) of every weight the gemm family multiplies: the projections and the LM head."""
        weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        shapes = {tuple(m.weight.shape) for m in self.modules() if isinstance(m, Linear)}
        return sorted(shapes | {tuple(weight.shape)})

    def compute_logits(self, hidden: torch.Tensor, ks: Kernels) -> torch.Tensor:
        """hidden: [n, H] -> fp32 logits [n, V] (LM head tied to the embedding when the config says so)."""
        weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return ks.linear(hidden, weight).float()
