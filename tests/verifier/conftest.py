"""The verifier tests' signing node: the tiny seeded Llama in detent mode behind a `ServingNode`, in a folder
of its own with a fresh key."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import pytest

from detent_audit.engine.llm import LLM, EngineConfig
from detent_audit.manifests.keys import GeneratedKey, generate_key, load_private_key
from detent_audit.server.node import ServingNode


class Node(NamedTuple):
    root: Path          # node.key, jit/ (the JIT cache), out/ (receipts/, manifests/)
    ckpt: Path
    key: GeneratedKey
    llm: LLM
    node: ServingNode


@pytest.fixture(scope="module")
def new_node(make_checkpoint: Callable[..., Path],
             tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Node]:
    """`new_node(name, **node_options)`: a node in a new folder named after `name`."""
    def make(name: str, **node_options: Any) -> Node:
        root = tmp_path_factory.mktemp(name)
        ckpt = make_checkpoint("tiny-llama")
        key = generate_key(root / "node.key")
        llm = LLM(EngineConfig(model=str(ckpt), mode="detent", cache_dir=str(root / "jit")))
        return Node(root, ckpt, key, llm, ServingNode(llm, load_private_key(key.private_path), root / "out",
                                                      **node_options))
    return make
