"""The embedded engine's deployment facts: everything that can change a response's bits (the hash helpers are
`detent_audit.runtime.facts`'s, which the module docstring there describes). `static_facts` are those known
before the model is built (the verifier compares them first, so no receipt makes it build anything);
`collect_facts` the running engine's, as `LLM.facts()` returns them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from detent_audit import __version__, isa
from detent_audit.engine.tensor_parallel import ACCUMULATE, BACKEND, ORDERED
from detent_audit.enums import Mode
from detent_audit.runtime.contract import EMBEDDED, Facts
from detent_audit.runtime.facts import SOURCE_ROOTS, checkpoint_hashes, file_hash, format_facts, source_hash
from detent_audit.runtime.kernel_select import GEMM_FORM_KNOB, committed_gemm, order_facts
from detent_audit.runtime.model_config import ModelConfig
from detent_audit.runtime.named_models import is_generated

if TYPE_CHECKING:
    from detent_audit.engine.llm import LLM, EngineConfig


def _device(device: str) -> str:
    if device == "cpu":
        return "cpu"
    props = torch.cuda.get_device_properties(0)
    import triton

    return f"{props.name} sm{props.major}{props.minor} {props.multi_processor_count} SMs " \
           f"cuda {torch.version.cuda} " \
           f"triton {triton.__version__}"


def static_facts(cfg: EngineConfig) -> dict[str, dict[str, object]]:
    """The facts of an `EngineConfig` known before its model is built: engine, checkpoint files (hashed, not
    loaded) with the model's name and source, runtime. `collect_facts` extends them."""
    named = cfg.resolved_model
    facts: dict[str, dict[str, object]] = {
        "engine": {"name": EMBEDDED, "version": __version__, "mode": cfg.mode,
                   "sources": {k: source_hash(v) for k, v in sorted(SOURCE_ROOTS.items())}},
        "checkpoint": {**({"generated": cfg.model, "config": file_hash(cfg.model_path / "config.json")}
                          if is_generated(cfg.model) else checkpoint_hashes(cfg.model_path)),
                       "name": named.name, "source": named.source},
        "runtime": {"torch": str(torch.__version__), "device": _device(cfg.device),
                    **isa.runtime_facts(),
                    "num_threads": cfg.num_threads, "dtype": cfg.dtype},
    }
    if _device(cfg.device) == "cpu":
        # under the cap in detent mode, the project's kernels, every operation's order written out
        # (docs/isa.md); else the BLAS's (a MoE's experts too), which choose code by the CPU model
        moe = ModelConfig.from_pretrained(cfg.model_path).num_experts > 0
        gemm = committed_gemm(cfg.tuple)  # None: the cap's choice, the fixed form; a committed form is kept
        fixed_gemm = gemm is None or gemm.get(GEMM_FORM_KNOB) == "fixed"
        facts["runtime"].update(order_facts(cfg.mode == Mode.DETENT and cfg.dtype == "float32" and not moe
                                            and fixed_gemm))
    # how the ranks' partial sums meet (tensor_parallel.py); threads are per rank
    if cfg.tensor_parallel_size > 1:
        facts["parallel"] = {"tensor_parallel_size": cfg.tensor_parallel_size,
                             "all_reduce": BACKEND if cfg.mode == Mode.STOCK else ORDERED,
                             "accumulate": ACCUMULATE}
    return facts


def collect_facts(llm: LLM) -> Facts:
    """The engine's bit-relevant facts (plain JSON types, no floats)."""
    cfg = llm.config
    facts = static_facts(cfg)
    # the stop set a finish is checked against: from tokenizer_config.json, generation_config.json and
    # config.json, files the hashes above do not all cover
    facts["checkpoint"]["eos_token_ids"] = list(llm.tokenizer.eos_token_ids)
    if llm.weights_digest is not None:  # weights loaded in place since (an RL policy update): their digest
        facts["checkpoint"]["weights"] = llm.weights_digest
        facts["checkpoint"]["weights_source"] = "memory"
    return {
        **facts,
        "deployment": llm.deployment.to_canonical(),
        "scheduler": {"block_size": cfg.block_size, "max_num_batched_tokens": cfg.max_num_batched_tokens,
                      "prefix_caching": cfg.prefix_caching},
        "tuple": llm.selection.used_tuple,
        "format": format_facts(),
        "kernel_params": llm.selection.kernel_params,
    }
