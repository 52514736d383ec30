"""Tensor-parallel all-reduce dispatch as SelIR: vLLM 0.33 (`all_reduce_vllm`) and SGLang 0.5.23
(`all_reduce_sglang`).

vLLM: `vllm/distributed/device_communicators/cuda_communicator.py` (`CudaCommunicator.all_reduce`, first
match wins), `all_reduce_utils.py` (`should_nccl_symm_mem_allreduce`, the max-size tables),
`custom_all_reduce.py` (`should_custom_ar`) and `csrc/custom_all_reduce.cuh` (1-stage vs 2-stage).
SGLang: `srt/distributed/parallel_state.py` (`GroupCoordinator.all_reduce`) and the JIT CustomAllReduceV2
(`custom_all_reduce_v2.py` `_pick_config`, `configs/custom_all_reduce_v2.py` SM90 tables), both read at
those release tags. CUDA only: ROCm paths
(QuickReduce, AITER) are absent; FlashInfer all-reduce is not transcribed and is required off.

Inputs: `num_tokens` (Runtime) is the token count the dispatch reads; `num_tokens_actual` (Unpinnable) is
the same count as the collective moves it, read only by the requires that bound what a backend can carry, so
pinning the dispatch's view never hides a size limit. Bytes = tokens x hidden x dtype bytes (the all-reduce
after attention's o_proj and the MLP's down_proj).

Knobs: `all_reduce.max_size`, the custom all-reduce buffer (vLLM's `max_size`, SGLang V2's workspace cap);
`all_reduce.chunked` (detent's, vLLM's batch-invariant loop): custom all-reduce takes any size in max_size
chunks; `all_reduce.ordered` (detent's): the engine's all-reduce is replaced by detent's ordered all-reduce
(`ORDERED_PATH`: an all-gather of every rank's partial, then a sum in rank order), whose order is the rank
order at every size: the legal path of both engines wherever NCCL's order is not recorded.

NCCL is legal only with its chain order recorded (`EngineFacts.nccl_chain_order`). NCCL splits a message
across channels by its total count (NVIDIA/nccl @ 5067397c src/include/device.h:337-361, `ncclCollCbdPart`:
a channel's part starts at countLo + mid x countMid, set from the whole count), and each channel runs its own
intra-node chain (src/graph/connect.cc:42-62: channel c takes its order from `graphs[algo]->intra + c x
localRanks`, tree up/down from its position there). An element's summation order is the chain of the channel
its offset falls in, which moves with the message size: it is independent of the batch only if every
channel's chain is the same, which only a recorded chain order shows.
"""

from __future__ import annotations

from detent_audit.manifests.deployment import Deployment
from detent_audit.selection.lang import Runtime, Unpinnable, assume, knob, program, record, require

ORDERED_PATH = "detent/ordered-gather-sum"   # detent's ordered all-reduce: all-gather, then a rank-order sum

