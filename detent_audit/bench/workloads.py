"""Seeded synthetic serving workloads: a ShareGPT-like multi-turn replay with prefix reuse, long
documents under Poisson arrivals, and a closed loop at a fixed concurrency.

Pure Python (`random.Random` with an explicit seed; no torch, no engine): the same arguments give the same
requests on every machine, so every mode of a benchmark serves identical prompts. Token ids come from a
`TokenSpace`: ids below the model's vocabulary size that are not its special tokens (requests set
`ignore_eos` anyway, so a drawn EOS would not end them; skipping specials keeps the prompts ordinary text).

A `Workload` is open loop (every request has an arrival time in seconds from the start of the run) or closed
loop (no arrival times; `concurrency` requests are kept in flight, the next admitted when one finishes).
"""

from __future__ import annotations

import dataclasses
import math
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

from detent_audit.errors import BadInput

WorkloadKind = Literal["open", "closed"]

DEFAULT_VOCAB = 256  # the byte tokens of the embedded tokenizers: ordinary in every model this engine runs

# ShareGPT-like shape at scale 1 (token counts). Conversations have 1-6 turns with these weights (mean 1.8);
# user messages are log-normal around 105 tokens (tens to a few hundred, tail to 1024), answers log-normal
# around 180 (mostly 100-300). Together they put ~64% of all prompt tokens in the previous turn's repeat.
TURN_WEIGHTS = (60, 20, 10, 5, 3, 2)
USER_MEDIAN, USER_SIGMA, USER_RANGE = 105, 0.9, (4, 1024)
ANSWER_MEDIAN, ANSWER_SIGMA, ANSWER_RANGE = 180, 0.6, (16, 1024)
MAX_CONTEXT = 4096          # a conversation ends before a turn whose prompt + answer would exceed this
ACTIVE_CONVERSATIONS = 16   # conversations open at once; their turns are interleaved in the request order


@dataclass(frozen=True)
class TokenSpace:
    """Token ids in [0, vocab) except `reserved` (the model's special tokens)."""

    vocab: int
    reserved: frozenset[int] = frozenset()

    def __post_init__(self) -> None:
        if not isinstance(self.vocab, int) or self.vocab < 1:
            raise BadInput(f"vocab must be an integer >= 1, got {self.vocab!r}")
        object.__setattr__(self, "reserved", frozenset(self.reserved))
        if sum(0 <= t < self.vocab for t in self.reserved) >= self.vocab:
            raise BadInput(f"every id below vocab {self.vocab} is reserved: nothing left to draw")

    def draw(self, rng: random.Random, n: int) -> list[int]:
        """`n` ids drawn uniformly from the ordinary ids (advances `rng`)."""
        ids = rng.choices(range(self.vocab), k=n)
        if self.reserved:
            for i, t in enumerate(ids):
                while t in self.reserved:
                    t = rng.randrange(self.vocab)
                ids[i] = t
        return ids


def token_space(vocab: int | TokenSpace) -> TokenSpace:
    return vocab if isinstance(vocab, TokenSpace) else TokenSpace(vocab)


@dataclass(frozen=True)
class Request:
    """One request of a workload, with the fields of `SamplingParams` it needs.

    `arrival`: seconds from the start of the run (open loop), None in a closed loop. `conversation`/`turn`:
    its place in a multi-turn conversation; `repeated_tokens`: the length of the prompt's prefix that repeats
    the previous turn (its prompt and answer), 0 for a first turn or a single-turn workload.
    """

    index: int
    prompt_token_ids: tuple[int, ...]
    max_tokens: int
    temperature: float = 1.0
    seed: int = 0
    ignore_eos: bool = True
    arrival: float | None = None
    conversation: int | None = None
    turn: int | None = None
    repeated_tokens: int = 0

    def __post_init__(self) -> None:
        if not self.prompt_token_ids:
            raise BadInput(f"request {self.index}: the prompt is empty")
        if self.max_tokens < 1:
            raise BadInput(f"request {self.index}: max_tokens must be >= 1, got {self.max_tokens}")
        if self.arrival is not None and not (math.isfinite(self.arrival) and self.arrival >= 0):
            raise BadInput(f"request {self.index}: arrival must be a finite time >= 0, got {self.arrival}")
        if not 0 <= self.repeated_tokens < len(self.prompt_token_ids):
            raise BadInput(f"request {self.index}: repeated_tokens {self.repeated_tokens} outside the prompt")

    @property
    def max_len(self) -> int:
        """Prompt plus output tokens at most."""
        return len(self.prompt_token_ids) + self.max_tokens


