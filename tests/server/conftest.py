"""Fixtures for the HTTP server tests: a tiny checkpoint, a node key, and live servers on 127.0.0.1."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from threaded_server import threaded_server

from detent_audit.engine.llm import LLM, EngineConfig
from detent_audit.manifests.keys import GeneratedKey, generate_key, load_private_key, load_trusted_keys
from detent_audit.runtime.tuples import save_tuple
from detent_audit.server.app import create_app
from detent_audit.server.async_engine import AsyncEngine
from detent_audit.server.node import ServingNode

MODEL_NAME = "tiny-llama"


@dataclass
class Env:
    """What every server test shares: the checkpoint, the key pair, the JIT cache, the committed tuple."""

    checkpoint: Path
    key: GeneratedKey
    cache_dir: Path
    tuple_file: Path

    def engine_config(self, **overrides: Any) -> EngineConfig:
        """The tests' context is 2048 tokens (of the checkpoint's 4096), unless overridden."""
        return EngineConfig(model=str(self.checkpoint), mode="detent", cache_dir=str(self.cache_dir),
                            **{"max_model_len": 2048, **overrides})

    @property
    def trusted(self) -> dict:
        return load_trusted_keys(self.key.public_path)


@dataclass
class Live:
    """A server running in this process: its URL, engine, node and output folder."""

    url: str
    llm: LLM
    engine: AsyncEngine
    node: ServingNode
    out: Path


@pytest.fixture(scope="session")
def env(make_checkpoint: Callable[..., Path], tmp_path_factory: pytest.TempPathFactory) -> Env:
    root = tmp_path_factory.mktemp("server-env")
    checkpoint = make_checkpoint("tiny-llama")
    cache_dir = root / "jit"
    llm = LLM(EngineConfig(model=str(checkpoint), mode="detent", cache_dir=str(cache_dir),
                           max_model_len=2048))
    tuple_file = root / "tuple.msgpack"
    save_tuple(llm.selection.tuple, tuple_file)
    return Env(checkpoint, generate_key(root / "node.key"), cache_dir, tuple_file)


@contextmanager
def live_server(env: Env, out: Path, *, max_queued: int = 256, **engine_overrides: Any) -> Iterator[Live]:
    """uvicorn in a thread on a free port; on exit the server shuts down (the node writes its run
    manifest)."""
    llm = LLM(env.engine_config(**engine_overrides))
    node = ServingNode(llm, load_private_key(env.key.private_path), out)
    engine = AsyncEngine(llm, max_queued=max_queued)
    try:
        with threaded_server(create_app(engine, node, MODEL_NAME)) as url:
            yield Live(url, llm, engine, node, out)
    finally:
        engine.shutdown(drain=False)


@pytest.fixture(scope="session")
def model_name() -> str:
    return MODEL_NAME


@pytest.fixture
def serve_live(env: Env) -> Callable[..., Any]:
    """serve_live(out, max_queued=256, **engine_overrides): a context manager yielding a `Live` server."""
    return lambda out, **kw: live_server(env, out, **kw)


@pytest.fixture
def live(env: Env, tmp_path: Path) -> Iterator[Live]:
    with live_server(env, tmp_path / "out") as server:
        yield server


@pytest.fixture
def start_server(env: Env) -> Callable[..., Any]:
    """`with start_server(out, **engine_overrides) as live:` a live server of its own (e.g. another
    context)."""
    return lambda out, **overrides: live_server(env, out, **overrides)
