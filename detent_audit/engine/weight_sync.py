"""New weights into a built model in place (an RL trainer's policy update) and the digest that names them.

`load_named_weights` takes (name, tensor) pairs named as Hugging Face names them (the checkpoint's names,
fused through `loader.WEIGHT_MAP`) or as the model's own parameters are named, and copies each into place:
the tensors the kernels read keep their storage (a captured CUDA graph stays valid). `weights_digest` is the
canonical SHA-256 over every parameter, in name order: name, dtype, shape, then the bytes.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping

import torch

from detent_audit.engine.loader import IGNORED, IGNORED_WHEN_TIED, _regex, checkpoint_names
from detent_audit.engine.model import CausalLM, Weights, copy_checked
from detent_audit.runtime.errors import BadCheckpoint

NamedTensors = Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]


def load_named_weights(model: CausalLM, weights: NamedTensors) -> int:
    """Copy every named tensor into `model` (cast to the parameter's dtype, shape checked); returns how many
    were copied. A name that is neither a checkpoint name nor a parameter of `model` is `BadCheckpoint`."""
    items = weights.items() if isinstance(weights, Mapping) else weights
    hf_names = checkpoint_names(model)
    params = dict(model.named_parameters())
    ignored = [_regex(t) for t in IGNORED + (IGNORED_WHEN_TIED if model.config.tie_word_embeddings else ())]
    copied = 0
    for name, tensor in items:
        if name in params:
            copy_checked(params[name], tensor.detach(), name)
        elif name in hf_names:
            param, shard = hf_names[name]
            module, _, local = param.rpartition(".")
            owner = model.get_submodule(module)
            if not isinstance(owner, Weights):
                raise RuntimeError(f"{module} holds parameters but does not load them (not a Weights module)")
            owner.weight_loader(local, tensor.detach(), shard, name)
        elif any(r.fullmatch(name) for r in ignored):
            continue
        else:
            raise BadCheckpoint(f"no parameter of the {model.config.architecture} is named {name}",
                                remedy="pass the trainer model's state dict names or the engine's own")
        copied += 1
    return copied


def weights_digest(model: torch.nn.Module) -> str:
    """SHA-256 over the parameters in name order: each one's name, dtype, shape and bytes (any device)."""
    h = hashlib.sha256()
    for name, p in sorted(model.named_parameters()):
        t = p.detach().to("cpu").contiguous()
        h.update(f"{name}\0{str(t.dtype).removeprefix('torch.')}\0{list(t.shape)}\0".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy())
    return h.hexdigest()
