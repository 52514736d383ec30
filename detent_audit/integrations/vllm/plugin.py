"""The vLLM plugin (entry point `vllm.general_plugins: detent`): batch-invariant kernels inside vLLM's CPU
build.

vLLM calls `register()` once in every process it starts (the front end, the engine core, each worker) before
the model is built. It installs, without a monkeypatch of any kernel:
- the CPU attention backend (`AttentionBackendEnum.CPU_ATTN`, through vLLM's own `register_backend`) replaced
  by `attention.DetentCPUAttentionBackend`, whose impl runs the project's paged attention (KV tiles and splits
  on absolute positions: prefill, chunked prefill, decode and prefix hits reduce in the same order);
  that attention is the C form (`kernels/attention_c.py`, `ENV_ATTENTION=c`, the default) or the torch form;
- the unquantized CPU GEMM dispatch (`vllm.model_executor.layers.utils.dispatch_cpu_unquantized_gemm`, which
  sets `layer.cpu_linear` at load time) wrapped, per `ENV_GEMM`: `chunked` (the default) runs every linear
  layer and the LM head through the tuple's GEMM (`kernels.gemm`, in the form and rows of the compiled
  `embedded.gemm` selector: the chunk form, invariant by construction, or a pad or row form that `VllmEngine`
  proved on vLLM's fused shapes, this CPU and thread count before it built vLLM); `onednn` keeps vLLM's fp32
  oneDNN GEMM (`torch.ops._C.onednn_mm`), measured row-invariant on an AVX2 CPU only and proven nowhere (on
  an AVX-512 CPU a lone row of the down projection differs from the same row in a batch).
- under the portable ISA setting (`--isa portable`, detent, float32): vLLM's `SiluAndMul` replaced out of tree
  (`CustomOp.register_oot`) by the project's C SiLU (the form the other engines run; vLLM's own on x86 is
  torch's `F.silu`); `VllmEngine` runs RoPE in torch's ops (`custom_ops: -rotary_embedding`) instead of
  vLLM's C++ kernel, which vLLM builds once per ISA (`_C`, `_C_AVX512`, `_C_AVX2`) and loads by the CPU, and
  replaces the RoPE tables by the C cos and sin (`fixed_order_rope`); RMSNorm is vLLM's torch IR op on a CPU
  (made explicit). With the GEMM's `fixed` form and the C attention, no product, exp or table of the forward
  then depends on the CPU (docs/isa.md);
- at tensor-parallel size N > 1, vLLM's CPU all-reduce (`CpuCommunicator.all_reduce`, wrapped) replaced by
  the ordered form: the ranks' partials all-gathered through vLLM's own transport (copies only), then added in
  rank order 0..N-1 in float32 (`kernels.all_reduce.ordered_sum`), so every rank holds the same bits and one
  process holding the N partials adds them alike. vLLM's own all-reduce is gloo's `all_reduce` where its C
  extension has no shared-memory ops (its AVX2 build, this project's CI CPU), else
  `torch.ops._C.shm_allreduce` (csrc/cpu/shm.cpp), in which rank r adds its own partial first, then ranks
  r+1, r+2, ... (mod N) in float32: at N >= 3 the ranks add in different orders, so their "replicated"
  hidden states may differ in their last bits; gloo's ring sums each chunk of the message from another rank,
  chunks sized by the step's tokens.
Seeded sampling is the `sampler.DetentSampler` logits processor, which `VllmEngine` passes to vLLM; a
teacher-forced rescore's output positions (logprob, top-n and the draw) are scored by
`sampler.score_rescore_rows`, which the plugin runs at every step just before vLLM's prompt-logprobs point (a
wrapper of the model runner's `_get_prompt_logprobs_dict`; it adds a computation beside vLLM's, on rows of
the step's hidden states, and changes nothing of vLLM's). At TP > 1 the scores are made in every rank's
worker process and `VllmEngine` takes rank 0's through vLLM's `collective_rpc`.

What the kernels are is decided per engine, not per process: the engine that vLLM builds reads `ENV_MODE`,
`ENV_DEPLOYMENT` and `ENV_TUPLE` (set by `VllmEngine` before it builds vLLM) when its layers are made. With
`ENV_MODE` unset or `stock`, every hook falls through to vLLM's own kernel, so installing the plugin changes
nothing for anyone who did not ask for it.

CPU only. The CUDA selection points (FlashAttention splits, fused-MoE config, all-reduce, cascade) are pinned
by `cuda.py`, checked on CPU by calling vLLM's functions; no CUDA run is claimed.
"""

from __future__ import annotations

import functools
import json
import os
from typing import Any

import torch

from detent_audit.enums import Mode
from detent_audit.kernels.all_reduce import ORDERED, ordered_sum

