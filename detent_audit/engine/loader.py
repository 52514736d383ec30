"""Load a Hugging Face checkpoint into a `CausalLM`: build on 'meta', stream safetensors, check completeness.

`WEIGHT_MAP` is the whole translation from HF tensor names to ours: q/k/v fuse into `qkv_proj`, gate/up into
`gate_up_proj`, each expert's three matrices into the stacked `experts.w13` / `experts.w2`. Expanded over
the model's layers and experts it gives the exact set of tensor names a checkpoint must hold
(`checkpoint_names`), so loading ends with two checks: every expected tensor arrived (else `BadCheckpoint`
naming the missing ones) and every checkpoint tensor was used (else `BadCheckpoint` naming the extras).
"""

from __future__ import annotations

import itertools
import json
import re
from pathlib import Path

import torch
from safetensors import safe_open

from detent_audit.engine.model import CausalLM, Weights
from detent_audit.errors import BadInput
from detent_audit.runtime.dtypes import DTYPES
from detent_audit.runtime.errors import BadCheckpoint
from detent_audit.runtime.model_config import ModelConfig

# HF tensor name -> (our parameter, shard). {L}: layer, {E}: expert, {P}: weight or bias.
WEIGHT_MAP: dict[str, tuple[str, str | None]] = {
    "model.embed_tokens.weight": ("embed_tokens.weight", None),
    "model.norm.weight": ("norm.weight", None),
    "lm_head.weight": ("lm_head.weight", None),
    "model.layers.{L}.input_layernorm.weight": ("layers.{L}.input_layernorm.weight", None),
    "model.layers.{L}.post_attention_layernorm.weight": ("layers.{L}.post_attention_layernorm.weight", None),
    "model.layers.{L}.self_attn.q_proj.{P}": ("layers.{L}.self_attn.qkv_proj.{P}", "q"),
    "model.layers.{L}.self_attn.k_proj.{P}": ("layers.{L}.self_attn.qkv_proj.{P}", "k"),
    "model.layers.{L}.self_attn.v_proj.{P}": ("layers.{L}.self_attn.qkv_proj.{P}", "v"),
    "model.layers.{L}.self_attn.o_proj.{P}": ("layers.{L}.self_attn.o_proj.{P}", None),
    "model.layers.{L}.self_attn.q_norm.weight": ("layers.{L}.self_attn.q_norm.weight", None),
    "model.layers.{L}.self_attn.k_norm.weight": ("layers.{L}.self_attn.k_norm.weight", None),
    "model.layers.{L}.mlp.gate_proj.weight": ("layers.{L}.mlp.gate_up_proj.weight", "gate"),
    "model.layers.{L}.mlp.up_proj.weight": ("layers.{L}.mlp.gate_up_proj.weight", "up"),
    "model.layers.{L}.mlp.down_proj.weight": ("layers.{L}.mlp.down_proj.weight", None),
    "model.layers.{L}.mlp.gate.weight": ("layers.{L}.mlp.gate.weight", None),
    "model.layers.{L}.mlp.experts.{E}.gate_proj.weight": ("layers.{L}.mlp.experts.w13", "{E}.gate"),
    "model.layers.{L}.mlp.experts.{E}.up_proj.weight": ("layers.{L}.mlp.experts.w13", "{E}.up"),
    "model.layers.{L}.mlp.experts.{E}.down_proj.weight": ("layers.{L}.mlp.experts.w2", "{E}"),
}
# Tensors some exports carry that hold no weight of ours: old RoPE tables, a tied head's copy of the
# embedding.
IGNORED = ("model.layers.{L}.self_attn.rotary_emb.inv_freq",)
IGNORED_WHEN_TIED = ("lm_head.weight",)
_MAX_NAMES = 10  # names listed in an error before "and N more"


def _regex(template: str) -> re.Pattern[str]:
    pattern = re.escape(template).replace(r"\{L\}", r"(?P<L>\d+)").replace(r"\{E\}", r"(?P<E>\d+)")
    return re.compile(pattern.replace(r"\{P\}", r"(?P<P>weight|bias)"))


def _names(names: list[str]) -> str:
    more = f" and {len(names) - _MAX_NAMES} more" if len(names) > _MAX_NAMES else ""
    return ", ".join(names[:_MAX_NAMES]) + more


