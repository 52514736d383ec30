"""Tensor parallelism: the decoder split over N ranks, their partial sums added in rank order.

The bits of a TP=N forward are fixed by two things: each rank's kernels on its shard (batch-invariant already,
and selected from the per-rank shapes), and the order in which the all-reduce adds the ranks' partial sums.
The detent all-reduce does no arithmetic inside the collective: an all-gather of the partials, then a sum in
rank order 0..N-1 in float32 (`ordered_sum`). So one process that runs every rank's shard computation with the
per-rank shapes and adds the partials in the same order gets the TP=N bits exactly: *rank emulation*
(`EmulatedRanks`), which is how a verifier with fewer devices than the node re-executes, and how a TP=1
trainer scores TP=N rollouts. A plain TP=1 forward differs: its GEMMs have other shapes and its sums no
partials.

The split is vLLM's (`vllm/model_executor/layers/linear.py`, `vocab_parallel_embedding.py`): q/k/v and
gate/up column-parallel, o_proj and down row-parallel with the all-reduce after them, the embedding and the LM
head vocab-parallel (embedding rows masked, then all-reduced; logits gathered in rank order), attention heads
split per rank and KV heads replicated when there are fewer than ranks, MoE experts' intermediate dimension
split. Norms, the router and the residual stream are replicated: every rank computes them alike.

A rank's shard is a `CausalLM` built from `TPLayout.rank_config` (the per-rank head, KV head, MLP and vocab
sizes); `shard_from_full` cuts its parameters from the full model's by the table `SHARDING`, and checks that
every parameter of the shard was cut.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch
from torch import nn

from detent_audit.engine.model import CausalLM, KVCache
from detent_audit.errors import BadInput
from detent_audit.kernels.all_reduce import ACCUMULATE, BACKEND, ORDERED, ordered_sum  # noqa: F401
from detent_audit.runtime.model_config import ModelConfig

if TYPE_CHECKING:
    from detent_audit.kernels import Kernels
    from detent_audit.kernels.attention import AttentionMetadata



@dataclass(frozen=True)
class TPLayout:
    """How a model of `config` splits over `size` ranks. Exists only where the split is exact (`BadInput`
    naming both numbers otherwise)."""

    config: ModelConfig
    size: int

    def __post_init__(self) -> None:
        c, n = self.config, self.size
        if n < 1:
            raise BadInput(f"tensor_parallel_size must be >= 1, got {n}")
        mlp_name, mlp = (("moe_intermediate_size", c.moe_intermediate_size) if c.is_moe
                         else ("intermediate_size", c.intermediate_size))
        checks = [("num_attention_heads", c.num_attention_heads, c.num_attention_heads % n == 0),
                  ("num_key_value_heads", c.num_key_value_heads,
                   c.num_key_value_heads % n == 0 or n % c.num_key_value_heads == 0),
                  (mlp_name, mlp, mlp % n == 0), ("vocab_size", c.vocab_size, c.vocab_size % n == 0)]
        if c.is_moe and any(not c.is_moe_layer(i) for i in range(c.num_hidden_layers)):
            checks.append(("intermediate_size", c.intermediate_size, c.intermediate_size % n == 0))
        for name, value, ok in checks:
            if not ok:
                raise BadInput(f"tensor_parallel_size {n} does not divide the model's {name} ({value})",
                               remedy="choose a tensor-parallel size that divides the model's heads, KV "
                                      "heads (or is a multiple of them), MLP size and vocabulary")

    @property
    def heads(self) -> int:
        """Query heads per rank."""
        return self.config.num_attention_heads // self.size

    @property
    def kv_heads(self) -> int:
        """KV heads per rank (1, replicated, when the model has fewer than ranks)."""
        return max(1, self.config.num_key_value_heads // self.size)

    def first_kv_head(self, rank: int) -> int:
        """The model KV head the rank's first KV head is (its query heads' group)."""
        c = self.config
        if c.num_key_value_heads >= self.size:
            return rank * self.kv_heads
        return rank * self.heads // (c.num_attention_heads // c.num_key_value_heads)

    def vocab_range(self, rank: int) -> tuple[int, int]:
        per = self.config.vocab_size // self.size
        return rank * per, (rank + 1) * per

    def rank_config(self) -> ModelConfig:
        """A rank's shard as a model shape (the same for every rank)."""
        c, n = self.config, self.size
        return dataclasses.replace(
            c, num_attention_heads=self.heads, num_key_value_heads=self.kv_heads, head_dim=c.head_dim,
            intermediate_size=(c.intermediate_size // n if c.intermediate_size % n == 0
                               else c.intermediate_size),
            moe_intermediate_size=c.moe_intermediate_size // n, vocab_size=c.vocab_size // n)


# ---- cutting a rank's parameters from the full model's -----------------------------------------------

Cut = Callable[[torch.Tensor, TPLayout, int], torch.Tensor]


def _rows(t: torch.Tensor, dim: int, start: int, length: int) -> torch.Tensor:
    return t.narrow(dim, start, length)


def _split(dim: int) -> Cut:
    """The rank's 1/N of `dim` (column- or row-parallel weights, the vocabulary)."""
    def cut(t: torch.Tensor, layout: TPLayout, rank: int) -> torch.Tensor:
        per = t.shape[dim] // layout.size
        return _rows(t, dim, rank * per, per)
    return cut


def _qkv(t: torch.Tensor, layout: TPLayout, rank: int) -> torch.Tensor:
    """The rank's query heads, then its KV heads' k rows and v rows (weight or bias, dim 0)."""
    c, d = layout.config, layout.config.head_dim
    q_size, kv_size = c.num_attention_heads * d, c.num_key_value_heads * d
    q = _rows(t, 0, rank * layout.heads * d, layout.heads * d)
    kv_start, kv_len = layout.first_kv_head(rank) * d, layout.kv_heads * d
    k = _rows(t, 0, q_size + kv_start, kv_len)
    v = _rows(t, 0, q_size + kv_size + kv_start, kv_len)
    return torch.cat([q, k, v], dim=0)


def _gate_up(dim: int) -> Cut:
    """The rank's gate rows then its up rows of a fused [.., 2I, ..] weight along `dim`."""
    def cut(t: torch.Tensor, layout: TPLayout, rank: int) -> torch.Tensor:
        half = t.shape[dim] // 2
        per = half // layout.size
        return torch.cat([_rows(t, dim, rank * per, per), _rows(t, dim, half + rank * per, per)], dim=dim)
    return cut


def _first_rank_only(t: torch.Tensor, layout: TPLayout, rank: int) -> torch.Tensor:
    """A row-parallel bias: added once (rank 0), so the sum of the ranks' partials holds it once."""
    return t if rank == 0 else torch.zeros_like(t)


def _whole(t: torch.Tensor, layout: TPLayout, rank: int) -> torch.Tensor:
    return t


# parameter name pattern -> how a rank's piece is cut from the full parameter (first match wins)
SHARDING: tuple[tuple[str, Cut], ...] = (
    (r"embed_tokens\.weight", _split(0)),
    (r"lm_head\.weight", _split(0)),
    (r"layers\.\d+\.self_attn\.qkv_proj\.(weight|bias)", _qkv),
    (r"layers\.\d+\.self_attn\.o_proj\.weight", _split(1)),
    (r"layers\.\d+\.self_attn\.o_proj\.bias", _first_rank_only),
    (r"layers\.\d+\.mlp\.gate_up_proj\.weight", _gate_up(0)),
    (r"layers\.\d+\.mlp\.down_proj\.weight", _split(1)),
    (r"layers\.\d+\.mlp\.experts\.w13", _gate_up(1)),
    (r"layers\.\d+\.mlp\.experts\.w2", _split(2)),
    (r"layers\.\d+\.mlp\.gate\.weight", _whole),           # the MoE router: replicated
    (r"(layers\.\d+\.)?(input_layernorm|post_attention_layernorm|norm|self_attn\.[qk]_norm)\.weight", _whole),
)


def _cut_for(name: str) -> Cut:
    for pattern, cut in SHARDING:
        if re.fullmatch(pattern, name):
            return cut
    raise RuntimeError(f"no tensor-parallel rule for parameter {name} (add one to SHARDING)")


def shard_from_full(full: CausalLM, layout: TPLayout, rank: int, device: torch.device | str | None = None
                    ) -> CausalLM:
    """Rank `rank`'s shard of `full` (on `device`, default the full model's), every parameter cut by
    `SHARDING`; a parameter whose piece has the wrong shape is a `RuntimeError` (a bug in the table)."""
    dtype = full.embed_tokens.weight.dtype
    device = device if device is not None else full.embed_tokens.weight.device
    shard = CausalLM(layout.rank_config(), dtype=dtype, device="meta")
    shard.to_empty(device=device)
    full_params = dict(full.named_parameters())
    with torch.no_grad():
        for name, param in shard.named_parameters():
            piece = _cut_for(name)(full_params[name], layout, rank)
            if tuple(piece.shape) != tuple(param.shape):
                raise RuntimeError(f"rank {rank}: {name} cut to {tuple(piece.shape)}, the shard needs "
                                   f"{tuple(param.shape)}")
            param.copy_(piece)
    shard.build_rope(device)
    return shard.eval()


# ---- the ranks a process holds and how their partials meet -------------------------------------------

class RankGroup(Protocol):
    """The ranks of one TP group held by this process and the collectives between all the group's ranks.

    `local_ranks`: the ranks whose shards this process computes, ascending (all of them when emulating).
    `all_reduce(partials)` takes the local ranks' partials (same shape and dtype, in `local_ranks` order) and
    returns the group's sum, the same tensor on every rank; `all_gather(parts)` returns every rank's part in
    rank order. `algorithm` names the all-reduce (`ORDERED` or `BACKEND`): a fact."""

    @property
    def size(self) -> int: ...

    @property
    def local_ranks(self) -> tuple[int, ...]: ...

    @property
    def algorithm(self) -> str: ...

    def all_reduce(self, partials: list[torch.Tensor]) -> torch.Tensor: ...

    def all_gather(self, parts: list[torch.Tensor]) -> list[torch.Tensor]: ...


@dataclass(frozen=True)
class EmulatedRanks:
    """Every rank in this process: the all-reduce is the ordered sum of the partials computed here."""

    size: int
    algorithm: str = ORDERED

    def __post_init__(self) -> None:
        if self.algorithm != ORDERED:
            raise BadInput(f"rank emulation reproduces the ordered all-reduce only, not {self.algorithm!r}",
                           remedy="re-execute a stock tensor-parallel run at its own tensor-parallel size")

    @property
    def local_ranks(self) -> tuple[int, ...]:
        return tuple(range(self.size))

    def all_reduce(self, partials: list[torch.Tensor]) -> torch.Tensor:
        return ordered_sum(partials)

    def all_gather(self, parts: list[torch.Tensor]) -> list[torch.Tensor]:
        return list(parts)


class TensorParallelLM(nn.Module):
    """The decoder as N rank shards: the interface of `CausalLM` (forward, compute_logits, new_kv_caches,
    gemm_shapes, config), with the shards this process holds and `group` between them. `config` is the full
    model's shape; each shard's is `layout.rank_config()`."""

    def __init__(self, layout: TPLayout, shards: dict[int, CausalLM], group: RankGroup) -> None:
        super().__init__()
        if tuple(sorted(shards)) != group.local_ranks:
            raise RuntimeError(f"shards for ranks {sorted(shards)}, the group holds {group.local_ranks}")
        self.config, self.layout, self.group = layout.config, layout, group
        self.ranks = group.local_ranks
        self.shards = nn.ModuleList(shards[r] for r in self.ranks)
        first = self.shards[0]
        self.embed_tokens = first.embed_tokens   # the dtype and device the runner reads
        self.norm = first.norm                   # replicated
        self.rope = first.rope

    def new_kv_caches(self, num_blocks: int, block_size: int, device: torch.device | str
                      ) -> list[list[KVCache]]:
        """kv_caches[layer][i]: local rank i's (k, v), each [num_blocks, block_size, kv_heads per rank, D]."""
        per_rank = [s.new_kv_caches(num_blocks, block_size, device) for s in self.shards]
        return [list(layer) for layer in zip(*per_rank)]

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        parts = []
        for rank, shard in zip(self.ranks, self.shards):
            lo, hi = self.layout.vocab_range(rank)
            mine = (input_ids >= lo) & (input_ids < hi)
            rows = shard.embed_tokens(torch.where(mine, input_ids - lo, 0))  # [T, H]
            parts.append(torch.where(mine[:, None], rows, torch.zeros_like(rows)))
        return self.group.all_reduce(parts)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                kv_caches: list[list[KVCache]], ks: Kernels) -> torch.Tensor:
        """input_ids, positions: [T] -> final-normed hidden states [T, H] (replicated on every rank)."""
        rope = self.rope
        if rope is None:
            raise RuntimeError("the shards' RoPE tables were not built")
        x, residual = self._embed(input_ids), None  # [T, H]
        for i, layer_caches in enumerate(kv_caches):
            layers = [s.layers[i] for s in self.shards]
            norm = layers[0].input_layernorm
            if residual is None:
                residual, normed = x, norm(x, ks)
            else:
                normed, residual = ks.add_rms_norm(x, residual, norm.weight, norm.eps)
            attn = self.group.all_reduce([layer.self_attn(normed, positions, meta, cache, rope, ks)
                                          for layer, cache in zip(layers, layer_caches, strict=True)])
            post = layers[0].post_attention_layernorm
            normed, residual = ks.add_rms_norm(attn, residual, post.weight, post.eps)
            x = self.group.all_reduce([layer.mlp(normed, ks) for layer in layers])
        if residual is None:
            return self.norm(x, ks)
        return ks.add_rms_norm(x, residual, self.norm.weight, self.norm.eps)[0]

    def compute_logits(self, hidden: torch.Tensor, ks: Kernels) -> torch.Tensor:
        """hidden: [n, H] -> fp32 logits [n, V]: each rank's vocabulary slice, gathered in rank order."""
        parts = [s.compute_logits(hidden, ks) for s in self.shards]
        return torch.cat(self.group.all_gather(parts), dim=-1)

    def gemm_shapes(self) -> list[tuple[int, int]]:
        """(N, K) of every weight a rank multiplies (the per-rank shapes the GEMM probe must prove)."""
        return self.shards[0].gemm_shapes()


def tensor_parallel_model(full: CausalLM, size: int, group: RankGroup | None = None,
                          device: torch.device | str | None = None) -> TensorParallelLM:
    """`full` split over `size` ranks; the shards of `group`'s local ranks (default: every rank, emulated)."""
    layout = TPLayout(full.config, size)
    ranks: RankGroup = group if group is not None else EmulatedRanks(size)
    if ranks.size != size:
        raise RuntimeError(f"a group of {ranks.size} ranks for a split over {size}")
    return TensorParallelLM(layout, {r: shard_from_full(full, layout, r, device) for r in ranks.local_ranks},
                            ranks)
