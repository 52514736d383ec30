"""The SelIR programs and which of them a deployment runs.

`FAMILIES` maps a program's key (its function name) to its `FamilySpec`; `families_for(dep)` lists, in a
fixed order, the specs that apply to a deployment: at most one program per family.

| family | program (module) | applies when |
|---|---|---|
| attention | `fa3`, `fa3_vllm`, `fa3_sglang` (fa3) | FA3 (sm90): vLLM's fork, SGLang's sgl-attn, upstream |
| attention | `flashinfer_prefill` (flashinfer) | vLLM with the FlashInfer backend (its planner) |
| moe | `fused_moe` (fused_moe) | the model has experts (vllm, sglang) |
| all_reduce | `all_reduce_vllm`, `all_reduce_sglang` | TP > 1, by engine (SGLang: sm90 tables only) |
| gemm | `gemm` (gemm) | vllm and sglang |
| embedded.gemm, embedded.attention, embedded.moe | (embedded) | the detent engine (moe: with experts) |
| embedded.all_reduce | (embedded) | the detent engine at tensor_parallel_size > 1 |

Not transcribed: SGLang's FlashInfer, Triton attention, FA2 (`families_for` raises `NotTranscribed`, exit 3),
SGLang's all-reduce on other archs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from detent_audit.manifests.deployment import Deployment
from detent_audit.selection.errors import NotTranscribed
from detent_audit.selection.programs import all_reduce, embedded, fa3, flashinfer, fused_moe, gemm


@dataclass(frozen=True)
class FamilySpec:
    """One SelIR program: its family, where it lives, how to build its facts and when it applies."""

    name: str                                  # the family: tuples and knobs are per family
    module: str                                # module name under detent_audit.selection.programs
    program: Callable[..., Any]                # the @program function
    facts: Callable[[Deployment], Any]         # Deployment -> the program's facts record (plain Python)
    applies: Callable[[Deployment], bool]

    def __post_init__(self) -> None:
        tag = getattr(self.program, "__selir_family__", None)
        if tag != self.name:
            raise ValueError(f"program {self.program.__name__} is tagged family {tag!r}, not {self.name!r}")

    @property
    def key(self) -> str:
        return self.program.__name__


def _stock(dep: Deployment) -> bool:
    return dep.engine.name in ("vllm", "sglang")


def _fa3(dep: Deployment) -> bool:
    return _stock(dep) and dep.engine.attention_backend == "fa3" and dep.arch == "sm90"


_SPECS = (
    FamilySpec("attention", "fa3", fa3.fa3, fa3.facts,
               lambda dep: _fa3(dep) and not dep.engine.uses_vllm_fa_fork and dep.engine.name != "sglang"),
    FamilySpec("attention", "fa3", fa3.fa3_sglang, fa3.facts,
               lambda dep: _fa3(dep) and dep.engine.name == "sglang"),
    FamilySpec("attention", "fa3", fa3.fa3_vllm, fa3.facts,
               lambda dep: _fa3(dep) and dep.engine.uses_vllm_fa_fork),
    FamilySpec("attention", "flashinfer", flashinfer.flashinfer_prefill, flashinfer.facts,
               lambda dep: dep.engine.name == "vllm" and dep.engine.attention_backend == "flashinfer"),
    FamilySpec("moe", "fused_moe", fused_moe.fused_moe, fused_moe.facts,
               lambda dep: _stock(dep) and dep.model.is_moe),
    FamilySpec("all_reduce", "all_reduce", all_reduce.all_reduce_vllm, all_reduce.facts,
               lambda dep: dep.engine.name == "vllm" and dep.parallel.tensor_parallel_size > 1),
    FamilySpec("all_reduce", "all_reduce", all_reduce.all_reduce_sglang, all_reduce.facts,
               lambda dep: dep.engine.name == "sglang" and dep.parallel.tensor_parallel_size > 1
               and dep.arch == "sm90"),
    FamilySpec("gemm", "gemm", gemm.gemm, gemm.facts, _stock),
    FamilySpec("embedded.gemm", "embedded", embedded.embedded_gemm, embedded.facts,
               lambda dep: dep.engine.name == "detent"),
    FamilySpec("embedded.attention", "embedded", embedded.embedded_attention, embedded.facts,
               lambda dep: dep.engine.name == "detent"),
    FamilySpec("embedded.moe", "embedded", embedded.embedded_moe, embedded.facts,
               lambda dep: dep.engine.name == "detent" and dep.model.is_moe),
    FamilySpec("embedded.all_reduce", "embedded", embedded.embedded_all_reduce, embedded.all_reduce_facts,
               lambda dep: dep.engine.name == "detent" and dep.parallel.tensor_parallel_size > 1),
)

FAMILIES: dict[str, FamilySpec] = {spec.key: spec for spec in _SPECS}
FAMILY_ORDER = ("attention", "moe", "all_reduce", "gemm", "embedded.attention", "embedded.moe",
                "embedded.gemm", "embedded.all_reduce")


def families_for(dep: Deployment) -> list[FamilySpec]:
    """The programs a deployment runs, in FAMILY_ORDER; at most one per family.

    Raises `NotTranscribed` (exit 3) when a stock engine's attention has no program: its selection would read
    as 0 pins, which is a claim nobody checked.
    """
    out = []
    for family in FAMILY_ORDER:
        matching = [spec for spec in _SPECS if spec.name == family and spec.applies(dep)]
        if len(matching) > 1:  # the applies() rules are exclusive by construction; a new one must keep that
            raise ValueError(f"{dep.name}: programs {[s.key for s in matching]} all apply to family {family}")
        out.extend(matching)
    if _stock(dep) and not any(spec.name == "attention" for spec in out):
        e = dep.engine
        raise NotTranscribed(
            f"{dep.name}: the attention selection of {e.name} {e.version} with backend "
            f"{e.attention_backend!r} on {dep.arch} is not transcribed",
            remedy="transcribed: FA3 on sm90 (vLLM fork, sgl-attn, upstream) and vLLM's FlashInfer backend; "
                   "add a program to detent_audit.selection.programs")
    return out
