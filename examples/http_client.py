"""Send every request of a prompts file to a running `detent-audit serve` over HTTP; write one line per answer
(id, receipt id, text), the format `show_answers.py` reads. Requests with `messages` go to
/v1/chat/completions, the others to /v1/completions; all are sent at once (the server batches them). With
$DETENT_API_KEY set (a server started with `serve --api-key`), each request carries it as its Bearer token.

Usage: python examples/http_client.py URL PROMPTS.jsonl OUTPUTS.jsonl [--wait SECONDS]
"""

from __future__ import annotations

import json
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import httpx

API_KEY = os.environ.get("DETENT_API_KEY")
HEADERS = {"Authorization": f"Bearer {API_KEY}"} if API_KEY else {}


def wait_until_up(url: str, seconds: float) -> str:
    """Poll /health until the server answers; returns the model name it serves."""
    deadline = time.monotonic() + seconds
    while True:
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return httpx.get(f"{url}/v1/models", headers=HEADERS, timeout=5).json()["data"][0]["id"]
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline:
            sys.exit(f"no server answered at {url} within {seconds:.0f} s")
        time.sleep(0.5)


def ask(url: str, model: str, request: dict) -> dict:
    body = {k: v for k, v in request.items() if k != "id"} | {"model": model}
    route = "/v1/chat/completions" if "messages" in request else "/v1/completions"
    r = httpx.post(f"{url}{route}", json=body, headers=HEADERS, timeout=600)
    if r.status_code != 200:
        sys.exit(f"{request['id']}: HTTP {r.status_code}: {r.text[:500]}")
    answer = r.json()
    choice = answer["choices"][0]
    text = choice["message"]["content"] if "message" in choice else choice["text"]
    return {"id": request["id"], "receipt_id": answer["receipt_id"], "text": text}


def main(url: str, prompts: str, outputs: str, wait: float) -> None:
    with open(prompts, encoding="utf-8") as f:
        requests = [json.loads(line) for line in f if line.strip()]
    model = wait_until_up(url.rstrip("/"), wait)
    with ThreadPoolExecutor(len(requests) or 1) as pool:
        answers = list(pool.map(lambda r: ask(url.rstrip("/"), model, r), requests))
    with open(outputs, "w", encoding="utf-8") as f:
        for answer in answers:
            f.write(json.dumps(answer) + "\n")
    print(f"{len(answers)} answers from {url}, each with a receipt")


if __name__ == "__main__":
    args = sys.argv[1:]
    wait = 300.0
    if "--wait" in args:
        i = args.index("--wait")
        wait = float(args[i + 1])
        del args[i:i + 2]
    if len(args) != 3:
        sys.exit(__doc__)
    main(*args, wait)
