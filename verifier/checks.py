"""Steps (7)-(9) of verification where no re-execution is needed: what a receipt's content refutes against the
rebuilt deployment. (7) the tuple it commits to is its facts' own; (8) its output: ids within the vocabulary,
the finish the scheduler's rule gives; (9) its request: the client's bound body, reparsed by the node's own
parser, is the request the engine ran, and the text returned is the output tokens' text."""

from __future__ import annotations

from collections.abc import Callable

from detent_audit.errors import DetentError
from detent_audit.manifests import encoding as enc
from detent_audit.manifests.encoding import facts_hash
from detent_audit.manifests.receipt import Receipt
from detent_audit.runtime.contract import Engine
from detent_audit.runtime.finish import FinishCause, finish_cause
from detent_audit.runtime.stop_strings import check_stop, output_text
from detent_audit.verifier.steps import DeploymentError, OutputError, RequestError, VerificationError


def refutation(r: Receipt, llm: Engine, eos: set[int], max_prompt_chars: int) -> VerificationError | None:
    """The first of steps (7)-(9) that `r` fails on the engine `llm` of its deployment, or None."""
    rid = r.request.request_id
    problem = _tuple_problem(r)
    if problem is not None:
        return DeploymentError(problem, request_id=rid)
    problem = (_vocabulary_problem(r, llm.vocab_size)
               or _finish_problem(r, eos, llm.max_model_len, llm.tokenizer.decode))
    if problem is not None:
        return OutputError(problem, request_id=rid)
    problem = _binding_problem(r, llm, max_prompt_chars)
    return None if problem is None else RequestError(problem, request_id=rid)


def _finish_problem(r: Receipt, eos: set[int], max_model_len: int,
                    decode: Callable | None = None) -> str | None:
    """The stated finish must be the one generation reaches (the scheduler's rule, runtime/finish.py): no
    stop token before the end, and no earlier token whose text completed a stop string (recomputed with the
    deployment's tokenizer, `decode`); 'stop' exactly when the last token is a stop token or completes a stop
    string (a stop wins over a length limit); else 'length', at max_tokens or where prompt and output fill the
    context."""
    s, tokens, reason = r.request.sampling, list(r.output.token_ids), r.output.finish_reason
    prompt = len(r.request.prompt_token_ids)
    for i, t in enumerate(tokens[:-1]):
        early = finish_cause(t, i + 1, prompt + i + 1, s, eos, max_model_len)
        if early is not None:
            return f"output token {i} ({t}) finishes generation ({early.value}), yet generation went on"
    if not tokens:
        if s.max_tokens == 0 and r.scoring is not None and reason == "length":
            return None  # echo only: the prompt scored, nothing drawn
        return "an empty output: the engine draws at least one token for every request it admits"
    if r.scoring is None and s.max_tokens == 0:
        return "max_tokens 0 in a receipt that scores no prompt"
    stopped_by_text = False
    if s.stop:
        if decode is None:
            return "the receipt has stop strings, and no tokenizer was given to check them"
        stopped_by_text, problem = check_stop(decode, tokens, s.stop)
        if problem is not None:
            return problem
    total = prompt + len(tokens)
    cause = finish_cause(tokens[-1], len(tokens), total, s, eos, max_model_len, stop_string=stopped_by_text)
    if cause is not None and cause.reason == "stop" and reason != "stop":
        what = f"{cause.value} ({tokens[-1]})" if cause is not FinishCause.STOP_STRING else cause.value
        return f"the output ends on {what}, so it finished with 'stop', not {reason!r}"
    if reason == "stop" and (cause is None or cause.reason != "stop"):
        also = ", and the output text contains none of the stop strings (the node cut it early)"
        return "finish 'stop' without a stop token at the end" + (also if s.stop else "")
    if reason == "length" and cause is None:
        return (f"finish 'length' after {len(tokens)} of max_tokens={s.max_tokens} tokens, with {total} of "
                f"the context's {max_model_len} used")
    return None


def _tuple_problem(r: Receipt) -> str | None:
    """The tuple a receipt commits to must be the engine's own: its facts' mode and per-family tuple (the
    engine is rebuilt, and its facts compared, from the facts; a different signed tuple would go
    unchecked)."""
    try:
        recorded = {"mode": {"name": r.deployment_facts["engine"]["mode"]}, **r.deployment_facts["tuple"]}
    except (KeyError, TypeError):
        return "the receipt's facts record no engine mode or tuple"
    if facts_hash(dict(r.tuple_values)) != facts_hash(recorded):
        return "the receipt's tuple is not the one its deployment facts record"
    return None


def _vocabulary_problem(r: Receipt, vocab_size: int) -> str | None:
    """Token ids the model cannot have read or drawn (checked before they reach an embedding or a gather)."""
    for what, ids in (("prompt", r.request.prompt_token_ids), ("output", r.output.token_ids)):
        bad = next((t for t in ids if not 0 <= t < vocab_size), None)
        if bad is not None:
            return f"{what} token id {bad} is outside the model's vocabulary of {vocab_size}"
    return None


