"""Fused-MoE (Triton) config selection as SelIR: `try_get_optimal_moe_config` of vLLM 0.33 and SGLang 0.5.23.

vLLM: `vllm/model_executor/layers/fused_moe/fused_moe.py` (`try_get_optimal_moe_config`, `get_moe_configs`,
`get_default_config`); SGLang: `srt/layers/moe/moe_runner/triton_utils/fused_moe_triton_config.py` (the same
rule) and `_use_moe_sum_reduce_torch_compile` on the combine, both at those release tags. Both pick the tuned
row whose key (a token count) is nearest the batch's token count M, else a default config that switches at M
<= E; in batch-invariant mode both ignore the table and use one fixed config. Unquantized bf16 experts only
(no fp8/int4 rows).

SGLang tunes the down projection apart: `try_get_optimal_moe_config(..., return_down_config=True)` reads a
second file (`..._down.json`, the deployment's `tables.fused_moe_down`) by the same nearest-key rule and
keeps the up projection's BLOCK_SIZE_M for it; without that file both GEMMs use one config (vLLM always).
vLLM's fused_experts skips moe_align_block_size when `tokens_in_chunk * top_k * SPARSITY_FACTOR (4) <=
global_num_experts` (`naive_block_assignment`, no expert map, unquantized): one (token, expert) pair per
M-block instead of expert-sorted blocks. Not modelled: vLLM's chunking of M above
VLLM_FUSED_MOE_CHUNK_SIZE (the shipped token budgets stay below it).

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
    sum_impl: str                    # the combine otherwise: "moe_sum" (vLLM), "moe_sum_reduce" (SGLang)
    has_down_table: bool             # SGLang: a down-projection table exists (and the engine reads it)
    down_keys: tuple
    down_block_size_n: dict
    down_block_size_k: dict
    down_group_size_m: dict
    down_num_warps: dict
    down_num_stages: dict
    naive_assignment: bool           # vLLM: the naive block-assignment switch exists (SPARSITY_FACTOR rule)


@record
class MoeChoice:
    block_size_m: int
    block_size_n: int
    block_size_k: int                # the K chunking of the expert GEMMs' reductions
    group_size_m: int
    num_warps: int
    num_stages: int
    combine: str                     # how the top-k expert outputs are summed
    down_block_size_n: int           # the down projection's config (BLOCK_SIZE_M is the up projection's)
    down_block_size_k: int
    down_group_size_m: int
    down_num_warps: int
    down_num_stages: int
    block_assignment: str            # "aligned" (moe_align_block_size) | "naive" (one pair per M-block)


def facts(dep: Deployment) -> MoeFacts:
    """The fused-MoE view of an MoE deployment (plain Python, not SelIR)."""
    e = dep.engine
    # get_moe_configs returns None in batch-invariant mode: the table is ignored
    rows = () if e.batch_invariant else dep.tables.fused_moe

    down = () if e.batch_invariant or e.name != "sglang" else dep.tables.fused_moe_down

    def column(name: str, table: tuple = rows) -> dict:
        return {key: getattr(row, name) for key, row in table}

    return MoeFacts(
        max_num_batched_tokens=e.max_num_batched_tokens, num_experts=dep.model.num_experts,
        top_k=dep.model.num_experts_per_tok, has_table=len(rows) > 0,
        table_keys=tuple(key for key, _ in rows),
        block_size_m=column("block_size_m"), block_size_n=column("block_size_n"),
        block_size_k=column("block_size_k"), group_size_m=column("group_size_m"),
        num_warps=column("num_warps"), num_stages=column("num_stages"), batch_invariant=e.batch_invariant,
        sum_switch_tokens=SGLANG_SUM_SWITCH_TOKENS if e.name == "sglang" else 0,
        sum_impl="moe_sum_reduce" if e.name == "sglang" else "moe_sum", has_down_table=len(down) > 0,
        down_keys=tuple(key for key, _ in down), down_block_size_n=column("block_size_n", down),
        down_block_size_k=column("block_size_k", down), down_group_size_m=column("group_size_m", down),
        down_num_warps=column("num_warps", down), down_num_stages=column("num_stages", down),
        naive_assignment=e.name == "vllm")


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
    # SGLang fused_moe_triton_config.py try_get_optimal_moe_config(return_down_config=True): the down file's
    # row nearest M, its BLOCK_SIZE_M replaced by the up projection's; no down file: the up config
    if d.has_down_table:
        down_key = nearest(d.down_keys, m)
        down_n, down_k = d.down_block_size_n[down_key], d.down_block_size_k[down_key]
        down_group, down_warps = d.down_group_size_m[down_key], d.down_num_warps[down_key]
        down_stages = d.down_num_stages[down_key]
    else:
        down_n, down_k, down_group, down_warps, down_stages = block_n, block_k, group_m, warps, stages
    # vLLM fused_moe.py fused_experts: naive_block_assignment = tokens * top_k * SPARSITY_FACTOR (4) <= E
    naive = d.naive_assignment and m * d.top_k * 4 <= d.num_experts
    assignment = "naive" if naive else "aligned"
    return MoeChoice(block_size_m=block_m, block_size_n=block_n, block_size_k=block_k, group_size_m=group_m,
                     num_warps=warps, num_stages=stages, combine=combine, down_block_size_n=down_n,
                     down_block_size_k=down_k, down_group_size_m=down_group, down_num_warps=down_warps,
                     down_num_stages=down_stages, block_assignment=assignment)
