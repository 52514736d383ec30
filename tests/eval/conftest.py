"""Fixtures for the evaluation audit: the served checkpoint, a node key, a live server, lm-eval runs on it.

The checkpoint is the tiny seeded Llama of the shared fixture (a byte-level tokenizer and a chat template, as
lm-eval's tokenizer and the server's template need): its answers are random, which is what these tests want
(a score whose every sample must be accounted for). `eval_checkpoint` is the one place to switch to the
project's real model once its importer ships.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from eval_helpers import run_lm_eval, serving

from detent_audit.manifests.keys import GeneratedKey, generate_key

pytest.importorskip("lm_eval")


@pytest.fixture(scope="session")
def eval_checkpoint(make_checkpoint: Callable[..., Path]) -> Path:
    return make_checkpoint("tiny-llama")


@pytest.fixture(scope="session")
def node_key(tmp_path_factory: pytest.TempPathFactory) -> GeneratedKey:
    return generate_key(tmp_path_factory.mktemp("eval-key") / "node.key")


@pytest.fixture(scope="session")
def served_run(eval_checkpoint: Path, node_key: GeneratedKey, tmp_path_factory: pytest.TempPathFactory) -> Any:
    """One detent server; lm-eval runs both shipped tasks through /v1/completions and the generate task through
    /v1/chat/completions. Returns (served, completions run folder, chat run folder)."""
    root = tmp_path_factory.mktemp("eval-run")
    with serving(eval_checkpoint, node_key, root / "node", root / "jit") as served:
        completions = run_lm_eval(served, root / "lm-eval", "detent_qa_mc,detent_qa_gen")
        chat = run_lm_eval(served, root / "lm-eval-chat", "detent_qa_gen", chat=True, batch_size=1)
    return served, completions, chat
