"""The engines' own defaults for the deployment facts the solver reads, each with the upstream line that
says so.

A shipped deployment file describes an engine as its version runs out of the box, so every fact listed here
for its engine and version must equal the upstream default, and a fact a file leaves out takes
`EngineFacts`' default, which must be the upstream one too (tests/manifests/test_engine_defaults.py checks
both). A version with no entry is not checked: add its defaults when a deployment file names it.
"""

from __future__ import annotations

from dataclasses import dataclass

from detent_audit.manifests.deployment import Deployment


@dataclass(frozen=True)
class UpstreamDefault:
    """One engine setting's default at one release, and where upstream says so (file:line at a commit)."""

    fact: str            # the EngineFacts field
    value: bool | int | str
    source: str


VLLM_0_33 = (
    # vllm-project/vllm v0.33.0 (commit 4ba787ec9, vllm/_version.py of the PyPI sdist):
    # vllm/config/model.py:316 `disable_cascade_attn: bool = True`, the default since PR #36318 (merged
    # 2026-03-07); in 0.33 the runner keeps cascade off whatever the setting
    # (vllm/v1/worker/gpu_model_runner.py:539-541)
    UpstreamDefault("disable_cascade_attn", True,
                    "vllm-project/vllm v0.33.0 (4ba787ec9) vllm/config/model.py:316; PR #36318"),
)

SGLANG_0_5_23 = (
    # sgl-kernel fetches FlashAttention-3 from sgl-project/sgl-attn at this commit: sgl-project/sglang
    # @ 00390b86 sgl-kernel/CMakeLists.txt:91-98 (the "# flash-attention" FetchContent block)
    UpstreamDefault("fa3_source", "sgl-project/sgl-attn@f20a52329482ddca4a627b2f028f88c2959ee299",
                    "sgl-project/sglang 00390b86 sgl-kernel/CMakeLists.txt:91-98 (GIT_TAG)"),
)

ENGINE_DEFAULTS: dict[tuple[str, str], tuple[UpstreamDefault, ...]] = {
    ("vllm", "0.33.0"): VLLM_0_33,
    ("sglang", "0.5.23"): SGLANG_0_5_23,
}


def upstream_defaults(dep: Deployment) -> tuple[UpstreamDefault, ...]:
    """The recorded upstream defaults of the deployment's engine version (empty when none are recorded)."""
    return ENGINE_DEFAULTS.get((dep.engine.name, dep.engine.version), ())


def departures(dep: Deployment) -> list[str]:
    """Each fact of `dep` that differs from its engine version's recorded default, as a sentence."""
    e = dep.engine
    return [f"{d.fact} = {getattr(e, d.fact)!r}, but {e.name} {e.version} defaults to {d.value!r} "
            f"({d.source})" for d in upstream_defaults(dep) if getattr(e, d.fact) != d.value]
