"""Errors of the engine's model side: what a checkpoint or a model name can get wrong.

Both derive from `DetentError`, so the CLI prints them with their remedy and no traceback.
"""

from __future__ import annotations

from detent_audit.enums import ExitCode
from detent_audit.errors import BadInput, DetentError


class UnsupportedModel(DetentError):
    """The checkpoint is well formed but describes a model or a feature the engine does not run."""

    exit_code = ExitCode.BAD_INPUT
    remedy = (
        "detent-audit's engine runs LlamaForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM and "
        "Qwen3MoeForCausalLM with SiLU MLPs and full attention; serve other models through the vLLM or "
        "SGLang integration"
    )


class BadCheckpoint(BadInput):
    """A checkpoint directory is incomplete or inconsistent: a key, file or tensor is missing or extra."""

    remedy = "re-download or re-export the checkpoint; its config.json and safetensors files must match"
