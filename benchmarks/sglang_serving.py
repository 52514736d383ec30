"""`serve --engine sglang` over HTTP on this CPU: streamed tokens and the served context.

The detent SGLang engine (SmolLM2-135M-Instruct, `--max-model-len 4096`) behind the server in this process:
(1) streamed completions of 100 tokens (`ignore_eos`): the time to the first token's chunk (TTFT), to the
last, and the chunks with tokens; (2) a prompt of 3,000 token ids (beyond the 2,048 SGLang's selection was
once solved for) answered. Prints one JSON document.

    python benchmarks/sglang_serving.py --out benchmarks/results/sglang-serving/run.json
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx

MODEL = "smollm2-135m-instruct"


@contextmanager
def served(max_model_len: int, out: Path):
    """The detent SGLang engine at `max_model_len` behind the HTTP server (uvicorn in a thread): its URL."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from threaded_server import threaded_server

    from detent_audit.integrations.sglang.engine import SglangConfig, SglangEngine
    from detent_audit.manifests.keys import generate_key, load_private_key
    from detent_audit.server.app import create_app
    from detent_audit.server.async_engine import AsyncEngine
    from detent_audit.server.node import ServingNode

    began = time.monotonic()
    llm = SglangEngine(SglangConfig(model=MODEL, mode="detent", max_model_len=max_model_len))
    start_s = time.monotonic() - began
    try:
        key = generate_key(out / "node.key")
        node = ServingNode(llm, load_private_key(key.private_path), out / "receipts")
        with threaded_server(create_app(AsyncEngine(llm), node, MODEL), start_timeout=120) as url:
            yield url, start_s
    finally:
        llm.shutdown()


def streamed(url: str, prompt: str, max_tokens: int) -> dict[str, Any]:
    """One streamed completion: seconds to the first chunk holding text, to the end; chunks holding text."""
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
            "ignore_eos": True, "stream": True, "logprobs": 1}
    began = time.monotonic()
    first, chunks, tokens = None, 0, 0
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=600) as reply:
        reply.raise_for_status()
        for line in reply.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            choice = (json.loads(line[6:]).get("choices") or [{}])[0]
            n = len((choice.get("logprobs") or {}).get("tokens") or [])
            if n:
                chunks, tokens = chunks + 1, tokens + n
                first = time.monotonic() - began if first is None else first
    return {"ttft_s": round(first or 0.0, 3), "total_s": round(time.monotonic() - began, 3),
            "chunks_with_tokens": chunks, "tokens": tokens}


def long_prompt(url: str, length: int, seed: int) -> dict[str, Any]:
    """A prompt of `length` random token ids, 4 tokens out: the status, the prompt tokens counted, the
    time."""
    rng = random.Random(seed)
    ids = [rng.randrange(100, 40000) for _ in range(length)]
    began = time.monotonic()
    reply = httpx.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": ids, "max_tokens": 4,
                                                       "temperature": 0.0}, timeout=900)
    body = reply.json()
    return {"status": reply.status_code, "prompt_tokens": (body.get("usage") or {}).get("prompt_tokens"),
            "seconds": round(time.monotonic() - began, 2)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--long-prompt", type=int, default=3000)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    doc: dict[str, Any] = {"model": MODEL, "max_model_len": args.max_model_len, "cpus": os.cpu_count(),
                           "load_average_at_start": os.getloadavg()}
    with tempfile.TemporaryDirectory() as tmp, served(args.max_model_len, Path(tmp)) as (url, start_s):
        doc["start_s"] = round(start_s, 1)
        prompt = "Write a long story about a lighthouse keeper and the sea."
        doc["streamed_100_tokens"] = [streamed(url, prompt, 100) for _ in range(args.repeats)]
        print(json.dumps(doc["streamed_100_tokens"]), flush=True)
        doc["long_prompt"] = long_prompt(url, args.long_prompt, seed=31)
    text = json.dumps(doc, indent=1)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