KiB = 1024
MiB = 1024 * 1024
# vLLM all_reduce_utils.py: compute capability -> world size -> bytes
CUSTOM_ALL_REDUCE_MAX_SIZES = {
    "9.0": {2: 64 * MiB, 4: 32 * MiB, 6: 512 * KiB, 8: 256 * KiB},
    "10.0": {2: 2 * MiB, 4: 2 * MiB, 6: 1 * MiB, 8: 1 * MiB},
    "10.3": {2: 4 * MiB, 4: 4 * MiB, 6: 8 * MiB, 8: 4 * MiB},
}
SYMM_MEM_ALL_REDUCE_MAX_SIZES = {
    "9.0": {2: 64 * MiB, 4: 32 * MiB, 6: 64 * MiB, 8: 64 * MiB},
    "10.0": {2: 8 * MiB, 4: 32 * MiB, 6: 128 * MiB, 8: 128 * MiB},
    "10.3": {2: 4 * MiB, 4: 32 * MiB, 6: 32 * MiB, 8: 64 * MiB},
}
CUSTOM_AR_SUPPORTED_WORLD_SIZES = (2, 4, 6, 8, 16)   # custom_all_reduce.py _SUPPORTED_WORLD_SIZES
# SGLang configs/custom_all_reduce_v2.py, SM90 (tuned on H200): world size ->
# (1shot_push, 1shot_pull, 2shot_pull, multicast lo, multicast hi); multicast (0, 0) = off
SGLANG_V2_SM90_GRAPH = {
    2: (16 * MiB, 128 * MiB, 128 * MiB, 0, 0), 3: (1280 * KiB, 1280 * KiB, 128 * MiB, 0, 0),
    4: (384 * KiB, 384 * KiB, 128 * MiB, 0, 0), 5: (192 * KiB, 192 * KiB, 32 * MiB, 0, 0),
    6: (128 * KiB, 128 * KiB, 32 * MiB, 8 * MiB, 32 * MiB),
    7: (128 * KiB, 128 * KiB, 32 * MiB, 1 * MiB, 32 * MiB),
    8: (128 * KiB, 128 * KiB, 32 * MiB, 512 * KiB, 128 * MiB),
}
SGLANG_V2_SM90_EAGER = {
    2: (32 * MiB, 128 * MiB, 128 * MiB, 0, 0), 3: (3 * MiB, 3 * MiB, 16 * MiB, 0, 0),
    4: (896 * KiB, 896 * KiB, 32 * MiB, 0, 32 * MiB), 5: (384 * KiB, 384 * KiB, 32 * MiB, 0, 32 * MiB),
    6: (192 * KiB, 192 * KiB, 32 * MiB, 0, 32 * MiB), 7: (128 * KiB, 128 * KiB, 32 * MiB, 0, 32 * MiB),
    8: (128 * KiB, 128 * KiB, 128 * MiB, 0, 128 * MiB),
}


@record
class AllReduceFacts:
    world_size: int
    hidden_size: int
    dtype_bytes: int
    max_num_batched_tokens: int
    fully_connected: bool
    batch_invariant: bool
    flashinfer_all_reduce: bool
    custom_ar: bool              # enabled, world size supported, and 2 GPUs or fully connected
    custom_ar_algo: str          # VLLM_CUSTOM_ALLREDUCE_ALGO: auto | 1stage | 2stage
    custom_ar_table_cap: int     # CUSTOM_ALL_REDUCE_MAX_SIZES[cc][ws] when torch symm-mem is on; else 0
    nccl_symm_mem: bool          # NCCL symmetric-memory all-reduce available
    torch_symm_mem: bool         # torch symmetric-memory all-reduce available
    symm_mem_max_size: int       # SYMM_MEM_ALL_REDUCE_MAX_SIZES[cc][ws]; 0 when absent
    symm_mem_multimem: bool      # multimem_all_reduce_ (else two_shot_all_reduce_)
    multicast: bool              # SGLang V2: multicast 2shot_pull available
    v2_graph: tuple              # SGLang V2 thresholds in CUDA graphs (see SGLANG_V2_SM90_GRAPH)
    v2_eager: tuple              # ... eagerly
    # NCCL's reduction order when pinned (see nccl_path); "" when NCCL picks by size
    nccl_path: str
    nccl_chain_order: str        # NCCL's per-channel chain order as recorded; "": not recorded (NCCL illegal)


@record
class AllReduceChoice:
    # backend/algorithm as ONE value: the pairs upstream produces (custom/1stage, torch_symm_mem/multimem,
    # nccl/tree.Simple.1ch, ...), never a backend with another backend's algorithm
    path: str


def nccl_path(dep: Deployment) -> str:
    """NCCL's reduction order when it does not depend on the message size, else "".

    NCCL's tuner picks algorithm, protocol and channel count from the message size (each a different
    reduction order), so a pinned NCCL path is batch-invariant only with all three fixed: by the deployment's
    NCCL_ALGO / NCCL_PROTO / NCCL_MIN_NCHANNELS = NCCL_MAX_NCHANNELS facts, or by the engine's deterministic
    mode: vLLM's override_envs_for_invariance (tree, Simple, 1 channel;
    model_executor/layers/batch_invariant.py) and SGLang's --enable-deterministic-inference (allreduce:tree,
    SGLANG_DETERMINISTIC_NCCL_NCHANNELS = 8 channels; the protocol is left to NCCL, which moves bytes but does
    not reorder tree sums: the deterministic-mode tree, taken as upstream's determinism claim).
    """
    e = dep.engine
    if e.batch_invariant and e.name == "vllm":
        return "nccl/tree.Simple.1ch"
    if e.batch_invariant and e.name == "sglang":
        return "nccl/tree.8ch"
    if e.nccl_algo and e.nccl_proto and e.nccl_channels > 0:
        return f"nccl/{e.nccl_algo}.{e.nccl_proto}.{e.nccl_channels}ch"
    return ""


