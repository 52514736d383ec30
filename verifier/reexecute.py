"""Steps (7)-(10) of verification for one batch of receipts of one deployment and tuple: (7) the engine
rebuilt from their facts (`reconstruct.py`), (8)-(9) what their content refutes on it (`checks.py`), then (10)
the batch re-executed together and each receipt's bits compared (`compare.py`).

`rescore` is one teacher-forced prefill per request, many requests batched (batch invariance makes batching
legal; the seeded draw at every position is recomputed from the logits); `replay` generates again,
autoregressive and seeded, and its finish reason is compared too. An echo receipt's prompt is scored by the
same prefill, from its second token on. A receipt that crashes a step is that receipt's verdict, never the
run's end.
"""

from __future__ import annotations

import multiprocessing.util
import struct
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from detent_audit.errors import DetentError
from detent_audit.manifests.receipt import Receipt
from detent_audit.runtime.contract import Engine, TopLogprobs
from detent_audit.runtime.sampling_params import SamplingParams
from detent_audit.verifier.checks import refutation
from detent_audit.verifier.compare import first_divergence, prompt_divergence
from detent_audit.verifier.reconstruct import reconstruct
from detent_audit.verifier.report import Outcome
from detent_audit.verifier.steps import BitsError, DeploymentError, VerificationError

# a re-executed prompt's logprobs and top-n; a re-executed output's tokens, logprobs, finish reason (replay
# only) and top-n
PromptScores = tuple[list[float], TopLogprobs]
Result = tuple[list[int], list[float], str | None, TopLogprobs]


@dataclass(frozen=True)
class Options:
    """What rebuilds and runs a group's engine, besides its receipts (picklable, for the workers)."""

    model: str | None
    mode: str
    cache_dir: str | None
    threads: int | None
    tuple_override: dict | None
    # per (deployment, tuple) group, its longest receipt's tokens: the group's engine holds one of them (the
    # engine caps it at its own model's context, so a receipt's claims cannot size another group's memory)
    kv_tokens: dict = field(default_factory=dict)
    published: bool = False  # the facts were checked against a published deployment (verify --deployment)
    tensor_parallel: int | None = None  # re-execute TP receipts natively at this size (None: rank emulation)


def run_batch(batch: list[tuple[Path, Receipt]], options: Options, engines: dict) -> list[Outcome]:
    """Steps (7)-(10) for one batch, on the engine `engines` keeps for its group (built on first use; batches
    come in group order, so one engine at a time is kept)."""
    first = batch[0][1]
    key = (first.deployment_hash, first.tuple_hash)
    if key not in engines:
        release(engines)
        engines[key] = _rebuild(first, options, key)
    llm = engines[key]
    if isinstance(llm, VerificationError):
        return [Outcome.refuted(str(p), "receipt", llm, r.request.request_id) for p, r in batch]
    return _reexecute_isolating(llm, batch, options.mode, set(llm.tokenizer.eos_token_ids), options.published)


def release(engines: dict) -> None:
    """Stop and forget the engines kept: one with processes of its own (SGLang's) stops them now, not whenever
    it is collected, so that the next group's engine never runs beside it."""
    for engine in engines.values():
        stop = getattr(engine, "shutdown", None)
        if callable(stop):
            stop()
    engines.clear()


def _rebuild(first: Receipt, options: Options, key: tuple[str, str]) -> Engine | DeploymentError:
    """Step (7): the group's engine, or the `DeploymentError` every receipt of the group gets (not comparable,
    exit 3; facts that cannot be rebuilt, exit 2)."""
    try:
        return reconstruct(first.deployment_facts, first.tuple_values, options.model, options.cache_dir,
                           options.threads, options.tuple_override, kv_tokens=options.kv_tokens.get(key, 0),
                           tensor_parallel=options.tensor_parallel)
    except DeploymentError as exc:  # NotComparable
        return exc
    except DetentError as exc:  # facts that cannot be rebuilt: the group's receipts are bad input
        return DeploymentError(exc.message, exit_code=2)
    except Exception as exc:  # noqa: BLE001 (signed facts the engine chokes on must not end the run)
        return DeploymentError("the receipt's deployment could not be rebuilt here: "
                               f"{type(exc).__name__}: {exc}", exit_code=2)


