"""The evaluation tests' helpers: a live server of `detent-audit serve`'s app, and lm-eval's command line on it."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from threaded_server import threaded_server

from detent_audit.engine.llm import LLM, EngineConfig
from detent_audit.manifests.keys import GeneratedKey, load_private_key, load_trusted_keys
from detent_audit.server.app import create_app
from detent_audit.server.async_engine import AsyncEngine
from detent_audit.server.node import ServingNode

MODEL_NAME = "smollm2-135m-instruct"
TASKS = Path(__file__).resolve().parents[2] / "examples" / "eval"


@dataclass
class Served:
    url: str
    out: Path          # receipts/ and manifests/
    checkpoint: Path
    key: GeneratedKey
    node: ServingNode

    @property
    def trusted(self) -> dict:
        return load_trusted_keys(self.key.public_path)


@contextmanager
def serving(checkpoint: Path, key: GeneratedKey, out: Path, cache_dir: Path, mode: str = "detent") -> Iterator[Served]:
    """`detent-audit serve`'s app on 127.0.0.1 in a thread; on exit it shuts down and writes its run manifest."""
    llm = LLM(EngineConfig(model=str(checkpoint), mode=mode, cache_dir=str(cache_dir)))
    node = ServingNode(llm, load_private_key(key.private_path), out)
    engine = AsyncEngine(llm)
    try:
        with threaded_server(create_app(engine, node, MODEL_NAME), start_timeout=60) as url:
            yield Served(url, out, checkpoint, key, node)
    finally:
        engine.shutdown(drain=False)


def run_lm_eval(served: Served, out: Path, tasks: str, *, limit: int = 6, chat: bool = False, batch_size: int = 4,
                concurrent: int = 1) -> Path:
    """lm-eval's own command line against the server, with --log_samples; returns its output folder."""
    if chat:
        model, args = "local-chat-completions", f"base_url={served.url}/v1/chat/completions"
    else:
        model, args = "local-completions", (f"base_url={served.url}/v1/completions,tokenizer={served.checkpoint},"
                                            "tokenizer_backend=huggingface")
    cmd = [sys.executable, "-m", "lm_eval", "--model", model,
           "--model_args", f"model={MODEL_NAME},{args},num_concurrent={concurrent},max_retries=1",
           "--include_path", str(TASKS), "--tasks", tasks, "--limit", str(limit), "--batch_size", str(batch_size),
           "--output_path", str(out), "--log_samples"] + (["--apply_chat_template"] if chat else [])
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    if done.returncode != 0:
        raise AssertionError(f"lm-eval failed ({done.returncode}):\n{done.stderr[-4000:]}")
    return out
