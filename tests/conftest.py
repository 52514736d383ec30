"""Fixtures shared by every test folder: tiny seeded random checkpoints in temporary directories."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from pathlib import Path

import pytest

# the SelIR checker runs after every compiler pass in the tests (selection/compiler.py debug_enabled)
os.environ["DETENT_AUDIT_DEBUG"] = "1"

from detent_audit.engine.checkpoint import write_random_checkpoint  # noqa: E402
from detent_audit.runtime.model_config import ModelConfig  # noqa: E402


@pytest.fixture(scope="session")
def make_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """make_checkpoint(shape, seed=0, shards=1, **config_overrides) -> a checkpoint directory (cached)."""
    made: dict[tuple, Path] = {}

    def make(shape: str, seed: int = 0, shards: int = 1, **overrides: object) -> Path:
        key = (shape, seed, shards, tuple(sorted(overrides.items())))
        if key not in made:
            config = dataclasses.replace(ModelConfig.from_name(shape), **overrides)
            made[key] = write_random_checkpoint(tmp_path_factory.mktemp(shape), config, seed, shards=shards)
        return made[key]

    return make
