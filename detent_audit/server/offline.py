"""`detent-audit serve --input prompts.jsonl`: serve a file of requests, sign a receipt for each.

Input lines: `{"id"?, "prompt": str | "prompt_token_ids": [int] | "messages": [{role, content}], "max_tokens"?,
"temperature"?, "top_p"?, "top_k"?, "seed"?, "logprobs"?, "stop_token_ids"?, "ignore_eos"?}`. Output lines (one
per request, in input order, written after its receipt is on disk): `{"id", "text", "token_ids", "logprobs",
"finish_reason", "receipt_id", "receipt"}`. A bad line stops the run before any request is served.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from detent_audit.engine.llm import LLM
from detent_audit.engine.sampling_params import SamplingParams
from detent_audit.errors import BadInput
from detent_audit.server.node import ServingNode

_SAMPLING = ("max_tokens", "temperature", "top_p", "top_k", "seed", "logprobs", "stop_token_ids", "ignore_eos")
_PROMPT = ("prompt", "prompt_token_ids", "messages")


def read_requests(llm: LLM, path: Path) -> list[tuple[str, list[int], SamplingParams]]:
    """Parse and validate every line first: (id, prompt token ids, sampling parameters)."""
    out = []
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError as exc:
        raise BadInput(f"{path}: cannot read ({exc.strerror})") from None
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"{path.name}:{n}"
        try:
            obj = json.loads(line)
        except ValueError as exc:
            raise BadInput(f"{where}: not JSON ({exc})") from None
        if not isinstance(obj, dict):
            raise BadInput(f"{where}: each line is a JSON object")
        unknown = sorted(set(obj) - set(_SAMPLING) - set(_PROMPT) - {"id"})
        given = [k for k in _PROMPT if k in obj]
        if unknown or len(given) != 1:
            raise BadInput(f"{where}: " + (f"unknown fields {unknown}" if unknown else
                                           "give exactly one of prompt, prompt_token_ids, messages"))
        if "prompt" in obj:
            ids = llm.tokenizer.encode(str(obj["prompt"]))
        elif "messages" in obj:
            ids = llm.tokenizer.encode_chat(obj["messages"])
        else:
            ids = obj["prompt_token_ids"]
        try:
            kwargs: dict[str, Any] = {k: obj[k] for k in _SAMPLING if k in obj}
            if "stop_token_ids" in kwargs:
                kwargs["stop_token_ids"] = tuple(kwargs["stop_token_ids"])
            params = SamplingParams(**{"temperature": 0.0, **kwargs})
        except (BadInput, TypeError) as exc:
            raise BadInput(f"{where}: {exc}") from None
        out.append((str(obj.get("id", f"req-{n}")), ids, params))
    ids_seen = [r[0] for r in out]
    if len(set(ids_seen)) != len(ids_seen):
        raise BadInput(f"{path.name}: request ids repeat", remedy="give each line a unique id")
    return out


def serve_offline(llm: LLM, node: ServingNode, input_path: str | Path, output_path: str | Path,
                  progress: Callable[[int, int], None] | None = None, max_in_flight: int | None = None) -> int:
    """Serve every request of `input_path`, sign each, append results in input order.

    All requests are submitted at once, or, with `max_in_flight`, as a closed loop of that many clients (a new
    request joins when one finishes), as an online server under that concurrency would see them."""
    requests = read_requests(llm, Path(input_path))
    limit = max_in_flight or len(requests)
    seqs = [llm.add_request(ids, params, rid) for rid, ids, params in requests[:limit]]
    finished: dict[int, Any] = {}
    next_to_write = 0
    with open(output_path, "a", encoding="utf-8") as out:
        while next_to_write < len(requests):
            for seq in llm.step() if llm.has_unfinished() else []:
                finished[seq.seq_id] = seq
                if len(seqs) < len(requests):
                    rid, ids, params = requests[len(seqs)]
                    seqs.append(llm.add_request(ids, params, rid))
            while next_to_write < len(seqs) and seqs[next_to_write].seq_id in finished:
                rid, _, params = requests[next_to_write]
                output = llm.output_of(finished.pop(seqs[next_to_write].seq_id))
                signed = node.sign(output, params, rid)  # durable before the answer is written
                out.write(json.dumps({"id": rid, "text": output.text, "token_ids": output.token_ids,
                                      "logprobs": output.logprobs, "finish_reason": output.finish_reason,
                                      "receipt_id": signed.receipt_id, "receipt": str(signed.path)}) + "\n")
                out.flush()
                os.fsync(out.fileno())
                next_to_write += 1
                if progress:
                    progress(next_to_write, len(seqs))
    return len(seqs)