@dataclass(frozen=True)
class Workload:
    """Requests in submission order. Open loop: every request has an arrival, in non-decreasing order.
    Closed loop: none has, and `concurrency` (>= 1) requests are kept in flight. `params` records how the
    workload was made (for reports)."""

    name: str
    kind: WorkloadKind
    requests: tuple[Request, ...]
    concurrency: int | None = None
    params: Mapping[str, object] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.requests:
            raise BadInput(f"workload {self.name}: no requests")
        if [r.index for r in self.requests] != list(range(len(self.requests))):
            raise BadInput(f"workload {self.name}: request indices must be 0, 1, ... in order")
        arrivals = [r.arrival for r in self.requests]
        if self.kind == "open":
            times = [a for a in arrivals if a is not None]
            if self.concurrency is not None or len(times) != len(arrivals):
                raise BadInput(f"workload {self.name}: open loop needs every arrival and no concurrency")
            if any(b < a for a, b in zip(times, times[1:])):
                raise BadInput(f"workload {self.name}: arrivals must be non-decreasing")
        elif self.kind == "closed":
            if not isinstance(self.concurrency, int) or self.concurrency < 1:
                raise BadInput(f"workload {self.name}: closed loop needs a concurrency >= 1")
            if any(a is not None for a in arrivals):
                raise BadInput(f"workload {self.name}: closed-loop requests have no arrival times")
        else:
            raise BadInput(f"workload {self.name}: kind must be open or closed, got {self.kind!r}")

    @property
    def num_prompt_tokens(self) -> int:
        return sum(len(r.prompt_token_ids) for r in self.requests)

    @property
    def num_output_tokens(self) -> int:
        """Output tokens the workload asks for (every request runs to max_tokens: ignore_eos)."""
        return sum(r.max_tokens for r in self.requests)

    @property
    def max_len(self) -> int:
        """The longest request, prompt plus output (the engine's max_model_len must hold it)."""
        return max(r.max_len for r in self.requests)

    @property
    def repeat_fraction(self) -> float:
        """The fraction of all prompt tokens that repeat the previous turn of their conversation."""
        return sum(r.repeated_tokens for r in self.requests) / self.num_prompt_tokens

    def head(self, n: int) -> Workload:
        """The first `n` requests (all of them if fewer)."""
        return dataclasses.replace(self, requests=self.requests[:max(1, n)])

    def with_poisson_arrivals(self, rate: float, seed: int = 0, name: str | None = None) -> Workload:
        """The same requests, open loop, arriving as a Poisson process of `rate` requests/s (first at 0)."""
        times = poisson_arrivals(len(self.requests), rate, seed)
        return self._retimed("open", times, None, name, rate=rate, arrival_seed=seed)

    def at_time_zero(self, name: str | None = None) -> Workload:
        """The same requests, all arriving at 0 (saturation: the engine queues what it cannot batch)."""
        return self._retimed("open", [0.0] * len(self.requests), None, name, rate=math.inf)

    def as_closed_loop(self, concurrency: int, name: str | None = None) -> Workload:
        """The same requests, closed loop at `concurrency`."""
        return self._retimed("closed", [None] * len(self.requests), concurrency, name,
                             concurrency=concurrency)

    def _retimed(self, kind: WorkloadKind, times: Sequence[float | None], in_flight: int | None,
                 name: str | None, **params: object) -> Workload:
        requests = tuple(dataclasses.replace(r, arrival=t) for r, t in zip(self.requests, times))
        kept = {k: v for k, v in self.params.items() if k not in ("rate", "arrival_seed", "concurrency")}
        return Workload(name or self.name, kind, requests, in_flight, {**kept, **params})


def poisson_arrivals(n: int, rate: float, seed: int = 0) -> list[float]:
    """`n` arrival times (s) of a Poisson process of `rate` per second: the first at 0, then exponential gaps
    of mean 1/rate."""
    if not (isinstance(rate, (int, float)) and math.isfinite(rate) and rate > 0):
        raise BadInput(f"rate must be a finite number of requests/s > 0, got {rate!r}")
    rng = random.Random(seed)
    times, t = [], 0.0
    for _ in range(n):
        times.append(t)
        t += rng.expovariate(rate)
    return times


