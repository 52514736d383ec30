"""Step (7) of verification: rebuild the serving engine a receipt describes, and refuse to compare where a
bit-relevant fact differs.

The engine is the one the receipt's facts name, found in the registry (`detent_audit.runtime.registry`); it
rebuilds itself from the facts and tuple on the verifier's own checkpoint (`--model`, or the model the receipt
names: never a folder a receipt names) and refuses with a typed verdict (`detent_audit.runtime.rebuild`):
`NotComparable` naming every differing field (weights, kernel sources, torch version, CPU capability, ...),
also for an engine this installation does not have; where the checkpoint differs, which `--model` the receipt
was served from. Here a refusal becomes step (7)'s error.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from detent_audit.enums import ExitCode
from detent_audit.runtime import rebuild, registry
from detent_audit.runtime.contract import Engine
from detent_audit.verifier.steps import DeploymentError


class NotComparable(DeploymentError):
    """The local deployment differs from the receipt's in a bit-relevant fact (step (7), exit 3)."""

    exit_code = ExitCode.NOT_COMPARABLE
    remedy = "verify on a machine and checkpoint that match the receipt's deployment facts"

    def __init__(self, fields: list[str], message: str | None = None) -> None:
        super().__init__(message or f"deployment differs in {len(fields)} field(s): {', '.join(fields)}",
                         fields=fields)


def reconstruct(facts: Mapping[str, object], tuple_values: Mapping[str, object], model: str | Path | None,
                cache_dir: str | None = None, threads: int | None = None,
                tuple_override: Mapping[str, Mapping[str, object]] | None = None, *,
                kv_tokens: int = 0, tensor_parallel: int | None = None) -> Engine:
    """Step (7), the deployment and its tuple: the local engine for these facts, of the engine they name;
    raises `NotComparable` (also for an engine this installation does not have) or `BadInput`.
    `tensor_parallel`: re-execute a tensor-parallel receipt natively at that size (None: by rank
    emulation)."""
    request = rebuild.RebuildRequest(facts, tuple_values, None if model is None else str(model), cache_dir,
                                     threads, tuple_override, kv_tokens, tensor_parallel=tensor_parallel)
    try:
        return registry.rebuild(request)
    except rebuild.NotComparable as exc:
        raise NotComparable(exc.fields, exc.message) from None