def _prompt_chars(body: object) -> int:
    """The characters of prompt text in a client body (a prompt, a batch of prompts, or messages' contents),
    counted without parsing them."""
    if not isinstance(body, dict):
        return 0
    prompt, messages = body.get("prompt"), body.get("messages")
    texts = [prompt] if isinstance(prompt, str) else list(prompt) if isinstance(prompt, list) else []
    for m in messages if isinstance(messages, list) else []:
        content = m.get("content") if isinstance(m, dict) else None
        if isinstance(content, str):
            texts.append(content)
        elif isinstance(content, list):  # content parts
            texts += [part.get("text") for part in content if isinstance(part, dict)]
    return sum(len(t) for t in texts if isinstance(t, str))


def _binding_problem(r: Receipt, llm: Engine, max_prompt_chars: int) -> str | None:
    """The request the engine ran must be the client's: its bound body, parsed by the node's own parser for
    its api on this deployment (whose context and vocabulary the verifier's engine has), gives exactly the
    receipt's prompt ids, sampling and seed, and would have been admitted. The returned text must be the
    output tokens' text."""
    from detent_audit.manifests.seeds import choice_seed, derived_seed
    from detent_audit.server.offline import API as OFFLINE_API
    from detent_audit.server.offline import parse_line
    from detent_audit.server.protocol import Limits, parse_request

    client, rid, choice = r.request.client, r.request.request_id, 0
    max_len, vocab = llm.max_model_len, llm.vocab_size
    try:
        body = client.body()
        chars = _prompt_chars(body)
        if chars > max_prompt_chars:  # refused before it is tokenized, which would take minutes and GBs
            return (f"the client's request holds {chars} characters of prompt text, more than this "
                    f"deployment's context of {max_len} tokens can hold (at most {max_prompt_chars}: no "
                    "token is longer)")
        if client.api == OFFLINE_API:  # a line is bound with its id, which no HTTP body may hold
            if "id" not in body:
                return ("the bound request has no id, so it is no input line the node read (a line is bound "
                        "with its id); an HTTP body signed as a line would be read with a line's defaults")
            if str(body["id"]) != rid:
                return f"the client's request has id {body['id']!r}, the receipt answers {rid!r}"
            _, ids, params = parse_line(body, rid, llm.tokenizer, max_len, vocab, "the client's request")
            asked_max, echo = params.max_tokens, False
        else:
            chat = client.api.endswith("/chat/completions")
            if not rid.startswith("chatcmpl-" if chat else "cmpl-"):
                return f"request id {rid!r} is not one the server gives a {client.api} response"
            model = body.get("model")
            name = model if isinstance(model, str) else ""
            parsed = parse_request(body, chat, Limits(name, max_len, vocab, max_prompt_chars), llm.tokenizer)
            ids, params, asked_max, echo = parsed.prompt_ids, parsed.params, parsed.max_tokens, parsed.echo
            if parsed.multi:  # several choices: choice i (of prompt i // n) is the receipt <response id>-<i>
                index = rid.rsplit("-", 1)[-1]
                if not (index.isdigit() and str(int(index)) == index and int(index) < parsed.choices):
                    return (f"request id {rid!r} names no choice of the client's request "
                            f"({len(parsed.prompts)} prompt(s), n = {parsed.n})")
                ids, choice = parsed.prompts[int(index) // parsed.n], int(index) % parsed.n
    except DetentError as exc:
        return (f"no front end of this deployment (context {max_len}) admits the client's request as bound: "
                f"{exc.message}")
    if tuple(ids) != tuple(r.request.prompt_token_ids):
        return (f"the prompt run ({len(r.request.prompt_token_ids)} tokens) is not the client's request "
                f"({len(ids)} tokens)")
    s = r.request.sampling
    ran = {"temperature": enc.f64_to_bits(s.temperature), "top_p": enc.f64_to_bits(s.top_p), "top_k": s.top_k,
           "max_tokens": s.max_tokens, "stop_token_ids": tuple(s.stop_token_ids), "ignore_eos": s.ignore_eos,
           "logprobs": s.logprobs, "seed": r.request.seed, "stop": tuple(s.stop),
           "echo": r.scoring is not None}
    asked = {"temperature": enc.f64_to_bits(params.temperature), "top_p": enc.f64_to_bits(params.top_p),
             "top_k": params.top_k, "max_tokens": asked_max, "stop_token_ids": tuple(params.stop_token_ids),
             "ignore_eos": params.ignore_eos, "logprobs": params.logprobs, "seed": params.seed,
             "stop": tuple(params.stop), "echo": echo}
    if body.get("seed") is None and not params.is_greedy:  # the seed the node derives, never chooses
        asked["seed"] = derived_seed(r.run.run_id, client.api, client.body_sha256, choice)
    elif not params.is_greedy:  # choice i of a seeded request: the client's seed + i
        asked["seed"] = choice_seed(params.seed, choice)
    differ = [k for k in ran if ran[k] != asked[k]]
    if differ:
        return "the sampling run is not the client's request: " + ", ".join(
            f"{k} {ran[k]!r} where the client asked {asked[k]!r}" for k in differ)
    k = r.output.top_k
    if r.output.token_ids and k != (s.logprobs or 0):
        return f"the response returned {k} alternatives per token, the request asked for {s.logprobs or 0}"
    text, _ = output_text(llm.tokenizer.decode, list(r.output.token_ids), s.stop)  # cut at a stop string
    if text != r.output.text:
        return "the text returned is not the text of the output tokens"
    return None
