"""Determinism over the OpenAI API: every logprob a server returns for a request is the same float, bit for
bit, whether the request runs alone or in a burst of 8 beside others.

The requests (the model's own tokenizer counts them): short prompts, four prompts sharing a ~300-token prefix
(so a burst has prefix-cache hits next to misses) and one ~2,600-token document; greedy and seeded sampling,
top-5 logprobs, a fixed number of output tokens. (1) each request alone, one at a time: the reference; (2)
bursts of 8 concurrent requests, each burst a shuffled mix that holds the long document and shared-prefix
prompts; every response's tokens, logprobs and top-5 logprobs compared with the reference as fp32 bits. Exit
0 when every one is equal, 1 otherwise. The server is started here (`serve --engine E` with its default
flags) or given with --url.

    python benchmarks/api_determinism.py --engine embedded --out benchmarks/results/api-determinism
    python benchmarks/api_determinism.py --engine vllm --out benchmarks/results/api-determinism
    python benchmarks/api_determinism.py --engine embedded --mode stock --bursts 2 --out ...  # it can fail
    python benchmarks/api_determinism.py --url http://127.0.0.1:8000 --model-name NAME
"""

from __future__ import annotations

import argparse
import json
import os
import random
import socket
import struct
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx

CLI = [sys.executable, "-m", "detent_audit.cli"]
WORDS = ("the model reads each token and writes the next one while the server batches requests from many "
         "clients so that a prompt alone and a prompt among others could see different kernels unless every "
         "reduction keeps its order whatever the batch holds").split()


def _text(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words))


def requests(seed: int, max_tokens: int) -> list[dict[str, Any]]:
    """The request bodies (without `model`): 3 short prompts, 4 that share a long prefix, 1 long document."""
    rng = random.Random(seed)
    prefix = _text(rng, 300)
    prompts = [_text(rng, n) for n in (4, 25, 90)]
    prompts += [f"{prefix} {_text(rng, n)}" for n in (3, 10, 40, 120)]
    prompts.append(_text(rng, 2600))
    bodies = []
    for i, prompt in enumerate(prompts):
        sampled = i % 2 == 1
        bodies.append({"prompt": prompt, "max_tokens": max_tokens, "logprobs": 5, "ignore_eos": True,
                       "temperature": 0.8 if sampled else 0.0, "seed": 1000 + i})
    return bodies


def _bits(value: float) -> str:
    return struct.pack("<f", value).hex()


def answer(client: httpx.Client, url: str, model: str, body: dict[str, Any]) -> dict[str, Any]:
    """One completion's tokens, each token's logprob bits and its top-5 (token, bits), and the prompt's
    token count."""
    r = client.post(f"{url}/v1/completions", json={"model": model, **body}, timeout=1800)
    if r.status_code != 200:
        raise RuntimeError(f"HTTP {r.status_code}: {r.text[:500]}")
    doc = r.json()
    block = doc["choices"][0]["logprobs"]
    return {"tokens": block["tokens"], "logprobs": [_bits(v) for v in block["token_logprobs"]],
            "top": [sorted((t, _bits(v)) for t, v in top.items()) for top in block["top_logprobs"]],
            "prompt_tokens": doc["usage"]["prompt_tokens"]}


def check(url: str, model: str, bodies: list[dict[str, Any]], bursts: int, seed: int) -> dict[str, Any]:
    rng = random.Random(seed)
    with httpx.Client() as client:
        began = time.perf_counter()
        reference = [answer(client, url, model, b) for b in bodies]
        alone_s = time.perf_counter() - began
        long_doc, shared = len(bodies) - 1, [3, 4, 5, 6]
        mismatches, compared, burst_s = [], 0, []
        with ThreadPoolExecutor(8) as pool:
            for b in range(bursts):
                # each burst: the long document, two shared-prefix prompts, and five others drawn at random
                picks = [long_doc, *rng.sample(shared, 2)]
                picks += [rng.randrange(len(bodies)) for _ in range(8 - len(picks))]
                rng.shuffle(picks)
                began = time.perf_counter()
                got = list(pool.map(lambda i: answer(client, url, model, bodies[i]), picks))
                burst_s.append(time.perf_counter() - began)
                for i, g in zip(picks, got):
                    want = reference[i]
                    compared += len(want["logprobs"]) + sum(len(t) for t in want["top"])
                    for field in ("tokens", "logprobs", "top"):
                        if g[field] != want[field]:
                            at = next((k for k, (a, w) in enumerate(zip(g[field], want[field])) if a != w),
                                      min(len(g[field]), len(want[field])))
                            mismatches.append({"burst": b, "request": i, "field": field, "position": at})
    return {"requests": len(bodies), "bursts": bursts, "burst_size": 8,
            "prompt_tokens": [r["prompt_tokens"] for r in reference],
            "token_logprobs_compared": bursts * 8 * len(reference[0]["logprobs"]),
            "logprobs_compared": compared, "mismatches": mismatches, "equal": not mismatches,
            "alone_s": round(alone_s, 1), "burst_s": [round(s, 1) for s in burst_s]}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_server(engine: str, model: str | None, work: Path, log: Path,
                 mode: str | None = None) -> tuple[subprocess.Popen, str]:
    """`serve --engine ENGINE` with its default flags (a new key, receipts under `work`; `mode`: its --mode,
    None: the default); waits for /health."""
    subprocess.run([*CLI, "keygen", "--out", str(work / "node.key")], check=True, capture_output=True)
    port = _free_port()
    cmd = [*CLI, "serve", "--engine", engine, "--signing-key", str(work / "node.key"), "--manifest-out",
           str(work / "node"), "--port", str(port), *(["--model", model] if model else []),
           *(["--mode", mode] if mode else [])]
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT, env=env)
    url, deadline = f"http://127.0.0.1:{port}", time.monotonic() + 1200
    while True:
        try:
            if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"the {engine} server did not start (its log: {log})")
        time.sleep(2)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--engine", choices=("embedded", "vllm", "sglang"), help="start `serve --engine` here")
    ap.add_argument("--url", help="a running server instead (its base URL)")
    ap.add_argument("--model", help="--model of the server started here (default: serve's default)")
    ap.add_argument("--mode", help="--mode of the server started here (default: serve's, detent); stock "
                                   "shows what the check finds where the kernels read the batch")
    ap.add_argument("--model-name", help="the model name the requests name (default: the server's first)")
    ap.add_argument("--bursts", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=12)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, help="folder for <engine>.json and the server's log")
    args = ap.parse_args()
    if (args.engine is None) == (args.url is None):
        ap.error("give --engine or --url")
    out = args.out or Path(tempfile.mkdtemp(prefix="api-determinism-"))
    out.mkdir(parents=True, exist_ok=True)
    name = (args.engine or "url") + (f"-{args.mode}" if args.mode else "")
    proc = None
    with tempfile.TemporaryDirectory() as work:
        url = args.url
        if url is None:
            log = out / f"{name}-serve.log"
            proc, url = start_server(args.engine, args.model, Path(work), log, args.mode)
        try:
            model = args.model_name or httpx.get(f"{url}/v1/models", timeout=30).json()["data"][0]["id"]
            report = {"engine": name, "model": model,
                      **check(url, model, requests(args.seed, args.max_tokens), args.bursts, args.seed)}
        finally:
            if proc is not None:
                proc.terminate()
                proc.wait(120)
    (out / f"{name}.json").write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps({k: v for k, v in report.items() if k != "mismatches"}
                     | {"mismatches": len(report["mismatches"])}))
    return 0 if report["equal"] else 1


if __name__ == "__main__":
    sys.exit(main())
