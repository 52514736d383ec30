"""Print each answer of `serve --input` beside its question and receipt id (what `make demo` shows).

Usage: python examples/show_answers.py PROMPTS.jsonl OUTPUTS.jsonl
"""

from __future__ import annotations

import json
import sys


def question(request: dict) -> str:
    if "messages" in request:
        return request["messages"][-1]["content"]
    return request.get("prompt", f"{len(request.get('prompt_token_ids', []))} token ids")


def main(prompts: str, outputs: str) -> None:
    with open(prompts, encoding="utf-8") as f:
        requests = {r["id"]: r for r in map(json.loads, filter(str.strip, f))}
    with open(outputs, encoding="utf-8") as f:
        for out in map(json.loads, filter(str.strip, f)):
            q = " ".join(question(requests[out["id"]]).split())
            a = " ".join(out["text"].split())
            print(f"{out['receipt_id']:<10}  {q}\n{'':<10}  -> {a}")


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    main(sys.argv[1], sys.argv[2])