def facts(dep: Deployment) -> AllReduceFacts:
    """The all-reduce view of a TP > 1 deployment (plain Python, not SelIR)."""
    e, cc, ws = dep.engine, dep.device.compute_capability, dep.parallel.tensor_parallel_size
    symm_cap = SYMM_MEM_ALL_REDUCE_MAX_SIZES.get(cc, {}).get(ws, 0)
    # custom_all_reduce.py: a supported world size; more than 2 GPUs need NVLink all-to-all (init disables it)
    custom = (e.custom_all_reduce and ws in CUSTOM_AR_SUPPORTED_WORLD_SIZES
              and (ws == 2 or dep.device.fully_connected))
    # batch-invariant mode forces 1stage and turns torch symm-mem off (override_envs_for_invariance)
    torch_symm = e.torch_symm_mem and not e.batch_invariant and symm_cap > 0
    graph = SGLANG_V2_SM90_GRAPH.get(ws, (1 * MiB, 1 * MiB, 16 * MiB, 0, 0))
    eager = SGLANG_V2_SM90_EAGER.get(ws, (1 * MiB, 1 * MiB, 16 * MiB, 0, 0))
    return AllReduceFacts(
        world_size=ws, hidden_size=dep.model.hidden_size, dtype_bytes=dep.model.dtype_bytes,
        max_num_batched_tokens=e.max_num_batched_tokens, fully_connected=dep.device.fully_connected,
        batch_invariant=e.batch_invariant, flashinfer_all_reduce=e.flashinfer_all_reduce, custom_ar=custom,
        custom_ar_algo="1stage" if e.batch_invariant else e.custom_all_reduce_algo,
        custom_ar_table_cap=CUSTOM_ALL_REDUCE_MAX_SIZES.get(cc, {}).get(ws, 0) if e.torch_symm_mem else 0,
        nccl_symm_mem=e.nccl_symm_mem and not e.batch_invariant, torch_symm_mem=torch_symm,
        symm_mem_max_size=symm_cap,
        symm_mem_multimem=(cc == "9.0" and ws in (4, 6, 8)) or (cc.startswith("10.") and ws in (6, 8)),
        multicast=dep.device.fully_connected and ws >= 4, v2_graph=graph, v2_eager=eager,
        nccl_path=nccl_path(dep), nccl_chain_order=e.nccl_chain_order)


