"""SGLang's CUDA selection points routed through the compiled SelIR selectors with the committed tuple.

Written against sglang 0.5.21's source and checked on a CPU by calling SGLang's own functions with stubs
(tests/integrations/test_sglang_selection.py); the kernels behind them need a GPU and were not run here.

- FA3 (`srt/layers/attention/flashattention_backend.py`): `FlashAttentionBackend.__init__` sets
  `num_splits` (0: FA3's own heuristic, which reads the batch) and `decode_num_splits`, passed to every FA3
  call and to `get_scheduler_metadata`. The hook sets both to the selector's `num_splits`, which the pinned
  tuple makes one constant over the deployment's runtime domain (checked on a seeded sample of it; a tuple
  whose split count still follows the batch is refused: SGLang passes one value to every call).
- fused MoE (`srt/layers/moe/moe_runner/triton_utils/fused_moe_triton_config.py`):
  `try_get_optimal_moe_config` returns the selector's config for M (the pinned row), and the down
  projection's config with it.
- all-reduce (`srt/distributed/parallel_state.py`, `custom_all_reduce_v2.py`):
  `GroupCoordinator._resolve_outplace_all_reduce_method` returns "ca" when the pinned path is custom
  all-reduce and None (NCCL, in place) otherwise; `CustomAllReduceV2._pick_config` returns the pinned
  algorithm for every size; a pinned NCCL path exports its NCCL_ALGO / NCCL_PROTO / channel count.
"""

from __future__ import annotations

import os
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from detent_audit.errors import BadInput
from detent_audit.manifests.deployment import Deployment, load_deployment
from detent_audit.selection.compiler import solve
from detent_audit.selection.programs import families_for
from detent_audit.selection.programs.all_reduce import ORDERED_PATH

TARGETS = {
    "fa3": "sglang.srt.layers.attention.flashattention_backend.FlashAttentionBackend.__init__",
    "moe": "sglang.srt.layers.moe.moe_runner.triton_utils.fused_moe_triton_config.try_get_optimal_moe_config",
    "resolve": "sglang.srt.distributed.parallel_state.GroupCoordinator._resolve_outplace_all_reduce_method",
    "pick": "sglang.srt.distributed.device_communicators.custom_all_reduce_v2.CustomAllReduceV2._pick_config",
}
_V2_ALGOS = {"custom/1shot_push": ("ONE_SHOT_PUSH", False), "custom/1shot_pull": ("ONE_SHOT_PULL", False),
             "custom/2shot_pull": ("TWO_SHOT_PULL", False), "custom/2shot_pull_mc": ("TWO_SHOT_PULL", True)}
_NCCL_ENV = {"tree": "Tree", "ring": "Ring", "Simple": "Simple", "LL": "LL", "LL128": "LL128"}
SAMPLE = 256  # runtime points drawn to check that a pinned value is one constant
# SGLang's fused-MoE configs, the up projection's and the down projection's: Triton's launch fields by name
MoeConfigs = tuple[dict[str, int], dict[str, int]]
Hook = tuple[str, Any]  # how it is applied ("AFTER" the target, or "REPLACE" it) and the function


