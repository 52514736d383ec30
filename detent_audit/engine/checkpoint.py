"""Seeded random checkpoints in Hugging Face's format, written without transformers.

`write_random_checkpoint` writes config.json, generation_config.json, tokenizer.json (a byte-level BPE: the
256 byte tokens, then the family's special tokens), tokenizer_config.json with a chat template, and the
weights as one safetensors file or as shards with model.safetensors.index.json. The same (shape, seed,
dtype, shards) writes byte-identical files: each tensor draws from its own generator seeded by
SHA-256(seed, tensor name), through numpy's frozen legacy stream, and every JSON file sorts its keys.
`ensure_default_model` materialises the random-20m model (named_models.RANDOM_MODEL) once per cache directory.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import save_file
from tokenizers import AddedToken, decoders, models, pre_tokenizers, processors
from tokenizers import Tokenizer as HFTokenizer

from detent_audit.cache_dir import cache_root
from detent_audit.engine.loader import checkpoint_names
from detent_audit.engine.model import CausalLM
from detent_audit.errors import BadInput
from detent_audit.runtime.dtypes import DTYPES, dtype_name
from detent_audit.runtime.model_config import ModelConfig
from detent_audit.runtime.tokenizer import CHAT_FORMATS, ChatFormat, bytes_to_unicode

DEFAULT_MODEL = "default-20m"
DEFAULT_SEED = 20_000_000
DEFAULT_FORMAT_VERSION = 1  # bump when the writer's output changes, so caches regenerate


def chat_format_for(config: ModelConfig) -> ChatFormat:
    return CHAT_FORMATS["llama3" if config.architecture == "LlamaForCausalLM" else "chatml"]


def build_tokenizer(fmt: ChatFormat) -> HFTokenizer:
    """Byte-level BPE with no merges: id b is byte b, specials follow from 256 in `fmt`'s order."""
    chars = bytes_to_unicode()
    tok = HFTokenizer(models.BPE(vocab={chars[b]: b for b in range(256)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in fmt.special_tokens])
    if fmt.bos_token is not None:  # Llama 3 prepends BOS to every plain encode
        bos_id = 256 + fmt.special_tokens.index(fmt.bos_token)
        tok.post_processor = processors.TemplateProcessing(
            single=f"{fmt.bos_token} $A", pair=f"{fmt.bos_token} $A {fmt.bos_token} $B",
            special_tokens=[(fmt.bos_token, bos_id)])
    return tok


def _random_tensor(name: str, shape: tuple[int, ...], seed: int, dtype: torch.dtype) -> torch.Tensor:
    """Never zeros: norms ~ 1 + 0.1 N, biases 0.1 N, embeddings 0.5 N, matrices N / sqrt(fan_in)."""
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    noise = np.random.RandomState(int.from_bytes(digest[:4], "little")).standard_normal(shape)
    if name.endswith("norm.weight"):
        values = 1.0 + 0.1 * noise
    elif name.endswith(".bias"):
        values = 0.1 * noise
    elif name.endswith("embed_tokens.weight"):
        values = 0.5 * noise
    else:
        values = noise / np.sqrt(shape[-1])
    return torch.from_numpy(values.astype(np.float32)).to(dtype)


def _write_json(file: Path, data: Any) -> None:
    file.write_text(json.dumps(data, indent=2, sort_keys=True, ensure_ascii=False) + "\n", encoding="utf-8")


def write_random_checkpoint(path: str | Path, shape_or_config: str | ModelConfig, seed: int,
                            dtype: str | torch.dtype = "float32", shards: int = 1,
                            weights: bool = True) -> Path:
    """Write a seeded random HF checkpoint of a named shape (`NAMED_SHAPES`) or config into `path`
    (`weights=False`: config and tokenizer only, for weights generated on the device).

    The config's bos/eos ids are replaced by the tokenizer's and torch_dtype by `dtype`. Returns `path`.
    Raises `BadInput` for an unknown dtype, a vocabulary smaller than the tokenizer or too many shards.
    """
    config = ModelConfig.from_name(shape_or_config) if isinstance(shape_or_config, str) else shape_or_config
    dtype_str = dtype_name(dtype)
    if dtype_str not in DTYPES:
        raise BadInput(f"cannot write a checkpoint in {dtype}", remedy=f"use one of {sorted(DTYPES)}")
    fmt = chat_format_for(config)
    ids = {t: 256 + i for i, t in enumerate(fmt.special_tokens)}
    if config.vocab_size < 256 + len(ids):
        raise BadInput(
            f"vocab_size {config.vocab_size} is smaller than the tokenizer's {256 + len(ids)} tokens"
        )
    config = dataclasses.replace(config, torch_dtype=dtype_str, bos_token_id=ids.get(fmt.bos_token or ""),
                                 eos_token_ids=tuple(sorted(ids[t] for t in fmt.eos_tokens)))
    model = CausalLM(config, device="meta")
    names = checkpoint_names(model)
    if not 1 <= shards <= len(names):
        raise BadInput(f"cannot split {len(names)} tensors into {shards} shards")

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    _write_json(path / "config.json", config.to_hf_dict())
    _write_json(path / "generation_config.json",
                {"bos_token_id": config.bos_token_id, "eos_token_id": list(config.eos_token_ids)})
    build_tokenizer(fmt).save(str(path / "tokenizer.json"), pretty=True)
    _write_json(path / "tokenizer_config.json", {
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": fmt.bos_token,
        "eos_token": fmt.eos_tokens[0],
        "chat_template": fmt.template, "clean_up_tokenization_spaces": False,
        "model_max_length": config.max_position_embeddings})

    if not weights:
        return path
    tensors: dict[str, torch.Tensor] = {}
    for name, (param, shard) in names.items():
        module, _, local = param.rpartition(".")
        shape = model.get_submodule(module).shard_shape(local, shard)
        tensors[name] = _random_tensor(name, shape, seed, DTYPES[dtype_str])
    ordered = sorted(tensors)
    if shards == 1:
        save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
        return path
    weight_map: dict[str, str] = {}
    for i in range(shards):
        file = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        part = ordered[i * len(ordered) // shards:(i + 1) * len(ordered) // shards]
        save_file({n: tensors[n] for n in part}, str(path / file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, file))
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    _write_json(path / "model.safetensors.index.json",
                {"metadata": {"total_size": total}, "weight_map": weight_map})
    return path


def ensure_default_model(cache_dir: str | Path | None = None) -> Path:
    """Path of the random-20m model (shape "default-20m", fixed seed), writing it on first use.

    Written into a temporary sibling directory and renamed into place, so a reader never sees a partial
    model; when two processes race, the loser's copy is discarded and both return the same path.
    """
    root = Path(cache_dir) if cache_dir is not None else cache_root()
    target = root / "models" / f"{DEFAULT_MODEL}-seed{DEFAULT_SEED}-v{DEFAULT_FORMAT_VERSION}"
    if (target / "config.json").exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        write_random_checkpoint(tmp, DEFAULT_MODEL, DEFAULT_SEED, "float32")
        os.rename(tmp, target)
    except OSError:
        if not (target / "config.json").exists():
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target
