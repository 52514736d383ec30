"""What a verification run reads and how it spreads the work: the receipt and manifest files under the paths,
the seeded sample, the batches (each of one deployment and tuple) and the worker processes.

`workers` > 1 re-executes the batches in that many processes, each an engine of the receipt's own deployment
(its thread count included), so the bits are the same as one process's; giving the cores to one engine would
change the deployment and make every receipt not comparable. `auto_workers` takes as many as the cores allow
at the receipts' thread count, no more than there are full batches of receipts (a worker's start, the
interpreter, torch and the engine, pays only then), and no more than the available memory holds engines.
"""

from __future__ import annotations

import math
import os
import random
from collections.abc import Iterable
from pathlib import Path
from typing import Any, NamedTuple

from detent_audit.errors import DetentError
from detent_audit.manifests.deployment import DTYPE_BYTES, decoder_parameters
from detent_audit.manifests.intoto import exported_name
from detent_audit.runtime import registry
from detent_audit.verifier.report import Outcome

RECEIPT_SUFFIX, MANIFEST_SUFFIX = ".receipt", ".manifest"
BATCH = 64  # requests re-executed together
_SHAPE_KEYS = ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim",
               "intermediate_size", "num_experts", "moe_intermediate_size")
# bytes a worker's engine needs besides its weights (torch, KV pool, activations)
_ENGINE_OVERHEAD = 512 << 20


class Files(NamedTuple):
    """The files a run verifies (sorted), those found under folders (each with the folder given that holds
    it), and the paths that are BAD (unreadable, missing, a folder with neither kind of file)."""

    receipts: list[Path]
    manifests: list[Path]
    in_folders: dict[Path, Path]
    bad: list[Outcome]


def collect(paths: Iterable[str | Path]) -> Files:
    """Receipt and manifest files named or found under folders; nothing verified is not a pass, so an
    unreadable path, or a folder with neither, is BAD."""
    receipts: set[Path] = set()
    manifests: set[Path] = set()
    in_folders: dict[Path, Path] = {}
    bad: list[Outcome] = []
    for p in map(Path, paths):
        if p.is_dir():
            found_r: set[Path] = set()
            found_m: set[Path] = set()

            def unreadable(exc: OSError) -> None:  # a folder skipped in silence could hide a receipt
                bad.append(Outcome(str(exc.filename), "receipt", "BAD",
                                   f"{exc.filename}: cannot list this folder ({exc.strerror or exc})"))

            for folder, _, names in os.walk(p, onerror=unreadable):  # symlinked folders are not followed
                found_r |= {Path(folder, n) for n in names if _node_name(n).endswith(RECEIPT_SUFFIX)}
                found_m |= {Path(folder, n) for n in names if _node_name(n).endswith(MANIFEST_SUFFIX)}
            if not found_r and not found_m:
                bad.append(Outcome(str(p), "receipt", "BAD",
                                   f"{p}: no *{RECEIPT_SUFFIX} or *{MANIFEST_SUFFIX} files in this folder"))
            receipts |= found_r
            manifests |= found_m
            in_folders.update(dict.fromkeys(found_r | found_m, p))
        elif p.is_file():
            (manifests if Path(_node_name(p.name)).suffix == MANIFEST_SUFFIX else receipts).add(p)
        else:
            bad.append(Outcome(str(p), "receipt", "BAD", f"{p}: no such file or folder"))
    return Files(sorted(receipts), sorted(manifests), in_folders, bad)


def _node_name(name: str) -> str:
    """The name of the node's file a name stands for (an export's, `X.receipt.intoto.json`: `X.receipt`)."""
    return exported_name(name) or name


def sample_paths(paths: list[Path], fraction: float | None, seed: int) -> list[Path]:
    """A seeded sample of `fraction` of `paths` (at least one), sorted; all of them without a fraction."""
    if fraction is None or fraction >= 1:
        return paths
    k = max(1, math.ceil(fraction * len(paths))) if paths else 0
    return sorted(random.Random(seed).sample(paths, k))


def batches(groups: dict[Any, list[Path]], workers: int) -> list[list[Path]]:
    """The groups' receipts in batches of one group each, in group order; with workers, small enough that
    every worker gets one."""
    out = []
    for _, group in sorted(groups.items()):
        size = BATCH if workers == 1 else max(1, min(BATCH, math.ceil(len(group) / workers)))
        out += [group[start:start + size] for start in range(0, len(group), size)]
    return out


def auto_workers(num_receipts: int, facts: Iterable[Any], threads: int | None = None, *,
                 cores: int | None = None, available_memory: int | None = None) -> int:
    """Worker processes for `workers="auto"`: the cores over the receipts' thread count (`threads` where the
    verifier states its own), at most one per full batch of receipts, at most the engines that the available
    memory holds (when it is known); at least 1, and 1 for GPU receipts (their engines would share one
    device). `cores`/`available_memory` default to this machine's."""
    facts = list(facts)
    if any(_device(f) != "cpu" for f in facts):
        return 1
    per_engine = max([threads or _num_threads(f) for f in facts] or [1])
    if cores is None:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    limits = [cores // per_engine, num_receipts // BATCH]
    if available_memory is None:
        available_memory = _available_memory()
    if available_memory is not None and facts:
        limits.append(available_memory // max(engine_bytes(f) for f in facts))
    return max(1, min(limits))


def _device(facts: Any) -> Any:
    try:
        return facts["runtime"]["device"]
    except (KeyError, TypeError):
        return None


def _num_threads(facts: Any) -> int:
    try:
        return max(1, int(facts["runtime"]["num_threads"]))
    except (KeyError, TypeError, ValueError):
        return 1


def _kv_blocks(facts: Any) -> int:
    """KV pages the engine the facts name allocates by default (an engine not installed here: the registry's
    default)."""
    try:
        return registry.entry_for_facts(facts).kv_pool_blocks
    except DetentError:
        return registry.DEFAULT_KV_POOL_BLOCKS


def engine_bytes(facts: Any) -> int:
    """An engine's memory for these facts: its weights and its default KV pool (from the model's shape, the
    page size and the dtype) and the overhead."""
    try:
        m = facts["deployment"]["model"]
        layers, hd = m["num_layers"], m["head_dim"]
        params = decoder_parameters(**{k: m[k] for k in _SHAPE_KEYS})
        width = DTYPE_BYTES.get(facts["runtime"]["dtype"], 4)
        kv_pool = _kv_blocks(facts) * facts["scheduler"]["block_size"] * layers * 2 * m["num_kv_heads"] * hd
    except (KeyError, TypeError):
        return _ENGINE_OVERHEAD
    return (params + kv_pool) * width + _ENGINE_OVERHEAD


def _available_memory() -> int | None:
    """MemAvailable from /proc/meminfo (Linux), in bytes; None elsewhere."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def kv_tokens(r: Any, mode: str) -> int:
    """The most tokens re-executing receipt `r` holds in the KV cache: a rescore, its prompt and output; a
    replay, its prompt and the longer of its output and max_tokens (what the scheduler reserves). The engine
    caps it at its model's context."""
    prompt, output = len(r.request.prompt_token_ids), len(r.output.token_ids)
    return prompt + (output if mode == "rescore" else max(output, r.request.sampling.max_tokens))