def _reexecute_isolating(llm: Engine, batch: list[tuple[Path, Receipt]], mode: str, eos: set[int],
                         published: bool = False) -> list[Outcome]:
    """`_reexecute`, and where the engine refuses the batch (a receipt it cannot run: a request longer than
    the deployment's context, say), each receipt alone, so that the refusal lands on the receipts it concerns
    (a FAIL: the deployment could not have served them) and the others are still checked."""
    try:
        return _reexecute(llm, batch, mode, eos, published)
    except DetentError as exc:
        llm.reset(drop_unfinished=True)
        if len(batch) == 1:
            p, r = batch[0]
            return [Outcome.refuted(str(p), "receipt", BitsError(
                f"the deployment cannot re-execute it: {exc.message}", request_id=r.request.request_id))]
    except Exception as exc:  # noqa: BLE001 (one receipt's crash must not take the others' verdicts with it)
        llm.reset(drop_unfinished=True)
        if len(batch) == 1:
            p, r = batch[0]
            return [Outcome.refuted(str(p), "receipt", BitsError(
                f"re-execution raised {type(exc).__name__}: {exc}", exit_code=2,
                request_id=r.request.request_id))]
    return [o for item in batch for o in _reexecute_isolating(llm, [item], mode, eos, published)]


_WORKER_ENGINES: dict = {}  # a worker process's engines, kept across its batches
_worker_exit: list[multiprocessing.util.Finalize] = []  # stops them when the worker exits


def stop_engines_at_exit() -> None:
    """Have this worker stop the engines it keeps when it exits (once registered, before multiprocessing waits
    for the worker's child processes)."""
    if not _worker_exit:
        _worker_exit.append(multiprocessing.util.Finalize(None, release, (_WORKER_ENGINES,), exitpriority=10))


def worker_batch(batch: list[tuple[str, bytes]], options: Options) -> list[Outcome]:
    """A worker's batch: receipts as their payload bytes (already signature-checked by the parent). The
    engines it builds are stopped as the worker exits, before it waits for its child processes: an engine
    with processes of its own (SGLang's scheduler) left running would keep the worker, and the pool's
    shutdown, waiting on them for good."""
    stop_engines_at_exit()
    return run_batch([(Path(p), Receipt.from_bytes(b)) for p, b in batch], options, _WORKER_ENGINES)


def _max_prompt_chars(llm: Engine) -> int:
    """The longest prompt text the deployment's context can hold: its longest token, `max_model_len`
    times."""
    return int(llm.max_model_len * llm.tokenizer.max_token_chars())


def _reexecute(llm: Engine, batch: list[tuple[Path, Receipt]], mode: str, eos: set[int],
               published: bool = False) -> list[Outcome]:
    # (7)-(9): what the receipt's content already refutes is not re-executed: a tuple that is not its facts',
    # out-of-vocabulary ids, a wrong finish, a request that is not the client's
    max_chars = _max_prompt_chars(llm)
    parallel = getattr(llm, "parallel_note", "")  # how a tensor-parallel receipt was re-executed
    refuted = {p: refutation(r, llm, eos, max_chars) for p, r in batch}
    usable = [(p, r) for p, r in batch if refuted[p] is None]
    # (10): re-execute, all of the batch together. An echo receipt's prompt is scored by the same
    # teacher-forced prefill (from its second token on, with its top-n), its output with it (rescore) or
    # after it (replay)
    scored = {p: _score_prompt(r) for p, r in usable}
    prompt_scores: dict[Path, PromptScores] = {}
    results: dict[Path, Result]
    if mode == "rescore":
        jobs = [(p, r) for p, r in usable if scored[p] or r.output.token_ids]
        got = llm.rescore_batch([_rescore_pair(r, scored[p]) for p, r in jobs], [_params(r) for _, r in jobs])
        results = {p: (list(r.output.token_ids), [], None, []) for p, r in usable}
        for (p, r), res in zip(jobs, got):
            skip = len(r.request.prompt_token_ids) - 1 if scored[p] else 0  # the prompt's scores come first
            results[p] = (res.tokens[skip:], res.logprobs[skip:], None, res.tops[skip:])
            if scored[p]:
                prompt_scores[p] = (res.logprobs[:skip], res.tops[:skip])
    else:
        drawn = [(p, r) for p, r in usable if r.output.token_ids]
        outs = llm.generate([list(r.request.prompt_token_ids) for _, r in drawn],
                            [_params(r) for _, r in drawn])
        results = {p: ([], [], None, []) for p, _ in usable}
        results.update({p: (o.token_ids, o.logprobs, o.finish_reason, o.top_logprobs)
                        for (p, _), o in zip(drawn, outs)})
        jobs = [(p, r) for p, r in usable if scored[p]]
        got = llm.rescore_batch([_rescore_pair(r, True, with_output=False) for _, r in jobs],
                                [_params(r) for _, r in jobs])
        prompt_scores = {p: (res.logprobs, res.tops) for (p, _), res in zip(jobs, got)}
    out = []
    for p, r in batch:
        error = refuted[p] or _bits_error(r, results[p], prompt_scores.get(p))
        if error is not None:
            out.append(Outcome.refuted(str(p), "receipt", error, r.request.request_id))
            continue
        rid = r.request.request_id
        scored_note = f", {r.scoring.num_positions} prompt positions" if r.scoring is not None else ""
        how = ", ".join([mode, *([parallel] if parallel else [])])
        verdict = (f"request {rid}: the client's request, {len(results[p][0])} tokens, text and bits "
                   f"equal{scored_note} ({how})" + stated_claims(r, llm.max_model_len, published))
        out.append(Outcome(str(p), "receipt", "OK", verdict, rid))
    return out