ENV_MODE = "DETENT_VLLM_MODE"              # detent | stock (unset: stock)
ENV_DEPLOYMENT = "DETENT_VLLM_DEPLOYMENT"  # the canonical deployment the selectors are solved for (JSON)
ENV_TUPLE = "DETENT_VLLM_TUPLE"            # the committed tuple: family -> axis -> value (JSON)
ENV_CACHE_DIR = "DETENT_VLLM_CACHE_DIR"    # the JIT cache of the compiled selectors
ENV_GEMM = "DETENT_VLLM_GEMM"              # chunked (default) | onednn
GEMMS = ("chunked", "onednn")
ENV_ATTENTION = "DETENT_VLLM_ATTENTION"    # c (default) | torch
ATTENTIONS = ("c", "torch")

_installed = False


def active() -> bool:
    """True when the engine being built asked for the detent kernels."""
    return os.environ.get(ENV_MODE) == Mode.DETENT


@functools.lru_cache(maxsize=8)
def _kernel_set_for(deployment_json: str, tuple_json: str, cache_dir: str | None) -> Any:
    from detent_audit.manifests.deployment import Deployment
    from detent_audit.runtime.kernel_select import select_kernels

    deployment = Deployment.from_canonical(json.loads(deployment_json), source=ENV_DEPLOYMENT)
    return select_kernels(Mode.DETENT, deployment, json.loads(tuple_json), cache_dir).kernels


def kernel_set() -> Any:
    """The KernelSet of the engine being built (compiled selectors with the committed tuple as constants)."""
    deployment, committed = os.environ.get(ENV_DEPLOYMENT), os.environ.get(ENV_TUPLE)
    if not deployment or committed is None:
        raise RuntimeError(f"{ENV_MODE}=detent without {ENV_DEPLOYMENT} and {ENV_TUPLE}: start vLLM through "
                           "detent_audit.integrations.vllm.engine.VllmEngine")
    return _kernel_set_for(deployment, committed, os.environ.get(ENV_CACHE_DIR) or None)


def gemm_choice() -> str:
    choice = os.environ.get(ENV_GEMM) or "chunked"
    if choice not in GEMMS:
        raise RuntimeError(f"{ENV_GEMM}={choice!r}: use one of {', '.join(GEMMS)}")
    return choice


def attention_choice() -> str:
    """Which form of the batch-invariant attention the engine runs: `c` (kernels/attention_c.py, compiled
    here, fixed order by construction) or `torch` (kernels/attention.py). VllmEngine resolves it and the facts
    record it: the two forms reduce in different orders, so their bits differ."""
    choice = os.environ.get(ENV_ATTENTION) or "c"
    if choice not in ATTENTIONS:
        raise RuntimeError(f"{ENV_ATTENTION}={choice!r}: use one of {', '.join(ATTENTIONS)}")
    return choice


def _detent_gemm_dispatch(original: Any) -> Any:
    @functools.wraps(original)
    def dispatch(layer: Any, remove_weight: bool) -> None:
        weight = getattr(layer, "weight", None)
        if not active() or weight is None or weight.is_meta or weight.ndim != 2:
            return original(layer, remove_weight)
        if gemm_choice() == "onednn":
            if weight.dtype != torch.float32:
                raise RuntimeError("the detent plugin's oneDNN GEMM is measured invariant in float32 only")
            from vllm import _custom_ops as ops

            handler = ops.create_onednn_mm(weight.t(), 32)  # what vLLM's dispatch builds for fp32 on x86
            layer.cpu_linear = lambda x, weight, bias: ops.onednn_mm(handler, x, bias)
            layer.detent_gemm = "onednn"
            return None
        kernels = kernel_set()
        # the weight stays on the layer (vLLM passes it back in); row i of the output depends on row i only
        layer.cpu_linear = lambda x, weight, bias: kernels.linear(x, weight, bias)
        layer.detent_gemm = "chunked"
    dispatch.detent_original = original  # type: ignore[attr-defined]
    return dispatch


def _with_rescore_scores(original: Any) -> Any:
    from detent_audit.integrations.vllm import sampler

    @functools.wraps(original)
    def prompt_logprobs(runner: Any, hidden_states: torch.Tensor,
                        num_scheduled_tokens: dict[str, int]) -> Any:
        # per request, not per process: only a request that VllmEngine's detent rescore marked is scored
        sampler.score_rescore_rows(runner, hidden_states, num_scheduled_tokens)
        return original(runner, hidden_states, num_scheduled_tokens)
    prompt_logprobs.detent_original = original  # type: ignore[attr-defined]
    return prompt_logprobs


