"""The serving harness: drive an `LLM` through a `Workload` on a wall clock and measure each request.

The loop alternates admission and engine steps. Open loop: a request is handed to the engine at the first
step boundary after its arrival time (it waits out the running step, as it would in a server). Closed loop:
whenever fewer than `concurrency` requests are in flight (admitted, not finished), the next is admitted, its
arrival being that moment. The clock (`time.perf_counter`) is read after each step with the device idle:
`LLM.step` reads the sampled tokens back to the host, which waits for the step's kernels, and the harness
synchronizes CUDA as well, so that no step is timed short if the runner ever stops reading back.

Per request: latency per output token = (finish - arrival) / output tokens (queueing, prefill and decode
together, the issue's measure); TTFT = first token - arrival; TPOT = (finish - first token) / (output - 1).
Per run: p50/p90/p99 of each, output tokens/s and requests/s over the makespan, the prefix-cache hit
fraction, and a sha256 digest of every request's output token ids and logprob bits keyed by request index
(equal digests: bit-identical outputs, e.g. detent at two concurrencies).
"""

from __future__ import annotations

import hashlib
import math
import struct
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from functools import cached_property
from typing import Any, NamedTuple

from detent_audit.bench.workloads import Request, TokenSpace, Workload
from detent_audit.engine.llm import LLM, EngineConfig
from detent_audit.engine.sequence import Sequence
from detent_audit.errors import BadInput
from detent_audit.runtime.model_config import ModelConfig
from detent_audit.runtime.sampling_params import SamplingParams
from detent_audit.runtime.tokenizer import Tokenizer

# Long-document loads, as fractions of stock's peak request rate (`measure_peak`): a quarter and half load,
# where queueing is light, and the peak itself, where a Poisson stream queues (the hardest of the three).
LOAD_FRACTIONS = (0.25, 0.5, 1.0)


def sampling_params(request: Request) -> SamplingParams:
    return SamplingParams(temperature=request.temperature, max_tokens=request.max_tokens, seed=request.seed,
                          ignore_eos=request.ignore_eos)


def engine_requests(name: str, requests: Iterable[Request]) -> list[tuple[str, list[int], SamplingParams]]:
    """(request id, prompt token ids, sampling params) triples, as `LLM.add_request` and the tuner take
    them."""
    return [(f"{name}-{i}", list(r.prompt_token_ids), sampling_params(r)) for i, r in enumerate(requests)]


def ordinary_tokens(tokenizer: Tokenizer, config: ModelConfig) -> TokenSpace:
    """A model's ordinary token ids: below its vocabulary size, without the tokenizer's added (special)
    tokens and the BOS/EOS ids."""
    reserved = set(tokenizer.tokenizer.get_added_tokens_decoder()) | set(tokenizer.eos_token_ids)
    if config.bos_token_id is not None:
        reserved.add(config.bos_token_id)
    return TokenSpace(config.vocab_size, frozenset(reserved))


def token_space_of(llm: LLM) -> TokenSpace:
    """The ordinary token ids of a running engine's model."""
    return ordinary_tokens(llm.tokenizer, llm.model.config)


def token_space_for(config: EngineConfig) -> TokenSpace:
    """The ordinary token ids of the model an engine would load (reads its config and tokenizer only)."""
    return ordinary_tokens(Tokenizer.from_pretrained(config.model_path),
                           ModelConfig.from_pretrained(config.model_path))


@dataclass(frozen=True)
class RequestRecord:
    """One served request; times in seconds from the start of the run, arrival <= admitted <= first_token
    <= finish. `arrival`: the scheduled arrival (open loop) or the admission (closed loop)."""

    index: int
    arrival: float
    admitted: float
    first_token: float
    finish: float
    num_prompt_tokens: int
    num_cached_tokens: int
    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]  # fp32 values

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def latency_per_output_token(self) -> float:
        return (self.finish - self.arrival) / self.num_output_tokens

    @property
    def ttft(self) -> float:
        return self.first_token - self.arrival

    @property
    def tpot(self) -> float | None:
        """Mean time between output tokens; None for a one-token request."""
        n = self.num_output_tokens
        return (self.finish - self.first_token) / (n - 1) if n > 1 else None

    def digest_bytes(self) -> bytes:
        n = self.num_output_tokens
        return (struct.pack("<QI", self.index, n) + struct.pack(f"<{n}I", *self.token_ids)
                + struct.pack(f"<{len(self.logprobs)}f", *self.logprobs))


