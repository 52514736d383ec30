"""`detent-audit serve --input prompts.jsonl`: serve a file of requests, sign a receipt for each.

Input lines: `{"id"?, "prompt": str | "prompt_token_ids": [int] | "messages": [{role, content}],
"max_tokens"?, "temperature"?, "top_p"?, "top_k"?, "seed"?, "logprobs"?, "stop_token_ids"?, "stop"? (strings,
as the HTTP server takes them), "ignore_eos"?}`. Output lines (one
per request, in input order, written after its receipt is on disk): `{"id", "text", "token_ids", "logprobs",
"top_logprobs" (with "logprobs": n), "finish_reason", "seed", "receipt_id", "receipt"}` (a sampled line
without a seed gets one derived from the run and the line, manifests/seeds.py, recorded in its receipt). A
bad line, or an id that has a receipt in the folder already, stops the run before any request is served.

A receipt binds the line with its id (a line without one is bound with the id it got, `req-<line>`): the HTTP
endpoints refuse a body with an `id`, so no body is both a line and an HTTP request, and a node cannot sign
a client's HTTP body as a line (read with a line's defaults: greedy, 16 tokens).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from detent_audit.errors import BadInput
from detent_audit.manifests.receipt import MAX_STOP_TOKENS, ClientRequest
from detent_audit.runtime.contract import Engine, RequestHandle
from detent_audit.runtime.sampling_params import SamplingParams, seed_for
from detent_audit.server.node import RECEIPT_ID, ServingNode
from detent_audit.server.protocol import Limits, check_text, check_token_ids, parse_messages, unique_keys

_SAMPLING = ("max_tokens", "temperature", "top_p", "top_k", "seed", "logprobs", "stop_token_ids",
             "ignore_eos", "stop")
_PROMPT = ("prompt", "prompt_token_ids", "messages")


API = "detent/v1/offline-jsonl"


def read_requests(llm: Engine, path: Path) -> list[tuple[str, list[int], SamplingParams, ClientRequest]]:
    """Parse and validate every line first: (id, prompt token ids, sampling parameters, the line as the
    client binding). The checks are the HTTP server's (token ids in the vocabulary, the messages' schema, room
    for max_tokens in the context); an id must name a file (`RECEIPT_ID`), since the receipt is stored under
    it."""
    out = []
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise BadInput(f"{path}: cannot read ({getattr(exc, 'strerror', None) or exc})") from None
    max_len = llm.max_model_len
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"{path.name}:{n}"
        try:
            obj = json.loads(line, object_pairs_hook=unique_keys)
        except (ValueError, RecursionError) as exc:
            raise BadInput(f"{where}: not JSON ({exc})") from None
        rid, ids, params = parse_line(obj, f"req-{n}", llm.tokenizer, max_len, llm.vocab_size,
                                      where)
        try:  # bound with its id (the one given, or the one it got), which no HTTP body may hold
            client = ClientRequest.of(API, obj if "id" in obj else {**obj, "id": rid})
        except BadInput as exc:
            raise BadInput(f"{where}: {exc.message}") from None
        out.append((rid, ids, params, client))
    ids_seen = [r[0] for r in out]
    if len(set(ids_seen)) != len(ids_seen):
        raise BadInput(f"{path.name}: request ids repeat", remedy="give each line a unique id")
    return out


def parse_line(obj: Any, default_id: str, tokenizer: Any, max_len: int, vocab_size: int, where: str
               ) -> tuple[str, list[int], SamplingParams]:
    """One input line's (id, prompt token ids, sampling parameters); raises `BadInput` naming `where`. A
    verifier parses a receipt's bound line with this too."""
    limits = Limits("", max_len, vocab_size)
    if not isinstance(obj, dict):
        raise BadInput(f"{where}: each line is a JSON object")
    unknown = sorted(set(obj) - set(_SAMPLING) - set(_PROMPT) - {"id"})
    given = [k for k in _PROMPT if k in obj]
    if unknown or len(given) != 1:
        raise BadInput(f"{where}: " + (f"unknown fields {unknown}" if unknown else
                                       "give exactly one of prompt, prompt_token_ids, messages"))
    rid = obj.get("id", default_id)
    if isinstance(rid, bool) or not isinstance(rid, (str, int)) or not RECEIPT_ID.fullmatch(str(rid)):
        raise BadInput(f"{where}: id {rid!r} cannot name a receipt file",
                       remedy="use 1-128 letters, digits, '.', '_' or '-', starting with a letter or digit")
    try:
        if "prompt" in obj:
            if not isinstance(obj["prompt"], str):
                raise BadInput("'prompt' must be a string (token ids go in 'prompt_token_ids')")
            ids = tokenizer.encode(check_text(obj["prompt"], "prompt"))
        elif "messages" in obj:
            ids = tokenizer.encode_chat(parse_messages(obj["messages"]))
        else:
            ids = list(check_token_ids(obj["prompt_token_ids"], "prompt_token_ids", limits))
        if not ids:
            raise BadInput("the prompt is empty (it encodes to no tokens)")
        kwargs: dict[str, Any] = {k: obj[k] for k in _SAMPLING if k in obj}
        if "stop_token_ids" in kwargs:
            kwargs["stop_token_ids"] = tuple(check_token_ids(kwargs["stop_token_ids"], "stop_token_ids",
                                                               limits, MAX_STOP_TOKENS))
        if isinstance(kwargs.get("stop"), str):
            kwargs["stop"] = [kwargs["stop"]]
        kwargs = {"temperature": 0.0, **kwargs}
        kwargs["seed"] = seed_for(kwargs["temperature"], kwargs.get("seed"))
        params = SamplingParams(**kwargs)
    except (BadInput, TypeError) as exc:
        raise BadInput(f"{where}: {getattr(exc, 'message', exc)}") from None
    if len(ids) + params.max_tokens > max_len:
        raise BadInput(f"{where}: the prompt has {len(ids)} tokens and max_tokens is {params.max_tokens}, "
                       f"beyond the model's context of {max_len} tokens",
                       remedy=f"lower max_tokens to at most {max_len - len(ids)}" if len(ids) < max_len
                       else f"shorten the prompt to under {max_len} tokens")
    return str(rid), list(ids), params


