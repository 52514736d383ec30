"""Deployment facts of the running engine: everything that can change a response's bits, and its hash.

Collected automatically: engine version and mode, source hashes of the kernels and selection programs, the
deployment the selection was solved for (model shape, limits, page size, chunking), checkpoint hashes
(config, weights, tokenizer), the model's name and source (what `--model` to pass: descriptive, the hashes are
its identity) and its EOS ids, dtype, device and its properties, torch version, the CPU thread count (fixed
at start: it changes BLAS bits), the tuple as the kernels read it (the axes of the committed assignment that
change a kernel's params: `kernel_select.used_axes`) and the params the kernels get with it. Weight hashes are cached by (path, device, inode,
size, mtime, ctime): a write with the mtime set back still changes the ctime (which no user call can set), and
a file replaced by another has another inode. Settings that change no bit (the prefill chunk, which batch
invariance makes irrelevant) are not facts: a receipt signs only what a verifier's bits can confirm or what
shapes selection. `static_facts` are those known before the model is built (the verifier compares them
first, so no receipt makes it build anything).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from detent_audit import __version__
from detent_audit.atomic import write_atomically
from detent_audit.cache_dir import cache_root
from detent_audit.engine.generated import is_generated
from detent_audit.engine.tensor_parallel import ACCUMULATE, BACKEND, ORDERED

if TYPE_CHECKING:
    from detent_audit.engine.llm import LLM

_ROOTS = {"kernels": "detent_audit.kernels", "selection_programs": "detent_audit.selection.programs"}


def source_hash(package: str) -> str:
    """SHA-256 over the package's .py files (relative path and bytes), sorted."""
    import importlib

    folder = Path(str(importlib.import_module(package).__file__)).parent
    h = hashlib.sha256()
    for f in sorted(folder.rglob("*.py")):
        h.update(f.relative_to(folder).as_posix().encode() + b"\0" + f.read_bytes() + b"\0")
    return h.hexdigest()


def file_hash(path: Path, cache: dict | None = None) -> str:
    st = path.stat()
    key = f"{path.resolve()}|{st.st_dev}|{st.st_ino}|{st.st_size}|{st.st_mtime_ns}|{st.st_ctime_ns}"
    if cache is not None and key in cache:
        return cache[key]
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    digest = h.hexdigest()
    if cache is not None:
        cache[key] = digest
    return digest


def _hash_cache_file() -> Path:
    return cache_root("weight-hashes.json")


@contextmanager
def hash_cache(cache_file: Path) -> Iterator[dict]:
    """The `file_hash` cache kept in `cache_file` (empty when missing or unreadable), written back atomically
    when the block added to it; one that cannot be written is left: the cache only saves time."""
    try:
        cache = json.loads(cache_file.read_text())
    except (OSError, ValueError):
        cache = {}
    before = dict(cache)
    yield cache
    if cache != before:
        try:
            cache_file.parent.mkdir(parents=True, exist_ok=True)
            write_atomically(cache_file, json.dumps(cache).encode())
        except OSError:
            pass


def checkpoint_hashes(path: Path) -> dict[str, str]:
    """config, tokenizer and weights hashes of a checkpoint folder (weights: a hash over the per-file ones)."""
    with hash_cache(_hash_cache_file()) as cache:
        weights = sorted(path.glob("*.safetensors"))
        per_file = [f"{f.name}:{file_hash(f, cache)}" for f in weights]
    return {"config": file_hash(path / "config.json"),
            "tokenizer": file_hash(path / "tokenizer.json") if (path / "tokenizer.json").exists() else "",
            "weights": hashlib.sha256("\n".join(per_file).encode()).hexdigest()}


def _device(device: str) -> str:
    if device == "cpu":
        return "cpu"
    props = torch.cuda.get_device_properties(0)
    import triton

    return f"{props.name} sm{props.major}{props.minor} {props.multi_processor_count} SMs cuda {torch.version.cuda} " \
           f"triton {triton.__version__}"


def static_facts(cfg: Any) -> dict[str, Any]:
    """The facts of an `EngineConfig` known before its model is built: engine, checkpoint files (hashed, not
    loaded) with the model's name and source, runtime. `collect_facts` extends them."""
    named = cfg.resolved_model
    facts = {
        "engine": {"name": "detent-audit", "version": __version__, "mode": cfg.mode,
                   "sources": {k: source_hash(v) for k, v in sorted(_ROOTS.items())}},
        "checkpoint": {**({"generated": cfg.model, "config": file_hash(cfg.model_path / "config.json")}
                          if is_generated(cfg.model) else checkpoint_hashes(cfg.model_path)),
                       "name": named.name, "source": named.source},
        "runtime": {"torch": str(torch.__version__), "device": _device(cfg.device),
                    "cpu_capability": torch.backends.cpu.get_cpu_capability(),
                    "num_threads": cfg.num_threads, "dtype": cfg.dtype},
    }
    if cfg.tensor_parallel_size > 1:  # how the ranks' partial sums meet (tensor_parallel.py); threads are per rank
        facts["parallel"] = {"tensor_parallel_size": cfg.tensor_parallel_size,
                             "all_reduce": BACKEND if cfg.mode == "stock" else ORDERED, "accumulate": ACCUMULATE}
    return facts


def collect_facts(llm: LLM) -> dict[str, Any]:
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
        "kernel_params": llm.selection.kernel_params,
    }