class Stats(NamedTuple):
    p50: float
    p90: float
    p99: float
    mean: float

    @classmethod
    def of(cls, values: Iterable[float]) -> Stats:
        xs = sorted(values)
        if not xs:
            return cls(math.nan, math.nan, math.nan, math.nan)
        return cls(percentile(xs, 50), percentile(xs, 90), percentile(xs, 99), sum(xs) / len(xs))

    def scaled(self, factor: float) -> dict[str, float]:
        return {k: v * factor for k, v in self._asdict().items()}


def percentile(sorted_values: list[float], q: float) -> float:
    """The q-th percentile, linear between closest ranks (numpy's default)."""
    pos = (len(sorted_values) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(sorted_values) - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo)


def outputs_digest(records: Iterable[RequestRecord]) -> str:
    """sha256 over every request's index, output token ids and logprob bits, in index order."""
    h = hashlib.sha256()
    for r in sorted(records, key=lambda r: r.index):
        h.update(r.digest_bytes())
    return h.hexdigest()


@dataclass(frozen=True)
class RunResult:
    """A workload served once. `num_dropped`: requests never admitted (the admission deadline passed);
    `max_in_flight`: the most requests admitted and unfinished at once."""

    workload: str
    kind: str
    concurrency: int | None
    rate: float | None
    records: tuple[RequestRecord, ...]
    duration_s: float  # from the start of the run to the last finish
    num_dropped: int
    max_in_flight: int

    @cached_property
    def latency_per_output_token(self) -> Stats:
        return Stats.of(r.latency_per_output_token for r in self.records)

    @cached_property
    def ttft(self) -> Stats:
        return Stats.of(r.ttft for r in self.records)

    @cached_property
    def tpot(self) -> Stats:
        return Stats.of(t for r in self.records if (t := r.tpot) is not None)

    @property
    def num_output_tokens(self) -> int:
        return sum(r.num_output_tokens for r in self.records)

    @property
    def throughput(self) -> float:
        """Output tokens per second over the run."""
        return self.num_output_tokens / self.duration_s

    @property
    def request_throughput(self) -> float:
        return len(self.records) / self.duration_s

    @property
    def cached_fraction(self) -> float:
        """Prompt tokens served from the prefix cache, over all prompt tokens."""
        return sum(r.num_cached_tokens for r in self.records) / sum(r.num_prompt_tokens for r in self.records)

    @cached_property
    def digest(self) -> str:
        return outputs_digest(self.records)

    def request_digests(self) -> dict[int, str]:
        return {r.index: hashlib.sha256(r.digest_bytes()).hexdigest() for r in self.records}

    def to_json(self) -> dict[str, Any]:
        """The summary (no per-request data); latencies in milliseconds."""
        return {
            "workload": self.workload, "kind": self.kind, "concurrency": self.concurrency,
            "rate": None if self.rate is None or math.isinf(self.rate) else self.rate,
            "num_requests": len(self.records), "num_dropped": self.num_dropped,
            "max_in_flight": self.max_in_flight, "duration_s": self.duration_s,
            "output_tokens": self.num_output_tokens, "throughput_tok_s": self.throughput,
            "request_throughput": self.request_throughput, "cached_fraction": self.cached_fraction,
            "latency_per_output_token_ms": self.latency_per_output_token.scaled(1e3),
            "ttft_ms": self.ttft.scaled(1e3), "tpot_ms": self.tpot.scaled(1e3), "digest": self.digest,
        }


def same_outputs(a: RunResult, b: RunResult) -> bool:
    """True when every request served in both runs has bit-identical tokens and logprobs in both."""
    da, db = a.request_digests(), b.request_digests()
    common = sorted(set(da) & set(db))
    return bool(common) and all(da[i] == db[i] for i in common)


def _synchronizer(llm: LLM) -> Callable[[], None]:
    if llm.config.device == "cuda":
        import torch

        return torch.cuda.synchronize
    return lambda: None


def check_fits(llm: LLM, workload: Workload) -> None:
    """Raise `BadInput` if a request's prompt plus max_tokens exceeds the engine's max_model_len (the
    engine would stop it early and the run would measure fewer tokens than asked)."""
    limit = llm.scheduler.config.max_model_len
    if workload.max_len > limit:
        raise BadInput(f"workload {workload.name}: a request needs {workload.max_len} tokens, the engine's "
                       f"max_model_len is {limit}", remedy="raise max_model_len or shorten the workload")


class _Live(NamedTuple):
    request: Request
    seq: Sequence
    arrival: float
    admitted: float