def serve_offline(llm: Engine, node: ServingNode, input_path: str | Path, output_path: str | Path,
                  progress: Callable[[int, int], None] | None = None,
                  max_in_flight: int | None = None) -> int:
    """Serve every request of `input_path`, sign each, append results in input order.

    All requests are submitted at once, or, with `max_in_flight`, as a closed loop of that many clients (a new
    request joins when one finishes), as an online server under that concurrency would see them."""
    requests = [(rid, ids, node.seeded(params, client), client)
                for rid, ids, params, client in read_requests(llm, Path(input_path))]
    taken = [rid for rid, _, _, _ in requests if node.receipt_path(rid).exists()]
    if taken:
        raise BadInput(f"{len(taken)} request id(s) already have a receipt in {node.out}: "
                       f"{', '.join(taken[:3])}{', ...' if len(taken) > 3 else ''}",
                       remedy="serve into a new --manifest-out folder, or give the requests other ids")
    try:
        out = open(output_path, "a", encoding="utf-8")  # closed by the with below, on every path
    except OSError as exc:
        raise BadInput(f"{output_path}: cannot write ({exc.strerror})") from None
    limit = max_in_flight or len(requests)
    seqs = [llm.add_request(ids, params, rid) for rid, ids, params, _ in requests[:limit]]
    finished: dict[int, RequestHandle] = {}
    next_to_write = 0
    with out:
        while next_to_write < len(requests):
            for seq in llm.step() if llm.has_unfinished() else []:
                finished[seq.seq_id] = seq
                if len(seqs) < len(requests):
                    rid, ids, params, _ = requests[len(seqs)]
                    seqs.append(llm.add_request(ids, params, rid))
            while next_to_write < len(seqs) and seqs[next_to_write].seq_id in finished:
                rid, _, params, client = requests[next_to_write]
                output = llm.output_of(finished.pop(seqs[next_to_write].seq_id))
                signed = node.sign(output, params, rid, client)  # durable before the answer is written
                line: dict[str, object] = {"id": rid, "text": output.text, "token_ids": output.token_ids,
                                           "logprobs": output.logprobs}
                if params.logprobs:  # the top-n alternatives at each position, as [token id, logprob] pairs
                    line["top_logprobs"] = [[list(pair) for pair in top] for top in output.top_logprobs]
                line.update(finish_reason=output.finish_reason, seed=params.seed,
                            receipt_id=signed.receipt_id, receipt=str(signed.path),
                            receipt_digest=signed.receipt.digest)
                out.write(json.dumps(line) + "\n")
                out.flush()
                os.fsync(out.fileno())
                next_to_write += 1
                if progress:
                    progress(next_to_write, len(seqs))
    return len(seqs)