def _sample_inputs(d: Deployment, rng: random.Random) -> dict[str, int]:
    """One random step within the deployment's limits (what the selectors' runtime inputs can be)."""
    e = d.engine
    num_seqs = rng.randint(1, e.max_num_seqs)
    q = rng.randint(1, max(1, min(e.max_num_batched_tokens // num_seqs, e.max_model_len)))
    k = rng.randint(q, e.max_model_len)
    tokens = min(e.max_num_batched_tokens, num_seqs * q)
    return {"num_tokens": tokens, "num_seqs": num_seqs, "max_seqlen_q": q, "max_seqlen_k": k,
            "total_blocks": rng.randint(1, 1 << 16), "seqlen_k": rng.randint(1, k)}


@dataclass
class CudaHooks:
    """The compiled selectors of one deployment and tuple, and the hooks built on them."""

    deployment: Deployment
    selectors: dict[str, Any]          # family -> CompiledSelector
    tuple: dict[str, dict[str, Any]]

    @classmethod
    def from_config(cls, config: Any) -> CudaHooks:
        return cls.build(load_deployment(Path(config.deployment)), config.cuda_tuple)

    @classmethod
    def build(cls, deployment: Deployment, committed: dict | None = None) -> CudaHooks:
        if deployment.engine.name != "sglang":
            raise BadInput(f"{deployment.name} is a {deployment.engine.name} deployment, not SGLang's")
        committed = dict(committed or {})
        selectors, chosen = {}, {}
        for spec in families_for(deployment):
            if spec.name not in ("attention", "moe", "all_reduce"):
                continue
            result = solve(spec.program, spec.facts(deployment), family=spec.name)
            assignment = dict(committed.get(spec.name) or result.default or {})
            selectors[spec.name] = result.selector(assignment)  # raises on an illegal assignment
            chosen[spec.name] = assignment
        return cls(deployment, selectors, chosen)

    # ---- pinned values
    def fa3_num_splits(self) -> int:
        """The one num_splits SGLang passes to FA3 under the tuple; refused if it varies over the domain."""
        sel = self.selectors["attention"]
        rng = random.Random(0)
        values = {sel(**_sample_inputs(self.deployment, rng)).num_splits for _ in range(SAMPLE)}
        if len(values) != 1:
            raise BadInput(f"the tuple's attention assignment {self.tuple['attention']} leaves FA3's "
                           f"num_splits following the batch ({sorted(values)[:8]}...): SGLang passes one "
                           "value to every call",
                           remedy="commit a tuple with split_stride 0 and a pinned num_splits")
        return int(values.pop())

    def moe_config(self, m: int) -> MoeConfigs:
        c = self.selectors["moe"](num_tokens=max(1, min(m, self.deployment.engine.max_num_batched_tokens)))
        up = {"BLOCK_SIZE_M": c.block_size_m, "BLOCK_SIZE_N": c.block_size_n, "BLOCK_SIZE_K": c.block_size_k,
              "GROUP_SIZE_M": c.group_size_m, "num_warps": c.num_warps, "num_stages": c.num_stages}
        down = {"BLOCK_SIZE_M": c.block_size_m, "BLOCK_SIZE_N": c.down_block_size_n,
                "BLOCK_SIZE_K": c.down_block_size_k, "GROUP_SIZE_M": c.down_group_size_m,
                "num_warps": c.down_num_warps, "num_stages": c.down_num_stages}
        return up, down

    def all_reduce_path(self, nbytes: int, in_cuda_graph: bool) -> str:
        m = self.deployment.model
        row = m.hidden_size * (2 if m.dtype in ("bfloat16", "float16") else 4)
        tokens = max(1, min(nbytes // row, self.deployment.engine.max_num_batched_tokens))
        return self.selectors["all_reduce"](num_tokens=tokens, in_cuda_graph=int(in_cuda_graph),
                                            num_tokens_actual=tokens).path

    def nccl_env(self) -> dict[str, str]:
        """NCCL settings of a pinned NCCL path such as nccl/allreduce:tree.Simple.8ch (empty otherwise)."""
        if "all_reduce" not in self.selectors:
            return {}
        path = self.tuple["all_reduce"].get("path", "")
        if not path.startswith("nccl/"):
            return {}
        parts = path.split(":", 1)[-1].split(".")
        env = {}
        for part in parts:
            if part in ("tree", "ring"):
                env["NCCL_ALGO"] = _NCCL_ENV[part]
            elif part in ("Simple", "LL", "LL128"):
                env["NCCL_PROTO"] = part
            elif part.endswith("ch") and part[:-2].isdigit():
                env["NCCL_MIN_NCHANNELS"] = env["NCCL_MAX_NCHANNELS"] = part[:-2]
        return env

    # ---- the hooks
    def hooks(self) -> dict[str, Hook]:
        out: dict[str, Hook] = {}
        if "attention" in self.selectors:
            splits = self.fa3_num_splits()

            def fa3_init(result: Any, backend: Any, *args: Any, **kwargs: Any) -> None:
                backend.num_splits = splits
                backend.decode_num_splits = splits

            out[TARGETS["fa3"]] = ("AFTER", fa3_init)
        if "moe" in self.selectors:
            def moe(w1_shape, w2_shape, top_k, dtype, M, is_marlin=False, block_shape=None,
                    per_channel_quant=False, return_down_config=False):
                up, down = self.moe_config(int(M))
                return (up, (down, up["BLOCK_SIZE_M"])) if return_down_config else up

            out[TARGETS["moe"]] = ("REPLACE", moe)
        if "all_reduce" in self.selectors:
            os.environ.update(self.nccl_env())

            def resolve(group: Any, input_: Any, should_use_pymscclpp_allreduce: Any = None) -> str | None:
                path = self.all_reduce_path(input_.numel() * input_.element_size(), _in_graph())
                if path == ORDERED_PATH:
                    # the tuple names detent's ordered all-reduce: falling through to NCCL would run another
                    # summation order than the receipt names
                    raise RuntimeError(f"the tuple pins {path}, which this SGLang process does not install; "
                                       "solve with NCCL's chain order recorded or a custom all-reduce path")
                if not path.startswith("custom/"):
                    return None
                if group.ca_comm is None or group.ca_comm.disabled:
                    raise RuntimeError(f"the tuple pins {path} but custom all-reduce is disabled here")
                return "ca"

            def pick(comm: Any, nbytes: int, can_use_graph: bool) -> Any:
                from sglang.kernels.ops.communication.all_reduce import AllReduceAlgo
                from sglang.srt.distributed.device_communicators.custom_all_reduce_v2 import AllReduceConfig

                path = self.all_reduce_path(nbytes, can_use_graph)
                if path not in _V2_ALGOS:
                    return None
                algo, multicast = _V2_ALGOS[path]
                graph = can_use_graph and algo != "ONE_SHOT_PUSH"
                return AllReduceConfig(AllReduceAlgo[algo], use_graph=graph, use_multicast=multicast)

            out[TARGETS["resolve"]] = ("REPLACE", resolve)
            out[TARGETS["pick"]] = ("REPLACE", pick)
        return out


def _in_graph() -> bool:
    import torch

    return bool(torch.cuda.is_available() and torch.cuda.is_current_stream_capturing())