def _arrange(name: str, requests: list[Request], rate: float | None, concurrency: int, seed: int,
             params: dict[str, object]) -> Workload:
    closed = Workload(name, "closed", tuple(requests), concurrency, params)
    return closed if rate is None else closed.with_poisson_arrivals(rate, seed)


class _Conversation:
    """A conversation being generated: its id, its number of turns, the next turn, the context so far."""

    __slots__ = ("id", "turns", "turn", "context")

    def __init__(self, conversation_id: int, turns: int) -> None:
        self.id, self.turns, self.turn = conversation_id, turns, 0
        self.context: list[int] = []


def _log_normal(rng: random.Random, median: float, sigma: float, lo: int, hi: int) -> int:
    return max(lo, min(hi, round(median * math.exp(rng.gauss(0.0, sigma)))))


def sharegpt_like(num_requests: int = 600, *, seed: int = 0, vocab: int | TokenSpace = DEFAULT_VOCAB,
                  scale: float = 1.0, rate: float | None = None, concurrency: int = 8,
                  temperature: float = 1.0) -> Workload:
    """A multi-turn chat replay: round(num_requests * scale) requests from conversations of 1-6 turns.

    Turn t's prompt is turn t-1's prompt, then turn t-1's answer, then a new user message, so the prompt
    repeats the previous turn (`Request.repeated_tokens`; `Workload.repeat_fraction` is ~0.64 at the
    defaults). The answers are generated while the workload runs, so the prompt of the next turn carries a
    stand-in instead: `max_tokens` pseudo-random tokens drawn here (the request's answer length; with
    `ignore_eos` every request emits exactly that many). Every mode thus serves identical prompts, whatever
    it generates; the engine's prefix cache can reuse the previous turn's prompt, but not the stand-in
    (its KV holds the generated answer), so its hit rate is below the repeat fraction.

    Turns of `ACTIVE_CONVERSATIONS` open conversations are interleaved at random, in turn order within each.
    `scale` multiplies the request count and every length (user message, answer, `MAX_CONTEXT`) for quick
    runs. `rate`: Poisson arrivals at that many requests/s; None: closed loop at `concurrency`.
    """
    if not (isinstance(scale, (int, float)) and 0 < scale <= 1):
        raise BadInput(f"scale must be in (0, 1], got {scale!r}")
    space, rng = token_space(vocab), random.Random(seed)
    n = max(1, round(num_requests * scale))

    def length(median: float, sigma: float, bounds: tuple[int, int]) -> int:
        lo, hi = max(1, round(bounds[0] * scale)), max(1, round(bounds[1] * scale))
        return _log_normal(rng, median * scale, sigma, lo, hi)

    max_context = max(2, round(MAX_CONTEXT * scale))
    requests: list[Request] = []
    active: list[_Conversation] = []
    started = 0
    while len(requests) < n:
        while len(active) < ACTIVE_CONVERSATIONS:
            active.append(_Conversation(started,
                                        rng.choices(range(1, len(TURN_WEIGHTS) + 1), TURN_WEIGHTS)[0]))
            started += 1
        j = rng.randrange(len(active))
        conv = active[j]
        user = length(USER_MEDIAN, USER_SIGMA, USER_RANGE)
        answer = length(ANSWER_MEDIAN, ANSWER_SIGMA, ANSWER_RANGE)
        if conv.context and len(conv.context) + user + answer > max_context:
            active.pop(j)  # the conversation is as long as the context allows
            continue
        prompt = conv.context + space.draw(rng, user)
        requests.append(Request(len(requests), tuple(prompt), answer, temperature, rng.getrandbits(63),
                                conversation=conv.id, turn=conv.turn, repeated_tokens=len(conv.context)))
        conv.turn += 1
        if conv.turn == conv.turns:
            active.pop(j)
        else:
            conv.context = prompt + space.draw(rng, answer)  # the answer's stand-in
    params = dict(generator="sharegpt_like", num_requests=num_requests, seed=seed, scale=scale,
                  vocab=space.vocab, temperature=temperature)
    return _arrange("sharegpt", requests, rate, concurrency, seed, params)