def run_workload(llm: LLM, workload: Workload, *, admit_until: float | None = None,
                 progress: bool = False) -> RunResult:
    """Serve `workload` on `llm` and time every request (module docstring).

    The engine is reset first (no request left, a cold prefix cache); it raises `RuntimeError` if requests
    are still running. Once the clock passes `admit_until` seconds, no request is admitted any more (those
    in flight finish; the rest are counted in `num_dropped`). `progress`: a rich progress bar.
    """
    check_fits(llm, workload)
    llm.reset()
    sync = _synchronizer(llm)
    pending = deque(workload.requests)
    live: dict[int, _Live] = {}              # seq_id -> request in flight
    awaiting: dict[int, Sequence] = {}       # seq_id -> in flight without an output token yet
    first_token: dict[int, float] = {}       # seq_id -> time of its first output token
    records: list[RequestRecord] = []
    num_dropped = max_in_flight = 0
    bar = _Bar(workload, progress)
    sync()
    start = time.perf_counter()
    now = 0.0
    while pending or live:
        if admit_until is not None and now > admit_until and pending:
            num_dropped, pending = len(pending), deque()
        # (1) admission between steps
        while pending and (pending[0].arrival <= now if workload.kind == "open"
                           else len(live) < workload.concurrency):
            r = pending.popleft()
            seq = llm.add_request(r.prompt_token_ids, sampling_params(r), request_id=str(r.index))
            live[seq.seq_id] = _Live(r, seq, now if r.arrival is None else r.arrival, now)
            awaiting[seq.seq_id] = seq
        max_in_flight = max(max_in_flight, len(live))
        if not live:  # open loop, idle until the next arrival (or done: the rest were dropped)
            if not pending:
                break
            time.sleep(max(0.0, pending[0].arrival - now))
            now = time.perf_counter() - start
            continue
        # (2) one engine step, timed with the device idle
        finished = llm.step()
        sync()
        now = time.perf_counter() - start
        for sid in [sid for sid, seq in awaiting.items() if seq.num_output_tokens > 0]:
            first_token[sid] = now
            del awaiting[sid]
        # (3) finished requests leave
        for seq in finished:
            entry = live.pop(seq.seq_id)
            records.append(RequestRecord(entry.request.index, entry.arrival, entry.admitted,
                                         first_token.pop(seq.seq_id), now, seq.num_prompt_tokens,
                                         seq.num_cached_tokens, tuple(seq.output_token_ids),
                                         tuple(seq.output_logprobs)))
            bar.advance()
        if live and not llm.has_unfinished():
            raise RuntimeError("the engine stopped with requests unfinished")
    bar.close()
    records.sort(key=lambda r: r.index)
    rate = workload.params.get("rate") if workload.kind == "open" else None
    return RunResult(workload.name, workload.kind, workload.concurrency, rate, tuple(records),
                     max(r.finish for r in records) if records else now, num_dropped, max_in_flight)


class _Bar:
    """A rich progress bar over a workload's requests, or nothing."""

    def __init__(self, workload: Workload, enabled: bool) -> None:
        self.progress = None
        if enabled:
            from rich.progress import Progress

            self.progress = Progress(transient=True)
            self.task = self.progress.add_task(workload.name, total=len(workload.requests))
            self.progress.start()

    def advance(self) -> None:
        if self.progress is not None:
            self.progress.advance(self.task)

    def close(self) -> None:
        if self.progress is not None:
            self.progress.stop()


@dataclass(frozen=True)
class Peak:
    """Saturation throughput of one engine on one workload's requests."""

    requests_per_s: float
    output_tokens_per_s: float
    num_requests: int
    duration_s: float

    def loads(self, fractions: Iterable[float] = LOAD_FRACTIONS) -> list[float]:
        """Request rates at these fractions of the peak."""
        return [f * self.requests_per_s for f in fractions]

    def to_json(self) -> Mapping[str, float]:
        return {"requests_per_s": self.requests_per_s, "output_tokens_per_s": self.output_tokens_per_s,
                "num_requests": self.num_requests, "duration_s": self.duration_s}


def measure_peak(llm: LLM, workload: Workload, max_requests: int | None = None) -> Peak:
    """The engine's peak request rate on `workload`'s first `max_requests` requests (default all): every
    one arrives at 0, so the engine is always as full as max_num_seqs, its token budget and its KV blocks
    allow, and the peak is requests / makespan. A Poisson stream at this rate is critically loaded."""
    subset = workload.head(max_requests or len(workload.requests)).at_time_zero(name=f"{workload.name}-peak")
    result = run_workload(llm, subset)
    return Peak(result.request_throughput, result.throughput, len(result.records), result.duration_s)
