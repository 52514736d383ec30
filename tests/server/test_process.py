"""`detent-audit serve` as a process: a SIGKILL loses no receipt of an answered request; SIGTERM finishes the
responses under way, writes the run manifest and exits."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
import pytest

from detent_audit.manifests.receipt import verify_envelope
from detent_audit.manifests.run_manifest import check_run, verify_run_manifest

if TYPE_CHECKING:
    from conftest import Env

MODEL_NAME = "tiny-llama"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def _serve(env: Env, out: Path, log: Path) -> Iterator[tuple[subprocess.Popen, str]]:
    port = _free_port()
    cmd = [sys.executable, "-m", "detent_audit.cli", "serve", "--model", str(env.checkpoint), "--tuple",
           str(env.tuple_file),
           "--signing-key", str(env.key.private_path), "--manifest-out", str(out), "--port", str(port),
           "--cache-dir", str(env.cache_dir), "--served-model-name", MODEL_NAME]
    with open(log, "wb") as log_file:
        proc = subprocess.Popen(cmd, stdout=log_file, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, f"serve exited with {proc.returncode}: {log.read_text()}"
            assert time.monotonic() < deadline, f"serve did not come up: {log.read_text()}"
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.05)
        yield proc, url
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _post(url: str, i: int, max_tokens: int) -> dict[str, Any]:
    body = {"model": MODEL_NAME, "prompt": f"request {i}:", "max_tokens": max_tokens, "ignore_eos": True,
            "temperature": 0.0 if i % 2 else 0.8, "seed": i}
    r = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def test_sigkill_loses_no_receipt_of_an_answered_request(env: Env, tmp_path: Path) -> None:
    out = tmp_path / "out"
    with _serve(env, out, tmp_path / "serve.log") as (proc, url), ThreadPoolExecutor(24) as pool:
        # lengths 4..280: the short ones are answered while the long ones are still decoding
        futures = [pool.submit(_post, url, i, 4 + 12 * i) for i in range(24)]
        pending = set(futures)
        while sum(f.done() and f.exception() is None for f in futures) < 4:
            assert pending, "every request ended before the kill"
            _, pending = wait(pending, timeout=30, return_when=FIRST_COMPLETED)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    answered = [f.result() for f in futures if f.exception() is None]
    assert 4 <= len(answered) < 24, "the kill should land mid-run"
    files = sorted((out / "receipts").glob("*.receipt"))
    for body in answered:
        path = out / "receipts" / f"{body['receipt_id']}.receipt"
        receipt = verify_envelope(path.read_bytes(), env.trusted).receipt
        assert receipt.request.request_id == body["receipt_id"] == body["id"]
        assert len(receipt.output.token_ids) == body["usage"]["completion_tokens"]
    for path in files:  # whatever else is named *.receipt is complete (partial writes keep a .tmp- name)
        verify_envelope(path.read_bytes(), env.trusted)
    assert not list((out / "manifests").glob("*.manifest"))  # no shutdown ran


def test_sigterm_finishes_responses_then_writes_the_run_manifest(env: Env, tmp_path: Path) -> None:
    out = tmp_path / "out"
    with _serve(env, out, tmp_path / "serve.log") as (proc, url), ThreadPoolExecutor(4) as pool:
        answered = [_post(url, i, 3) for i in range(3)]
        in_flight = [pool.submit(_post, url, 10 + i, 150) for i in range(2)]
        deadline = time.monotonic() + 30
        while httpx.get(f"{url}/health").json()["outstanding"] < 2:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        proc.send_signal(signal.SIGTERM)
        answered += [f.result() for f in in_flight]  # finished, not cut off
        assert proc.wait(timeout=60) in (0, -signal.SIGTERM)
    (manifest_file,) = (out / "manifests").glob("*.manifest")
    manifest = verify_run_manifest(manifest_file.read_bytes(), env.trusted).manifest
    receipts = [verify_envelope(p.read_bytes(), env.trusted).receipt
                for p in (out / "receipts").glob("*.receipt")]
    assert sorted(r.request.request_id for r in receipts) == sorted(b["receipt_id"] for b in answered)
    check_run(manifest, receipts)
    assert not [p for p in os.listdir(out / "receipts") if not p.endswith(".receipt")]


def test_serve_input_file_offline_and_argument_errors(env: Env, tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from detent_audit.cli import app

    requests = tmp_path / "prompts.jsonl"
    requests.write_text('{"id": "a", "prompt": "hello", "max_tokens": 3}\n'
                        '{"id": "b", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}\n')
    base = ["serve", "--model", str(env.checkpoint),
            "--signing-key", str(env.key.private_path), "--cache-dir",
            str(env.cache_dir), "--manifest-out", str(tmp_path / "out")]
    result = CliRunner().invoke(app, [*base, "--input", str(requests),
                                      "--output", str(tmp_path / "out.jsonl")])
    assert result.exit_code == 0, result.output
    lines = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert [line["id"] for line in lines] == ["a", "b"]
    for line in lines:
        receipt_file = tmp_path / "out" / "receipts" / f"{line['receipt_id']}.receipt"
        verify_envelope(receipt_file.read_bytes(), env.trusted)
    assert len(list((tmp_path / "out" / "manifests").glob("*.manifest"))) == 1

    result = CliRunner().invoke(app, [*base, "--input", str(requests)])
    assert result.exit_code == 2 and "--input and --output go together" in result.output
    loose = tmp_path / "loose.key"
    loose.write_bytes(env.key.private_path.read_bytes())
    loose.chmod(0o644)
    result = CliRunner().invoke(app, [*base[:3], "--signing-key", str(loose), *base[5:]])
    assert result.exit_code == 2 and "too open" in result.output


@pytest.mark.parametrize(("line", "says"), [
    ('{"id": "../../escaped", "prompt": "hi"}', "cannot name a receipt file"),
    ('{"id": "a/b", "prompt": "hi"}', "cannot name a receipt file"),
    ('{"id": "' + "x" * 200 + '", "prompt": "hi"}', "cannot name a receipt file"),
    ('{"id": true, "prompt": "hi"}', "cannot name a receipt file"),
    ('{"prompt_token_ids": [99999999, 5]}', "token ids in [0,"),
    ('{"prompt_token_ids": "abc"}', "token ids in [0,"),
    ('{"prompt_token_ids": []}', "the prompt is empty"),
    ('{"prompt": [1, 2]}', "'prompt' must be a string"),
    ('{"messages": "hello"}', "'messages' must be a non-empty list"),
    ('{"messages": [{"role": "wizard", "content": "x"}]}', "messages[0]"),
    ('{"prompt": "hi", "max_tokens": 100000}', "beyond the model's context"),
    ('{"prompt": "hi", "stop_token_ids": [-1]}', "stop_token_ids"),
    ('{"prompt": "hi", "max_tokens": "3"}', "max_tokens"),
    ('{"prompt": "a\\ud800b"}', "lone surrogate"),
    ('{"prompt": "a", "prompt": "b"}', "appears more than once"),
])
def test_serve_input_refuses_a_bad_line_before_serving(env: Env, tmp_path: Path, line: str,
                                                       says: str) -> None:
    """Each bad line is exit 2 with its file:line and the reason, before any request is served or signed (the
    HTTP server's checks, and ids that must name a file inside receipts/)."""
    from typer.testing import CliRunner

    from detent_audit.cli import app

    requests = tmp_path / "prompts.jsonl"
    requests.write_text('{"id": "fine", "prompt": "hello", "max_tokens": 2}\n' + line + "\n")
    result = CliRunner().invoke(app, ["serve", "--model", str(env.checkpoint),
                                      "--signing-key", str(env.key.private_path),
                                      "--cache-dir", str(env.cache_dir),
                                      "--manifest-out", str(tmp_path / "out"),
                                      "--input", str(requests), "--output", str(tmp_path / "out.jsonl")])
    assert result.exit_code == 2, result.output
    assert "prompts.jsonl:2" in result.output and says in result.output, result.output
    assert result.exception is None or isinstance(result.exception, SystemExit)
    assert not list((tmp_path / "out" / "receipts").iterdir())
    assert not list(tmp_path.glob("**/*.receipt"))


def test_serve_input_reruns_outputs_and_top_logprobs(env: Env, tmp_path: Path) -> None:
    """A second run into the same folder is refused up front (its ids have receipts); an output file in a
    missing folder, an output that is a folder and a manifest folder that is a file are exit 2; `logprobs: n`
    brings the top-n alternatives into the output line."""
    from typer.testing import CliRunner

    from detent_audit.cli import app

    requests = tmp_path / "prompts.jsonl"
    requests.write_text('{"id": "a", "prompt": "hello", "max_tokens": 3, "logprobs": 2}\n'
                        '{"id": "b", "prompt_token_ids": [5, 6, 7], "max_tokens": 2}\n')
    base = ["serve", "--model", str(env.checkpoint),
            "--signing-key", str(env.key.private_path), "--cache-dir",
            str(env.cache_dir), "--input", str(requests)]

    def serve(out: Path, output: Path):
        return CliRunner().invoke(app, [*base, "--manifest-out", str(out), "--output", str(output)])

    assert serve(tmp_path / "out", tmp_path / "out.jsonl").exit_code == 0
    a, b = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert len(a["top_logprobs"]) == 3 and all(len(top) == 2 for top in a["top_logprobs"])
    assert all(top[0][1] >= top[1][1] for top in a["top_logprobs"]) and "top_logprobs" not in b
    again = serve(tmp_path / "out", tmp_path / "again.jsonl")
    assert again.exit_code == 2 and "already have a receipt" in again.output
    assert not (tmp_path / "again.jsonl").exists()
    missing = serve(tmp_path / "out2", tmp_path / "nowhere" / "out.jsonl")
    assert missing.exit_code == 2 and "does not exist" in missing.output
    assert serve(tmp_path / "out2", tmp_path).exit_code == 2
    (tmp_path / "a-file").write_text("")
    clash = serve(tmp_path / "a-file", tmp_path / "out3.jsonl")
    assert clash.exit_code == 2 and "is a file" in clash.output


def test_serve_offline_reports_progress_per_answered_request(env: Env, tmp_path: Path) -> None:
    from detent_audit.engine.llm import LLM
    from detent_audit.manifests.keys import load_private_key
    from detent_audit.server.node import ServingNode
    from detent_audit.server.offline import serve_offline

    requests = tmp_path / "prompts.jsonl"
    requests.write_text("\n".join(json.dumps({"id": f"q{i}", "prompt_token_ids": [3 + i, 4],
                                              "max_tokens": 1 + i})
                                  for i in range(5)))
    llm = LLM(env.engine_config())
    node = ServingNode(llm, load_private_key(env.key.private_path), tmp_path / "out")
    calls: list[tuple[int, int]] = []
    assert serve_offline(llm, node, requests, tmp_path / "out.jsonl",
                         progress=lambda d, t: calls.append((d, t))) == 5
    assert calls == [(i, 5) for i in range(1, 6)]  # one call per answered request, in order, out of the five