@program(family="all_reduce")
def all_reduce_vllm(d: AllReduceFacts, num_tokens: Runtime[int],
                    num_tokens_actual: Unpinnable[int]) -> AllReduceChoice:
    assume(1 <= num_tokens <= d.max_num_batched_tokens, "a step holds at most max_num_batched_tokens tokens")
    assume(1 <= num_tokens_actual <= d.max_num_batched_tokens, "the tokens the collective moves")
    require(not d.flashinfer_all_reduce, "FlashInfer all-reduce is off (its dispatch is not transcribed)")
    nbytes = num_tokens * d.hidden_size * d.dtype_bytes
    actual_bytes = num_tokens_actual * d.hidden_size * d.dtype_bytes
    # 256 KiB .. 64 MiB, default 8 MiB (knob arguments are literals)
    max_size = knob("all_reduce.max_size",
                    (262144, 524288, 1048576, 2097152, 4194304, 8388608, 16777216, 33554432, 67108864),
                    8388608)
    chunked = knob("all_reduce.chunked", (False, True), False)
    ordered = knob("all_reduce.ordered", (False, True), False)
    # custom_all_reduce.py: max_size (8 MiB by default) is capped by the table when torch symm-mem is on
    ca_max = min(max_size, d.custom_ar_table_cap) if d.custom_ar_table_cap > 0 else max_size
    # (1) all_reduce_utils.py should_nccl_symm_mem_allreduce: off below 4 GPUs; at 4 and 8 GPUs outside the
    # band custom all-reduce wins (4: 16 KiB..512 KiB, 8: 16 KiB..128 KiB); above 8 always
    if d.world_size == 4:
        nccl_symm = d.nccl_symm_mem and (nbytes <= 16 * KiB or nbytes >= 512 * KiB)
    elif d.world_size == 8:
        nccl_symm = d.nccl_symm_mem and (nbytes <= 16 * KiB or nbytes >= 128 * KiB)
    else:
        nccl_symm = d.nccl_symm_mem and d.world_size > 8
    # (6) custom_all_reduce.py should_custom_ar: 16-byte multiples, below max_size (strict), any size in
    # batch-invariant mode (chunked at max_size)
    custom = d.custom_ar and nbytes % 16 == 0 and (d.batch_invariant or chunked or nbytes < ca_max)
    # (8) symm_mem.py should_use_symm_mem: 4-byte multiples up to the table's size
    symm = d.torch_symm_mem and nbytes % 4 == 0 and nbytes <= d.symm_mem_max_size
    if ordered:
        path = ORDERED_PATH          # detent's all-reduce replaces CudaCommunicator.all_reduce at every size
    elif nccl_symm:
        path = "nccl_symm_mem/nccl"  # NCCL's own choice inside: legal only where NCCL's path is pinned
    elif custom:
        path = "custom/" + custom_ar_algorithm(d, nbytes)
    elif symm:
        path = "torch_symm_mem/multimem" if d.symm_mem_multimem else "torch_symm_mem/two_shot"
    else:
        # (9) pynccl: NCCL chooses algorithm/protocol/channels by size unless they are pinned (nccl_path)
        path = d.nccl_path if d.nccl_path else "nccl/tuner"
    is_custom = path == "custom/1stage" or path == "custom/2stage"
    require(not is_custom or d.custom_ar and actual_bytes % 16 == 0
            and (actual_bytes < ca_max or chunked or d.batch_invariant),
            "custom all-reduce carries 16-byte multiples below its buffer size unless chunked")
    is_symm = path == "torch_symm_mem/multimem" or path == "torch_symm_mem/two_shot"
    require(not is_symm or d.torch_symm_mem and actual_bytes <= d.symm_mem_max_size,
            "torch symmetric memory carries at most its table's size")
    require(path != "nccl_symm_mem/nccl" or d.nccl_symm_mem and d.nccl_path != "",
            "NCCL symmetric memory is enabled and NCCL's algorithm, protocol and channels are pinned")
    require(path != "nccl/tuner", "NCCL picks its algorithm, protocol and channels by message size: pin "
            "NCCL_ALGO, NCCL_PROTO and the channel count (or run the engine's deterministic mode)")
    require_nccl_order(d, path)
    return AllReduceChoice(path=path)


