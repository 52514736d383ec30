"""The hashes deployment facts are made of, for every engine: a package's sources, a file, a checkpoint.

What a receipt's facts record (every engine alike): engine version and mode, source hashes of the kernels and
selection programs, the deployment the selection was solved for, checkpoint hashes (config, weights,
tokenizer: every file that shapes the prompt's tokens; weights: the tensors), the model's name and source
(descriptive: the hashes are its identity) and its EOS ids, dtype, device, torch version, the CPU thread count
(fixed at start: it changes BLAS bits), the tuple as the kernels read it. Weight hashes are cached by (path,
device, inode, size, mtime, ctime): a write with the mtime set back still changes the ctime (which no user
call can set), and a file replaced by another has another inode. Settings that change no bit (the prefill
chunk, which batch invariance makes irrelevant) are not facts: a receipt signs only what a verifier's bits can
confirm or what shapes selection. Each engine collects its own (the embedded one:
`detent_audit.engine.deployment_facts`).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from detent_audit.atomic import write_atomically
from detent_audit.cache_dir import cache_root

# the format of the facts a receipt carries (`format.facts`); 1, unnamed: before the CPU had its own record
# (`deployment.cpu`, where `deployment.gpu` described it with num_sms = threads and memory_gib = 1)
FACTS_FORMAT = 2


def format_facts() -> dict[str, int]:
    """The `format` section every engine's facts carry."""
    return {"facts": FACTS_FORMAT}


SOURCE_ROOTS = {"kernels": "detent_audit.kernels", "selection_programs": "detent_audit.selection.programs"}


def source_hash(package: str) -> str:
    """SHA-256 over the package's .py files (relative path and bytes), sorted."""
    import importlib

    folder = Path(str(importlib.import_module(package).__file__)).parent
    h = hashlib.sha256()
    for f in sorted(folder.rglob("*.py")):
        h.update(f.relative_to(folder).as_posix().encode() + b"\0" + f.read_bytes() + b"\0")
    return h.hexdigest()


def _stat_key(path: Path) -> str:
    st = path.stat()
    return f"{path.resolve()}|{st.st_dev}|{st.st_ino}|{st.st_size}|{st.st_mtime_ns}|{st.st_ctime_ns}"


def file_hash(path: Path, cache: dict | None = None) -> str:
    key = _stat_key(path)
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


# every file of a checkpoint folder that shapes a prompt's tokens or what its sampling defaults to, where the
# embedded engine, transformers, vLLM or SGLang read one: the tokenizer, its configuration and special tokens,
# the chat template (alone or among named ones), the generation config
PROMPT_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                "vocab.json", "merges.txt", "tokenizer.model", "chat_template.jinja", "chat_template.json",
                "generation_config.json")
PROMPT_FOLDERS = ("additional_chat_templates",)


def prompt_files(path: Path) -> list[Path]:
    """The files of `path` that shape the prompt's tokens (`PROMPT_FILES`, and those in `PROMPT_FOLDERS`)."""
    found = [path / name for name in PROMPT_FILES if (path / name).is_file()]
    for folder in (path / name for name in PROMPT_FOLDERS):
        found += sorted(f for f in folder.rglob("*") if f.is_file()) if folder.is_dir() else []
    return found


def checkpoint_hashes(path: Path) -> dict[str, Any]:
    """A checkpoint folder's identity: config.json's SHA-256; `tokenizer`: the SHA-256 of every file that
    shapes the prompt's tokens, by its path in the folder; `weights`: the tensors' names, dtypes, shapes and
    data in name order, whatever file holds them (`tensor_files.weights_hash`; cached per file by stat)."""
    from detent_audit.runtime.tensor_files import WEIGHTS_FORM, tensor_lines, weights_hash

    with hash_cache(_hash_cache_file()) as cache:
        lines: list[str] = []
        for f in sorted(path.glob("*.safetensors")):
            key = f"{WEIGHTS_FORM}|{_stat_key(f)}"
            cached = cache.get(key)
            if not (isinstance(cached, list) and all(isinstance(line, str) for line in cached)):
                cache[key] = tensor_lines(f)
            lines += cache[key]
    return {"config": file_hash(path / "config.json"),
            "tokenizer": {f.relative_to(path).as_posix(): file_hash(f) for f in prompt_files(path)},
            "weights": weights_hash(lines)}