def checkpoint_names(model: CausalLM) -> dict[str, tuple[str, str | None]]:
    """Every HF tensor name `model` needs -> (our parameter, shard), sorted by HF name.

    Expands `WEIGHT_MAP` over layers, experts and weight/bias, keeping the entries whose parameter and shard
    exist in this model; raises `RuntimeError` (a bug, not a user error) if some parameter shard is left
    without a source.
    """
    c = model.config
    params = dict(model.named_parameters())
    found: dict[str, tuple[str, str | None]] = {}
    for hf, (ours, shard) in WEIGHT_MAP.items():
        layers = range(c.num_hidden_layers) if "{L}" in hf else [0]
        experts = range(c.num_experts) if "{E}" in hf else [0]
        kinds = ("weight", "bias") if "{P}" in hf else ("weight",)
        for layer, expert, kind in itertools.product(layers, experts, kinds):
            name = ours.format(L=layer, P=kind)
            if name not in params:
                continue
            shard_id = None if shard is None else shard.format(E=expert)
            module, _, local = name.rpartition(".")
            if shard_id in _owner(model, module).shard_ids(local):
                found[hf.format(L=layer, E=expert, P=kind)] = (name, shard_id)
    covered = set(found.values())
    for name in params:
        module, _, local = name.rpartition(".")
        lost = [s for s in _owner(model, module).shard_ids(local) if (name, s) not in covered]
        if lost:
            raise RuntimeError(f"WEIGHT_MAP gives no checkpoint tensor for {name} shards {lost}")
    return dict(sorted(found.items()))


def _owner(model: CausalLM, module: str) -> Weights:
    owner = model.get_submodule(module)
    if not isinstance(owner, Weights):
        raise RuntimeError(f"{module} holds parameters but does not load them (not a Weights module)")
    return owner


def checkpoint_files(path: Path) -> list[Path]:
    """The safetensors files of a checkpoint: those the index names if there is one, else all, sorted."""
    index = path / "model.safetensors.index.json"
    if index.exists():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise BadCheckpoint(f"cannot read the weight_map of {index}: {exc!r}") from exc
        files = [path / name for name in sorted(set(weight_map.values()))]
        absent = [f.name for f in files if not f.is_file()]
        if absent:
            raise BadCheckpoint(f"{index.name} names shards that are not in {path}: {_names(absent)}")
        return files
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise BadCheckpoint(f"no *.safetensors file in {path}", remedy="download the model's weights too")
    return files


def load_weights(model: CausalLM, files: list[Path]) -> None:
    """Stream every tensor of `files` into `model` through its modules' `weight_loader`, then check both
    ways."""
    c = model.config
    expected = checkpoint_names(model)
    ignored = [_regex(t) for t in IGNORED + (IGNORED_WHEN_TIED if c.tie_word_embeddings else ())]
    seen: dict[str, str] = {}
    unused: list[str] = []
    for file in files:
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in sorted(f.keys()):
                if name in seen:
                    raise BadCheckpoint(f"tensor {name} is in both {seen[name]} and {file.name}")
                seen[name] = file.name
                if name not in expected:
                    if not any(r.fullmatch(name) for r in ignored):
                        unused.append(name)
                    continue
                param, shard = expected[name]
                module, _, local = param.rpartition(".")
                _owner(model, module).weight_loader(local, f.get_tensor(name), shard, name)
    missing = [name for name in expected if name not in seen]
    if missing:
        raise BadCheckpoint(f"checkpoint lacks {len(missing)} tensor(s) the {c.architecture} needs: "
                            f"{_names(missing)}")
    if unused:
        raise BadCheckpoint(f"checkpoint has {len(unused)} tensor(s) the {c.architecture} does not use: "
                            f"{_names(sorted(unused))}",
                            remedy="check that config.json describes these weights (layers, experts, biases)")


def load_model(path: str | Path, dtype: torch.dtype = torch.float32,
               device: torch.device | str = "cpu") -> CausalLM:
    """Read config.json, build the model on 'meta', load the safetensors cast to `dtype`, on `device`."""
    if dtype not in DTYPES.values():
        raise BadInput(f"cannot load weights as {dtype}", remedy=f"use one of {', '.join(DTYPES)}")
    path = Path(path)
    config = ModelConfig.from_pretrained(path)
    model = CausalLM(config, dtype=dtype, device="meta")
    model.to_empty(device=device)
    load_weights(model, checkpoint_files(path))
    model.build_rope(device)
    return model.eval()