def long_documents(num_requests: int = 32, *, prompt_tokens: int = 8192, output_tokens: int = 128,
                   rate: float | None = 1.0, concurrency: int = 8, seed: int = 0,
                   vocab: int | TokenSpace = DEFAULT_VOCAB, temperature: float = 1.0) -> Workload:
    """Independent long prompts of prompt_tokens * 7/8 to prompt_tokens tokens (uniform), `output_tokens`
    each; Poisson arrivals at `rate` requests/s (None: closed loop at `concurrency`)."""
    if prompt_tokens < 1 or output_tokens < 1:
        raise BadInput("prompt_tokens and output_tokens must be >= 1")
    space, rng = token_space(vocab), random.Random(seed)
    lo = max(1, prompt_tokens * 7 // 8)
    requests = [Request(i, tuple(space.draw(rng, rng.randint(lo, prompt_tokens))), output_tokens, temperature,
                        rng.getrandbits(63)) for i in range(num_requests)]
    params = dict(generator="long_documents", num_requests=num_requests, prompt_tokens=prompt_tokens,
                  output_tokens=output_tokens, seed=seed, vocab=space.vocab, temperature=temperature)
    return _arrange("long-docs", requests, rate, concurrency, seed, params)


def closed_loop(num_requests: int = 32, concurrency: int = 8, *, prompt_tokens: tuple[int, int] = (128, 1024),
                output_tokens: tuple[int, int] = (128, 128), seed: int = 0,
                vocab: int | TokenSpace = DEFAULT_VOCAB, temperature: float = 1.0) -> Workload:
    """`num_requests` independent prompts, lengths uniform in `prompt_tokens` and `output_tokens` (inclusive
    ranges), served closed loop at `concurrency`. The requests depend on the seed only, not on the
    concurrency: the same seed at two concurrencies gives the same requests (for invariance checks)."""
    for what, (lo, hi) in (("prompt_tokens", prompt_tokens), ("output_tokens", output_tokens)):
        if not 1 <= lo <= hi:
            raise BadInput(f"{what} must be a range (lo, hi) with 1 <= lo <= hi, got {(lo, hi)}")
    space, rng = token_space(vocab), random.Random(seed)
    requests = []
    for i in range(num_requests):
        prompt = space.draw(rng, rng.randint(*prompt_tokens))
        requests.append(Request(i, tuple(prompt), rng.randint(*output_tokens), temperature,
                                rng.getrandbits(63)))
    params = dict(generator="closed_loop", num_requests=num_requests, prompt_tokens=list(prompt_tokens),
                  output_tokens=list(output_tokens), seed=seed, vocab=space.vocab, temperature=temperature)
    return Workload(f"closed-c{concurrency}", "closed", tuple(requests), concurrency, params)


PROFILING_SEED = 7  # the tuner's profiling samples: another seed than any timed workload's
# the concurrencies at which a kind's timed workloads run, for a profile that sees their batch sizes
# (`tune_engine(concurrency=...)`; None: every request submitted together): the closed loop at 1 and 8, long
# documents alone (the low loads) and together (the peak), the ShareGPT-like replay at load (together)
PROFILING_CONCURRENCY: dict[str, tuple[int | None, ...]] = {"sharegpt": (None,), "docs": (1, None),
                                                           "closed": (1, 8)}


def parse_concurrencies(text: str) -> tuple[int | None, ...]:
    """`--concurrency`: comma-separated integers >= 1 or `all` (None: every request submitted together)."""
    levels: list[int | None] = []
    for item in (t.strip() for t in text.split(",")):
        if item == "all":
            levels.append(None)
        elif item.isdigit() and int(item) >= 1:
            levels.append(int(item))
        else:
            raise BadInput(f"--concurrency {text!r}: {item!r} is neither an integer >= 1 nor 'all'",
                           remedy="e.g. --concurrency 1,8 or --concurrency all")
    return tuple(levels)


def profiling_samples(vocab: int | TokenSpace, *, scale: float, doc_tokens: int, output_tokens: int,
                      seed: int = PROFILING_SEED) -> dict[str, tuple[Request, ...]]:
    """Per kind of workload (sharegpt, docs, closed), the requests `detent-audit tune` profiles before the
    timed runs: 48 ShareGPT-like turns, 4 long documents, 16 closed-loop prompts."""
    return {
        "sharegpt": sharegpt_like(600, seed=seed, vocab=vocab, scale=scale).requests[:48],
        "docs": long_documents(4, prompt_tokens=doc_tokens, output_tokens=output_tokens, seed=seed,
                               vocab=vocab).requests,
        "closed": closed_loop(16, 8, prompt_tokens=(min(128, doc_tokens), min(1024, doc_tokens)),
                              output_tokens=(output_tokens, output_tokens), seed=seed, vocab=vocab).requests}