@program(family="all_reduce")
def all_reduce_sglang(d: AllReduceFacts, num_tokens: Runtime[int], in_cuda_graph: Runtime[int],
                      num_tokens_actual: Unpinnable[int]) -> AllReduceChoice:
    assume(1 <= num_tokens <= d.max_num_batched_tokens, "a step holds at most max_num_batched_tokens tokens")
    assume(0 <= in_cuda_graph <= 1, "1 when the step replays a CUDA graph")
    assume(1 <= num_tokens_actual <= d.max_num_batched_tokens, "the tokens the collective moves")
    require(not d.flashinfer_all_reduce, "FlashInfer all-reduce is off (its dispatch is not transcribed)")
    require(not d.nccl_symm_mem, "pynccl symmetric memory is off (it would precede custom all-reduce)")
    nbytes = num_tokens * d.hidden_size * d.dtype_bytes
    actual_bytes = num_tokens_actual * d.hidden_size * d.dtype_bytes
    # the V2 workspace cap (SGLANG_CUSTOM_ALL_REDUCE_V2_MAX_SIZE_KB, 16 MiB); clipping the thresholds by it
    # follows a later SGLang's Heuristic.clip (inferred for 0.5.23)
    cap = knob("all_reduce.max_size",
               # 256 KiB .. 64 MiB, default 16 MiB
               (262144, 524288, 1048576, 2097152, 4194304, 8388608, 16777216, 33554432, 67108864), 16777216)
    # custom_all_reduce_v2.py _pick_config: separate thresholds inside CUDA graphs and eagerly
    one_push = min(cap, d.v2_graph[0]) if in_cuda_graph == 1 else min(cap, d.v2_eager[0])
    one_pull = min(cap, d.v2_graph[1]) if in_cuda_graph == 1 else min(cap, d.v2_eager[1])
    two_pull = min(cap, d.v2_graph[2]) if in_cuda_graph == 1 else min(cap, d.v2_eager[2])
    mc_lo = min(cap, d.v2_graph[3]) if in_cuda_graph == 1 else min(cap, d.v2_eager[3])
    mc_hi = min(cap, d.v2_graph[4]) if in_cuda_graph == 1 else min(cap, d.v2_eager[4])
    usable = d.custom_ar and not d.batch_invariant and nbytes % 16 == 0
    ordered = knob("all_reduce.ordered", (False, True), False)
    # the backend and its algorithm are ONE decision (a path), as upstream takes them together
    if ordered:
        path = ORDERED_PATH          # detent's all-reduce replaces GroupCoordinator.all_reduce at every size
    elif usable and nbytes <= one_push:
        path = "custom/1shot_push"
    elif usable and nbytes <= one_pull:
        path = "custom/1shot_pull"
    elif usable and d.multicast and mc_hi > 0 and mc_lo <= nbytes <= mc_hi:
        path = "custom/2shot_pull_mc"
    elif usable and nbytes <= two_pull:
        path = "custom/2shot_pull"
    else:
        # deterministic mode: custom all-reduce off, NCCL_ALGO tree and 8 channels pinned (SGLang's
        # srt/arg_groups/attention_hook.py, handle_deterministic_inference); else NCCL's own tuner
        path = d.nccl_path if d.nccl_path else "nccl/tuner"
    is_custom = (path == "custom/1shot_push" or path == "custom/1shot_pull" or path == "custom/2shot_pull_mc"
                 or path == "custom/2shot_pull")
    require(not is_custom or d.custom_ar and actual_bytes % 16 == 0 and actual_bytes <= cap,
            "custom all-reduce carries 16-byte multiples up to its workspace")
    require(path != "nccl/tuner", "NCCL picks its algorithm, protocol and channels by message size: pin "
            "NCCL_ALGO, NCCL_PROTO and the channel count (or run the engine's deterministic mode)")
    require_nccl_order(d, path)
    return AllReduceChoice(path=path)


def require_nccl_order(d, path):
    # NCCL (pinned or not) sums an element along the chain of the channel its offset falls in, a channel
    # the message size picks: legal only where the deployment records every channel's chain order
    require(path != d.nccl_path and path != "nccl_symm_mem/nccl" or d.nccl_chain_order != "",
            "NCCL sums each element along its channel's chain, and the channel moves with the message size: "
            "record the per-channel chain order (nccl_chain_order) or use the ordered all-reduce")
    return 0


def custom_ar_algorithm(d, nbytes):
    # csrc/custom_all_reduce.cuh CustomAllreduce::allreduce: VLLM_CUSTOM_ALLREDUCE_ALGO forces a kernel;
    # else 1-stage for 2 GPUs, and with NVLink all-to-all for < 512 KiB up to 4 GPUs or < 256 KiB up to 8
    if d.custom_ar_algo == "1stage":
        algorithm = "1stage"
    elif d.custom_ar_algo == "2stage":
        algorithm = "2stage"
    elif d.world_size == 2:
        algorithm = "1stage"
    elif d.fully_connected and (d.world_size <= 4 and nbytes < 512 * KiB or d.world_size <= 8
                                and nbytes < 256 * KiB):
        algorithm = "1stage"
    else:
        algorithm = "2stage"
    return algorithm
