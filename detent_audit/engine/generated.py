"""Models with weights generated on the device from a seed, at a named shape (no checkpoint to download or
read: the GPU benchmarks' Llama-3.2-1B, Llama-3.1-8B and Qwen3-30B-A3B shapes).

`random:<shape>` as the engine's model: config and tokenizer files are written once (no weights) under the
user cache, and every parameter is drawn on the device from a generator seeded by (seed, parameter name):
random normal with std 0.02, norm weights around 1; never zeros. Deterministic for a seed and a device kind.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import torch

from detent_audit.cache_dir import cache_root
from detent_audit.engine.checkpoint import write_random_checkpoint
from detent_audit.engine.model import CausalLM
from detent_audit.runtime.model_config import ModelConfig
from detent_audit.runtime.named_models import GENERATED_PREFIX

SEED = 0


def model_card(model: str) -> Path:
    """The folder with config.json and the tokenizer of a generated model (written once)."""
    shape = model.removeprefix(GENERATED_PREFIX)
    path = cache_root("models") / f"card-{shape}"
    if not (path / "config.json").exists():
        write_random_checkpoint(path, shape, SEED, weights=False)
    return path


def generate_model(model: str, dtype: torch.dtype, device: str) -> CausalLM:
    """The named shape with seeded random weights drawn on `device`."""
    config = ModelConfig.from_pretrained(model_card(model))
    net = CausalLM(config, dtype=dtype, device=device)
    with torch.no_grad():
        for name, p in sorted(net.named_parameters()):
            seed = int(hashlib.sha256(f"{SEED}:{name}".encode()).hexdigest()[:15], 16)
            g = torch.Generator(device=device).manual_seed(seed)
            noise = torch.randn(p.shape, generator=g, device=device, dtype=torch.float32)
            p.copy_((1.0 + 0.05 * noise) if "norm" in name else 0.02 * noise)
    return net.eval()
