"""Slow tier: SGLang's own server (`python -m sglang.launch_server`) with the detent plugin, started as
`detent-audit sglang-config` prints it, and SGLang's own determinism test against it and against the stock
server (benchmarks/sglang_deterministic.py: the servers, each mode's verdict, why the model's embedding is
padded). One SGLang at a time.

The plugin's server here is started with a longer context (`--context-length 4096`) than the plugin's
selection was solved for (2048): a request beyond 2048 tokens is refused in the scheduler, alone, and the
server serves on (stock SGLang's scheduler would raise the selection's violation and stop the server).
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

import httpx
import pytest

pytest.importorskip("sglang")
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))  # the benchmark's own module

import sglang_deterministic as bench  # noqa: E402

pytestmark = pytest.mark.slow
MODEL = "smollm2-135m-instruct"
PORT = 31047
SMALL = {"n_trials": 3, "max_new_tokens": 12}


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    return str(bench.padded_checkpoint(MODEL, tmp_path_factory.mktemp("padded") / "model"))


@pytest.fixture(scope="module")
def plugin_server(model, tmp_path_factory):
    root = tmp_path_factory.mktemp("plugin-server")
    server = bench.Server(model, True, PORT, root / "server.log", max_model_len=2048,
                          extra=("--context-length", "4096"), report_dir=root / "reports")
    try:
        server.wait_ready(1800)
        yield server, root / "reports"
    finally:
        server.stop()


def test_sglangs_own_server_starts_with_every_hook_of_the_plugin_in_its_scheduler(plugin_server) -> None:
    from detent_audit.integrations.sglang import control, guard, rescore
    from detent_audit.integrations.sglang.cpu_kernels import TARGETS

    server, reports = plugin_server
    found = [json.loads(p.read_text()) for p in sorted(reports.glob("*.json"))]
    assert found, "no process of SGLang's server reported the plugin"
    assert all(r["mode"] == "detent" and r["error"] is None and not r["failed"] for r in found), found
    wanted = {*TARGETS, guard.TARGET, control.TARGET, rescore.TARGET}  # rescore's: with a report folder
    assert any(set(r["hooks"]) == wanted for r in found), found  # the scheduler's
    assert httpx.get(server.url("/health"), timeout=30).status_code == 200


def test_a_request_beyond_the_plugins_context_fails_alone_and_the_server_serves_on(plugin_server) -> None:
    server, _ = plugin_server
    rng = random.Random(2600)
    long = [rng.randrange(100, 40000) for _ in range(2600)]
    reply = httpx.post(server.url("/generate"), timeout=600, json={
        "input_ids": long, "sampling_params": {"max_new_tokens": 4, "temperature": 0.0}})
    assert reply.status_code == 400, reply.text
    assert "context of 2048 tokens" in reply.text
    short = httpx.post(server.url("/generate"), timeout=600, json={
        "input_ids": long[:50], "sampling_params": {"max_new_tokens": 4, "temperature": 0.0}})
    assert short.status_code == 200 and len(short.json()["output_ids"]) == 4, short.text
    assert server.alive()


def test_sglangs_determinism_test_passes_every_mode_with_the_plugin(plugin_server) -> None:
    server, _ = plugin_server
    results = [bench.run_mode(server.port, mode, **SMALL) for mode in bench.MODES]
    for r in results:
        print(r.mode, r.passed, r.detail)
    assert [r.mode for r in results if not r.passed] == [], results
    assert server.alive()


def test_stock_sglang_fails_its_determinism_test(model, tmp_path, plugin_server) -> None:
    """After the plugin's server (the module's fixture) has stopped: one SGLang at a time."""
    plugin_server[0].stop()
    server = bench.Server(model, False, PORT + 1, tmp_path / "server.log")
    try:
        server.wait_ready(1800)
        results = [bench.run_mode(server.port, mode, **SMALL) for mode in bench.MODES]
    finally:
        server.stop()
    for r in results:
        print(r.mode, r.passed, r.detail)
    assert [r.mode for r in results if not r.passed], results
