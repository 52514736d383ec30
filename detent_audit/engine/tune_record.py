"""Step 1 of `detent-audit tune`: serve a profiling workload and record every kernel call per family, by
shape, with its count: gemm (M, N, K), attention (each sequence's context and query length, heads, head
dim), moe (M, experts, sizes); at each concurrency the workload is served at."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from typing import Any

from detent_audit.engine.llm import LLM
from detent_audit.errors import BadInput
from detent_audit.kernels import AttentionMetadata, Kernels


class RecordingKernels:
    """Delegates to a kernel set and counts each family's calls by shape."""

    def __init__(self, inner: Kernels) -> None:
        self.inner = inner
        self.calls: dict[str, Counter] = {"embedded.gemm": Counter(), "embedded.attention": Counter(),
                                          "embedded.moe": Counter()}

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def linear(self, x, weight, bias=None):
        call = (x.numel() // x.shape[-1], weight.shape[0], weight.shape[1], str(x.dtype))
        self.calls["embedded.gemm"][call] += 1
        return self.inner.linear(x, weight, bias)

    def attention(self, q, k_cache, v_cache, meta: AttentionMetadata, scale):
        q_lens = (meta.cu_seqlens_q[1:] - meta.cu_seqlens_q[:-1]).tolist()
        seqs = tuple(zip(meta.context_lens.tolist(), q_lens))
        self.calls["embedded.attention"][(seqs, q.shape[1], k_cache.shape[2], q.shape[2], str(q.dtype))] += 1
        return self.inner.attention(q, k_cache, v_cache, meta, scale)

    def moe(self, x, router_logits, w13, w2, top_k, renormalize):
        self.calls["embedded.moe"][(x.shape[0], w13.shape[0], w13.shape[2], w2.shape[2], top_k, renormalize,
                                    str(x.dtype))] += 1
        return self.inner.moe(x, router_logits, w13, w2, top_k, renormalize)


def record_calls(llm: LLM, requests: Iterable[tuple[str, list[int], Any]],
                 max_in_flight: int | None = None) -> dict[str, Counter]:
    """Serve `requests` and return each family's recorded calls: all submitted together, or, with
    `max_in_flight`, that many kept in flight and the next admitted when one finishes (as a closed loop at
    that concurrency serves them, so decode steps run at the batch sizes it runs)."""
    if max_in_flight is not None and (isinstance(max_in_flight, bool) or not isinstance(max_in_flight, int)
                                      or max_in_flight < 1):
        raise BadInput(f"profiling concurrency must be an integer >= 1, got {max_in_flight!r}")
    queue = list(requests)
    limit = max_in_flight or max(1, len(queue))
    recorder = RecordingKernels(llm.runner.kernels)
    # eager: every call seen
    llm.runner.kernels, graphs, llm.runner.graphs = recorder, llm.runner.graphs, None
    try:
        live: set[int] = set()  # this profile's sequences in flight
        while queue or live:
            admitted, queue = queue[:limit - len(live)], queue[limit - len(live):]
            live.update(llm.add_request(ids, params, rid).seq_id for rid, ids, params in admitted)
            if not llm.has_unfinished():
                raise RuntimeError("the scheduler stopped with requests unfinished")
            live.difference_update(seq.seq_id for seq in llm.step())
    finally:
        llm.runner.kernels, llm.runner.graphs = recorder.inner, graphs
    return {f: c for f, c in recorder.calls.items() if c}


def record_profile(llm: LLM, requests: list,
                   concurrency: Sequence[int | None] = (None,)) -> dict[str, Counter]:
    """`record_calls` once per entry of `concurrency` (None: all submitted together; n: n kept in flight),
    passes after the first from an empty prefix cache, the calls added up: a profile with the batch sizes the
    workload is served at."""
    if not concurrency:
        raise BadInput("profiling needs at least one concurrency (None: all requests together)")
    calls: dict[str, Counter] = {}
    for i, c in enumerate(concurrency):
        if i:
            llm.reset(max_prefill_chunk=llm.scheduler.config.max_prefill_chunk)
        for family, counter in record_calls(llm, requests, c).items():
            calls.setdefault(family, Counter()).update(counter)
    return calls