def _ordered_all_reduce(original: Any) -> Any:
    @functools.wraps(original)
    def all_reduce(communicator: Any, input_: torch.Tensor) -> torch.Tensor:
        if not active():
            return original(communicator, input_)
        # every rank's partial, in rank order, through vLLM's transport (gloo or shm: copies, no arithmetic)
        mine = input_.contiguous().view(-1)
        gathered = torch.empty((communicator.world_size * mine.numel(),), dtype=mine.dtype)
        communicator.dist_module.all_gather_into_tensor(gathered, mine, group=communicator.device_group)
        summed = ordered_sum(gathered.view(communicator.world_size, -1).unbind(0))
        input_.copy_(summed.view(input_.shape))  # in place, as vLLM's own all-reduce leaves it
        return input_
    all_reduce.detent_original = original  # type: ignore[attr-defined]
    return all_reduce


def _fixed_order_silu() -> type:
    """vLLM's `SiluAndMul`, registered out of tree (`CustomOp.register_oot`, vLLM's own way to replace a
    layer): an engine that runs the portable setting's fixed-order kernels (`KernelSet.fixed_order`) takes
    the project's C SiLU (kernels/rowlocal_c.py), whose bits do not depend on the CPU; any other engine keeps
    vLLM's. Decided when the layer is made, as the GEMM is."""
    from vllm.model_executor.layers.activation import SiluAndMul
    from vllm.platforms import current_platform

    class FixedOrderSiluAndMul(SiluAndMul):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            kernels = kernel_set() if active() and current_platform.is_cpu() else None
            self.detent_kernels = kernels if kernels is not None and kernels.fixed_order else None

        def forward_native(self, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
            if self.detent_kernels is not None:
                return self.detent_kernels.silu_and_mul(x)
            return SiluAndMul.forward_native(x)

        def forward_cpu(self, x: torch.Tensor) -> torch.Tensor:
            if self.detent_kernels is not None:
                return self.detent_kernels.silu_and_mul(x)
            return super().forward_cpu(x)

    FixedOrderSiluAndMul.__name__ = FixedOrderSiluAndMul.__qualname__ = "FixedOrderSiluAndMul"
    return FixedOrderSiluAndMul


def fixed_order_rope(worker: Any) -> int:
    """Under the portable setting, after vLLM built the model (through its `collective_rpc`, in every worker):
    each RoPE table recomputed with the C cos and sin (`kernels.rowlocal.rewrite_rope_tables`; torch's are
    MKL's, whose float32 results move with the CPU past angles of about 1e4). The number of tables; a RoPE
    whose class builds its table its own way (scaled variants) is refused."""
    from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbeddingBase

    from detent_audit.kernels.rowlocal import rewrite_rope_tables

    return rewrite_rope_tables(worker.model_runner.model, RotaryEmbeddingBase, "vLLM")


def all_reduce_in_use(worker: Any = None) -> str:
    """What adds this process's tensor-parallel partials: the ordered form (detent), else vLLM's own, named by
    its transport (`gloo` or `vllm-shm`). Callable through vLLM's `collective_rpc` (`worker` unused)."""
    if active():
        return ORDERED
    from vllm.distributed.device_communicators.cpu_communicator import _CPUSHMDistributed
    from vllm.distributed.parallel_state import get_tp_group

    shm = isinstance(getattr(get_tp_group().device_communicator, "dist_module", None), _CPUSHMDistributed)
    return "vllm-shm" if shm else "gloo"


def register() -> None:
    """The `vllm.general_plugins` entry point; re-entrant (vLLM may call it more than once per process)."""
    global _installed
    if _installed:
        return
    from vllm.model_executor.layers import utils as layer_utils
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    register_backend(AttentionBackendEnum.CPU_ATTN,
                     "detent_audit.integrations.vllm.attention.DetentCPUAttentionBackend")
    if not hasattr(layer_utils.dispatch_cpu_unquantized_gemm, "detent_original"):
        dispatch = layer_utils.dispatch_cpu_unquantized_gemm
        layer_utils.dispatch_cpu_unquantized_gemm = _detent_gemm_dispatch(dispatch)
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    if not hasattr(GPUModelRunner._get_prompt_logprobs_dict, "detent_original"):
        original = GPUModelRunner._get_prompt_logprobs_dict
        GPUModelRunner._get_prompt_logprobs_dict = _with_rescore_scores(original)
    from vllm.model_executor.custom_op import CustomOp, op_registry_oot

    if "SiluAndMul" not in op_registry_oot:
        silu = CustomOp.register_oot(name="SiluAndMul")(_fixed_order_silu())
        silu.name = "silu_and_mul"  # vLLM's name for the op, so `custom_ops` settings still reach it
    from vllm.distributed.device_communicators.cpu_communicator import CpuCommunicator

    if not hasattr(CpuCommunicator.all_reduce, "detent_original"):
        CpuCommunicator.all_reduce = _ordered_all_reduce(CpuCommunicator.all_reduce)
    from vllm.platforms import current_platform

    if active() and current_platform.is_cuda():  # written for vLLM 0.33 on CUDA; not run here (cuda.py)
        from detent_audit.integrations.vllm import cuda

        cuda.pin_flash_attention(1)
        os.environ.update(cuda.ENV)
    _installed = True
