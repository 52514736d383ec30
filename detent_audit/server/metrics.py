"""The server's counters, and /metrics: the Prometheus text exposition format (version 0.0.4).

Counted: HTTP responses by route and status, prompt and generated tokens of signed responses, receipts
written, storage errors (a receipt or manifest that could not be written). Gauges, read when scraped: requests
outstanding in the engine (queued or running), generated tokens per second over the last `RATE_WINDOW_S`
seconds, and the request-body bytes being read. Thread-safe: signing threads and the event loop update it.
"""

from __future__ import annotations

import threading
import time
from collections import Counter, deque

RATE_WINDOW_S = 60.0
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class Metrics:
    """Counters since the server started (see the module docstring)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.responses: Counter[tuple[str, int]] = Counter()  # (route, status) -> responses
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.receipts_written = 0
        self.storage_errors = 0
        self._recent: deque[tuple[float, int]] = deque()  # (monotonic time, generated tokens) in the window

    def response(self, route: str, status: int) -> None:
        with self._lock:
            self.responses[(route, status)] += 1

    def signed(self, prompt_tokens: int, generation_tokens: int) -> None:
        """One receipt written, for a response of these token counts."""
        now = time.monotonic()
        with self._lock:
            self.receipts_written += 1
            self.prompt_tokens += prompt_tokens
            self.generation_tokens += generation_tokens
            self._recent.append((now, generation_tokens))
            self._trim(now)

    def storage_error(self) -> None:
        with self._lock:
            self.storage_errors += 1

    def tokens_per_second(self) -> float:
        """Generated tokens per second over the last `RATE_WINDOW_S` seconds."""
        with self._lock:
            self._trim(time.monotonic())
            return sum(n for _, n in self._recent) / RATE_WINDOW_S

    def _trim(self, now: float) -> None:
        while self._recent and self._recent[0][0] < now - RATE_WINDOW_S:
            self._recent.popleft()

    def exposition(self, queue_depth: int, body_bytes: int) -> str:
        """The Prometheus text of every metric, `queue_depth` and `body_bytes` as read now."""
        rate = self.tokens_per_second()
        with self._lock:
            responses = sorted(self.responses.items())
            counters = [("prompt_tokens", "Prompt tokens of signed responses.", self.prompt_tokens),
                        ("generation_tokens", "Generated tokens of signed responses.",
                         self.generation_tokens),
                        ("receipts_written", "Receipts signed and written durably.", self.receipts_written),
                        ("storage_errors", "Receipt or manifest writes that failed.", self.storage_errors)]
        lines = ["# HELP detent_requests_total HTTP responses by route and status.",
                 "# TYPE detent_requests_total counter"]
        lines += [f'detent_requests_total{{route="{route}",status="{status}"}} {n}'
                  for (route, status), n in responses]
        for name, help_text, value in counters:
            lines += [f"# HELP detent_{name}_total {help_text}", f"# TYPE detent_{name}_total counter",
                      f"detent_{name}_total {value}"]
        gauges: list[tuple[str, str, float]] = [
            ("queue_depth", "Requests queued or running in the engine.", queue_depth),
            ("generation_tokens_per_second",
             f"Generated tokens per second over the last {RATE_WINDOW_S:g} s.", rate),
            ("request_body_bytes", "Bytes of request bodies being read or parsed.", body_bytes)]
        for name, help_text, amount in gauges:
            lines += [f"# HELP detent_{name} {help_text}", f"# TYPE detent_{name} gauge",
                      f"detent_{name} {amount}"]
        return "\n".join(lines) + "\n"
