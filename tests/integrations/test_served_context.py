"""The context an engine serves without `--max-model-len`: the model's own (its max_position_embeddings) on
every engine, one rule (`served_context`), reported the same on /v1/models, in the facts and in the limits a
request meets. vLLM and SGLang build their own engine (slow tier); the embedded one runs in CI."""

from __future__ import annotations

import random
from pathlib import Path

import httpx
import pytest
from threaded_server import threaded_server

from detent_audit.enums import Mode
from detent_audit.manifests.keys import generate_key, load_private_key
from detent_audit.runtime import registry
from detent_audit.runtime.model_config import ModelConfig, served_context
from detent_audit.runtime.named_models import resolve_model
from detent_audit.server.app import create_app
from detent_audit.server.async_engine import AsyncEngine
from detent_audit.server.node import ServingNode

MODEL = "smollm2-135m-instruct"  # 8192 positions: above the hosted engines' former 2048


def test_the_rule_is_the_asked_context_within_the_models_else_the_models_within_the_pool() -> None:
    rng = random.Random()
    for _ in range(200):
        positions, pool, asked = rng.randint(2, 1 << 17), rng.randint(1, 1 << 17), rng.randint(2, 1 << 17)
        assert served_context(asked, positions, pool) == min(asked, positions)
        assert served_context(None, positions, pool) == max(2, min(positions, pool))
        assert served_context(None, positions) == positions


@pytest.mark.parametrize("engine_name", ["embedded", pytest.param("vllm", marks=pytest.mark.slow),
                                         pytest.param("sglang", marks=pytest.mark.slow)])
def test_every_engine_serves_the_models_own_context_by_default(engine_name: str, tmp_path: Path) -> None:
    missing = registry.entry(engine_name).missing()
    if missing is not None:
        pytest.skip(missing.message)
    positions = ModelConfig.from_pretrained(resolve_model(MODEL).path).max_position_embeddings
    assert positions == 8192
    engine = registry.build(engine_name, registry.EngineOptions(model=MODEL, mode=Mode.DETENT,
                                                                cache_dir=str(tmp_path / "jit")))
    key = generate_key(tmp_path / "node.key")
    node = ServingNode(engine, load_private_key(key.private_path), tmp_path / "out")
    async_engine = AsyncEngine(engine)
    try:
        assert engine.max_model_len == positions
        with threaded_server(create_app(async_engine, node, "m")) as url:
            listed = httpx.get(f"{url}/v1/models", timeout=30).json()["data"][0]
            too_long = httpx.post(f"{url}/v1/completions", timeout=60,
                                  json={"model": "m", "prompt": [5] * positions, "max_tokens": 1})
        assert listed["max_model_len"] == positions
        assert too_long.status_code == 400 and f"maximum context length is {positions}" in too_long.text
    finally:
        async_engine.shutdown(drain=False)
        node.close()
        stop = getattr(engine, "shutdown", None)
        if callable(stop):
            stop()
