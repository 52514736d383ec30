"""Slow tier: `serve --engine sglang --max-model-len 4096` over HTTP (benchmarks/sglang_serving.py: the detent
SGLang engine behind the server in this process): a streamed completion's tokens arrive while SGLang
generates, and a prompt of 3,000 tokens is answered with its receipt (the CPU selection solved for the
served context)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

pytest.importorskip("sglang")
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))  # the benchmark's own module

import sglang_serving as bench  # noqa: E402

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def url(tmp_path_factory):
    with bench.served(4096, tmp_path_factory.mktemp("served")) as (address, _):
        yield address


def test_a_streamed_completion_arrives_token_by_token(url) -> None:
    """100 tokens: the first chunk long before the last (under half the request's time), and many chunks (the
    whole output at the end would be one)."""
    figures = bench.streamed(url, "Write a long story about a lighthouse keeper and the sea.", 100)
    print(figures)
    assert figures["tokens"] == 100
    assert figures["chunks_with_tokens"] >= 10, figures
    assert figures["ttft_s"] < 0.5 * figures["total_s"], figures


def test_a_prompt_of_3000_tokens_is_answered_at_context_4096(url) -> None:
    figures = bench.long_prompt(url, 3000, seed=31)
    assert figures["status"] == 200 and figures["prompt_tokens"] == 3000, figures
