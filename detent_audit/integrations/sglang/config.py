"""What the SGLang plugin is told, in every SGLang process: one JSON value in `DETENT_SGLANG`.

SGLang starts its scheduler in a fresh process and loads plugins there from the entry point alone, so the
plugin's settings travel in the environment. `PluginConfig` is that value, validated on both sides; an
unset variable means stock SGLang (the plugin then only installs the import stand-ins SGLang needs on a CPU).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from detent_audit.enums import Mode
from detent_audit.errors import BadInput

ENV = "DETENT_SGLANG"
MODES = (Mode.DETENT.value, Mode.STOCK.value)
ATTENTIONS = ("c", "torch")  # detent's attention: kernels/attention_c.py or kernels/attention.py

# Settings of SGLang itself that change bits, fixed by detent mode (exported before SGLang starts):
# the fused input-logprob path normalises with a logsumexp whose reduction order differs from the
# log_softmax that generation's logprobs use (srt/layers/logprob_processor.py), so rescoring would not
# reproduce generation bit for bit.
DETENT_SGLANG_ENV = {"SGLANG_ENABLE_FAST_INPUT_LOGPROBS": "0"}


@dataclass(frozen=True)
class PluginConfig:
    """mode: detent (the plugin's kernels and pinned selection) or stock (SGLang as shipped);
    model_path: the checkpoint (its config.json sizes the CPU selection); num_threads: torch threads per
    process; tuple: the committed tuple for the CPU kernels (family -> axis -> value; {} = the preferred legal
    one); deployment: a deployment TOML whose SGLang selection points (FA3 splits, MoE row, all-reduce) are
    pinned (CUDA only; None on a CPU); cuda_tuple: that deployment's committed tuple ({} = its default);
    report_dir: where each process writes which hooks it applied (None: nowhere); launcher_pid: the process
    that starts SGLang (its hooks go only into SGLang's own processes; None: every process); attention: the
    form of detent's attention (`c`, built on this machine, or `torch`: their bits differ, the facts say
    which);
    max_model_len, max_num_seqs, max_num_batched_tokens: the limits the CPU selection is solved for, which
    SGLang's own must fit (its context length, running requests, and tokens of one step: the chunked-prefill
    size); the scheduler refuses a request beyond `max_model_len` (`guard.py`)."""

    mode: str
    model_path: str
    num_threads: int = 1
    tuple: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    deployment: str | None = None
    cuda_tuple: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    report_dir: str | None = None
    launcher_pid: int | None = None
    attention: str = "c"
    max_model_len: int = 2048
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 8192

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise BadInput(f"SGLang plugin mode {self.mode!r} is not one of {MODES}",
                           remedy="serve SGLang in detent or stock mode")
        if self.attention not in ATTENTIONS:
            raise BadInput(f"the plugin's attention {self.attention!r} is not one of {ATTENTIONS}")
        for name in ("num_threads", "max_model_len", "max_num_seqs", "max_num_batched_tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise BadInput(f"{name} must be a positive integer, got {value!r}")
        pid = self.launcher_pid
        if pid is not None and (isinstance(pid, bool) or not isinstance(pid, int)):
            raise BadInput(f"launcher_pid must be a process id, got {self.launcher_pid!r}")
        for name in ("tuple", "cuda_tuple"):
            value = getattr(self, name)
            if not isinstance(value, Mapping) or not all(isinstance(v, Mapping) for v in value.values()):
                raise BadInput(f"the plugin's {name} must map families to assignments, got {value!r}")

    def to_env(self) -> str:
        return json.dumps(asdict(self), sort_keys=True, default=dict)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> PluginConfig | None:
        """The configuration in the environment, or None (stock SGLang). Raises BadInput on a bad value."""
        text = (environ if environ is not None else os.environ).get(ENV)
        if not text:
            return None
        try:
            data = json.loads(text)
        except ValueError as exc:
            raise BadInput(f"{ENV} is not JSON ({exc})", remedy="let detent-audit set it") from None
        if not isinstance(data, dict):
            raise BadInput(f"{ENV} must be a JSON object")
        try:
            return cls(**data)
        except TypeError as exc:
            raise BadInput(f"{ENV} has unknown or missing fields ({exc})",
                           remedy="let detent-audit set it") from None
