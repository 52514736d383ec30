"""Fused-MoE (Triton) config selection as SelIR: `try_get_optimal_moe_config` of vLLM 0.33 and SGLang 0.5.23.

vLLM: `vllm/model_executor/layers/fused_moe/fused_moe.py` (`try_get_optimal_moe_config`, `get_moe_configs`,
`get_default_config`); SGLang: `srt/layers/moe/moe_runner/triton_utils/fused_moe_triton_config.py` (the same
rule) and `_use_moe_sum_reduce_torch_compile` on the combine, both at those release tags. Both pick the tuned
row whose key (a token count) is nearest the batch's token count M, else a default config that switches at M
<= E; in batch-invariant mode both ignore the table and use one fixed config. Unquantized bf16 experts only
(no fp8/int4 rows). Not modelled: SGLang's separate down-projection table (its BLOCK_SIZE_M is forced to the
up-projection's anyway) and vLLM's chunking of M above VLLM_FUSED_MOE_CHUNK_SIZE (the shipped token budgets
stay below it).

Runtime input: `num_tokens` = M = hidden_states.shape[0], the tokens of the step.
"""

from __future__ import annotations

from detent_audit.manifests.deployment import Deployment
from detent_audit.selection.lang import Runtime, assume, nearest, program, record

# Triton's launch defaults, used when a config leaves num_warps / num_stages unset (the default configs do)
TRITON_DEFAULT_WARPS = 4
TRITON_DEFAULT_STAGES = 3
SGLANG_SUM_SWITCH_TOKENS = 32   # _use_moe_sum_reduce_torch_compile: num_tokens <= 32


@record
class MoeFacts:
    max_num_batched_tokens: int
    num_experts: int                 # E
    top_k: int
    has_table: bool                  # a tuned table exists and the engine reads it
    table_keys: tuple                # token counts, ascending (file order)
    block_size_m: dict               # key -> value, one table per config field
    block_size_n: dict
    block_size_k: dict
    group_size_m: dict
    num_warps: dict
    num_stages: dict
    batch_invariant: bool
    sum_switch_tokens: int           # SGLang: 32 (torch.compile sum at or below); 0: no switch (vLLM)
    sum_impl: str                    # the combine kernel otherwise: "moe_sum" (vLLM), "moe_sum_reduce" (SGLang)


@record
class MoeChoice:
    block_size_m: int
    block_size_n: int
    block_size_k: int                # the K chunking of the expert GEMMs' reductions
    group_size_m: int
    num_warps: int
    num_stages: int
    combine: str                     # how the top-k expert outputs are summed


def facts(dep: Deployment) -> MoeFacts:
    """The fused-MoE view of an MoE deployment (plain Python, not SelIR)."""
    e = dep.engine
    # get_moe_configs returns None in batch-invariant mode: the table is ignored
    rows = () if e.batch_invariant else dep.tables.fused_moe

    def column(name: str) -> dict:
        return {key: getattr(row, name) for key, row in rows}

    return MoeFacts(
        max_num_batched_tokens=e.max_num_batched_tokens, num_experts=dep.model.num_experts,
        top_k=dep.model.num_experts_per_tok, has_table=len(rows) > 0,
        table_keys=tuple(key for key, _ in rows),
        block_size_m=column("block_size_m"), block_size_n=column("block_size_n"),
        block_size_k=column("block_size_k"), group_size_m=column("group_size_m"),
        num_warps=column("num_warps"), num_stages=column("num_stages"), batch_invariant=e.batch_invariant,
        sum_switch_tokens=SGLANG_SUM_SWITCH_TOKENS if e.name == "sglang" else 0,
        sum_impl="moe_sum_reduce" if e.name == "sglang" else "moe_sum")


@program(family="moe")
def fused_moe(d: MoeFacts, num_tokens: Runtime[int]) -> MoeChoice:
    assume(1 <= num_tokens <= d.max_num_batched_tokens, "a step holds at most max_num_batched_tokens tokens")
    m = num_tokens
    if d.has_table:
        # try_get_optimal_moe_config: the row of the key nearest M (|key - M| smallest; a tie goes to the
        # first key in file order, the smaller)
        key = nearest(d.table_keys, m)
        block_m = d.block_size_m[key]
        block_n = d.block_size_n[key]
        block_k = d.block_size_k[key]
        group_m = d.group_size_m[key]
        warps = d.num_warps[key]
        stages = d.num_stages[key]
    elif d.batch_invariant:
        # get_default_config under batch invariance: one config for every M
        block_m, block_n, block_k, group_m = 64, 64, 32, 8
        warps, stages = TRITON_DEFAULT_WARPS, TRITON_DEFAULT_STAGES
    else:
        # get_default_config, unquantized: {64, 64, 32, G8}, or {16, 32, 64, G1} when M <= E
        small = m <= d.num_experts
        block_m = 16 if small else 64
        block_n = 32 if small else 64
        block_k = 64 if small else 32
        group_m = 1 if small else 8
        warps, stages = TRITON_DEFAULT_WARPS, TRITON_DEFAULT_STAGES
    # the top-k combine: SGLang adds two slices for top-2, uses a torch.compile sum at <= 32 tokens outside
    # batch-invariant mode, and moe_sum_reduce otherwise; vLLM has one combine kernel for every M
    if d.sum_switch_tokens > 0 and d.top_k == 2:
        combine = "add"
    elif m <= d.sum_switch_tokens and not d.batch_invariant:
        combine = "torch_compile_sum"
    else:
        combine = d.sum_impl
    return MoeChoice(block_size_m=block_m, block_size_n=block_n, block_size_k=block_k, group_size_m=group_m,
                     num_warps=warps, num_stages=stages, combine=combine)