def stated_claims(r: Receipt, max_model_len: int, published: bool) -> str:
    """What an OK verdict rests on the node's word for: an output cut where the context it states is full
    (unrefuted unless the deployment is published: a smaller stated context cuts a request that set no
    max_tokens), and the checkpoint's name and source (descriptive: its files' hashes are compared)."""
    notes = []
    used = len(r.request.prompt_token_ids) + len(r.output.token_ids)
    if r.output.finish_reason == "length" and used >= max_model_len and not published:
        notes.append(f"it ends where the context the node states is full (max_model_len {max_model_len}): "
                     "a limit stated, not refuted (check it with --deployment)")
    checkpoint = r.deployment_facts.get("checkpoint")
    name = checkpoint.get("name") if isinstance(checkpoint, Mapping) else None
    if isinstance(name, str):
        notes.append(f"the checkpoint name {name[:80]!r} is as the node states it (the files' hashes are "
                     "compared)")
    return "".join(f"; {n}" for n in notes)


def _bits_error(r: Receipt, result: Result, prompt_scores: PromptScores | None) -> BitsError | None:
    """(10): an echo's prompt scores, then token ids and logprob bits, the alternatives returned (and,
    replayed, the finish reason), against the re-execution's."""
    rid = r.request.request_id
    if prompt_scores is not None:
        assert r.scoring is not None, "a prompt is rescored for a receipt with a scoring record only"
        lps, tops = prompt_scores
        problem = prompt_divergence(list(r.request.prompt_token_ids), list(r.scoring.logprobs), lps,
                                    r.scoring.tops, tops if r.scoring.top_n else [])
        if problem is not None:
            return BitsError(problem, request_id=rid)
    tokens, lps, finish, tops = result
    div = first_divergence(list(r.output.token_ids), list(r.output.logprobs), list(tokens), list(lps))
    if div is not None:
        return BitsError(div.describe(), divergence=div, request_id=rid)
    problem = _tops_problem(r, tops)
    if problem is not None:
        return BitsError(problem, request_id=rid)
    if finish is not None and finish != r.output.finish_reason:
        return BitsError(f"finish reason {r.output.finish_reason!r}, replay finished with {finish!r}",
                         request_id=rid)
    return None


def _f32_bits(values: Iterable[float]) -> bytes:
    values = list(values)
    return struct.pack(f"<{len(values)}f", *values)


def _tops_problem(r: Receipt, tops: list[list[tuple[int, float]]]) -> str | None:
    """The alternatives a response returned, against those recomputed (ids equal, fp32 bits equal)."""
    k = r.output.top_k
    if not k:
        return None
    got_ids = tuple(i for t in tops for i, _ in t)
    got_bits = _f32_bits(v for t in tops for _, v in t)
    if got_ids != r.output.top_token_ids or got_bits != r.output.top_logprobs_f32le:
        want = r.output.top_logprobs  # built once: a position's lookup must not rebuild every position's
        first = next((i for i, (t, w) in enumerate(zip(tops, want)) if [a for a, _ in t] != [a for a, _ in w]
                      or _f32_bits(v for _, v in t) != _f32_bits(v for _, v in w)), min(len(tops), len(want)))
        return f"the top-{k} alternatives returned differ from the recomputed ones at output position {first}"
    return None


def _score_prompt(r: Receipt) -> bool:
    """Whether `r`'s prompt scores are re-executed: an echo receipt with at least one scored position."""
    return r.scoring is not None and r.scoring.num_positions > 0


def _rescore_pair(r: Receipt, score_prompt: bool, with_output: bool = True) -> tuple[list[int], list[int]]:
    """The (prefix, targets) of `r`'s teacher-forced prefill: after the first prompt token, the rest of the
    prompt and the output (echo), or after the prompt, the output."""
    prompt, output = list(r.request.prompt_token_ids), list(r.output.token_ids) if with_output else []
    return (prompt[:1], prompt[1:] + output) if score_prompt else (prompt, output)


def _params(r: Receipt) -> SamplingParams:
    s = r.request.sampling
    # max_tokens 0 (an echo receipt that drew nothing): the engine's request draws one token, never compared
    return SamplingParams(temperature=s.temperature, top_k=s.top_k, top_p=s.top_p,
                          max_tokens=max(1, s.max_tokens), seed=r.request.seed,
                          stop_token_ids=tuple(s.stop_token_ids), ignore_eos=s.ignore_eos,
                          logprobs=s.logprobs, stop=tuple(s.stop))
