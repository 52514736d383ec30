"""A tensor-parallel server whose rank dies mid-stream: the stream ends with an error event, new requests get
503, every answered request has its receipt and no half-written one exists, and SIGTERM leaves no process."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import psutil

from detent_audit.engine.tp_ranks import free_port
from detent_audit.manifests.keys import generate_key, load_trusted_keys
from detent_audit.manifests.receipt import verify_envelope

MODEL = "random:tiny-llama"


def _ranks(server: psutil.Process) -> list[psutil.Process]:
    """The server's rank processes (spawned children; not multiprocessing's resource tracker)."""
    return [p for p in server.children(recursive=True)
            if "spawn_main" in " ".join(p.cmdline()) and "resource_tracker" not in " ".join(p.cmdline())]


def _alive(pids: set[int]) -> dict[int, str]:
    """pid -> command line of each of `pids` still running (not a zombie)."""
    alive = {}
    for pid in pids:
        try:
            p = psutil.Process(pid)
            if p.status() != psutil.STATUS_ZOMBIE:
                alive[pid] = " ".join(p.cmdline())
        except psutil.NoSuchProcess:
            continue
    return alive


def test_a_rank_killed_mid_stream_fails_the_stream_then_503_and_no_process_is_left(tmp_path: Path) -> None:
    key = generate_key(tmp_path / "node.key")
    port = free_port()
    out = tmp_path / "run"
    log = tmp_path / "serve.log"
    cmd = [sys.executable, "-m", "detent_audit.cli", "serve", "--model", MODEL, "--tensor-parallel-size", "2",
           "--signing-key", str(key.private_path), "--manifest-out", str(out), "--port", str(port)]
    with open(log, "wb") as log_file:
        proc = subprocess.Popen(cmd, stdout=log_file, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    server = psutil.Process(proc.pid)
    every_pid: set[int] = set()
    try:
        deadline = time.monotonic() + 300
        while True:
            assert proc.poll() is None, log.read_text()
            assert time.monotonic() < deadline, log.read_text()
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.2)
        ranks = _ranks(server)
        assert len(ranks) == 1, [p.cmdline() for p in ranks]
        every_pid |= {p.pid for p in server.children(recursive=True)}
        body = {"model": MODEL, "prompt": "one two three", "max_tokens": 4, "temperature": 0}
        answered = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
        assert answered.status_code == 200, answered.text
        events = []
        stream = {"model": MODEL, "prompt": "count with me", "max_tokens": 3000, "temperature": 0,
                  "stream": True, "ignore_eos": True}
        with httpx.stream("POST", f"{url}/v1/completions", json=stream, timeout=120) as response:
            for line in response.iter_lines():
                if not line.startswith("data: "):
                    continue
                events.append(line[6:])
                if len(events) == 3:  # tokens are flowing: kill the other rank now
                    ranks[0].kill()
        assert events[-1] == "[DONE]"
        error = json.loads(events[-2])
        assert "error" in error and "rank" in error["error"]["message"], events[-3:]
        again = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
        assert again.status_code == 503, again.text
        assert httpx.get(f"{url}/health", timeout=5).status_code == 503
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=120) is not None
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    deadline = time.monotonic() + 30  # the processes' exits are asynchronous: give a loaded machine time
    while _alive(every_pid) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert _alive(every_pid) == {}, log.read_text()[-2000:]
    receipts = sorted((out / "receipts").glob("*.receipt"))
    assert len(receipts) == 1  # the answered request's, and nothing of the failed stream
    trusted = load_trusted_keys(key.public_path)
    assert verify_envelope(receipts[0].read_bytes(), trusted).receipt.output.token_ids
    assert not [p for p in out.rglob("*") if p.name.endswith((".tmp", ".partial"))]
    assert os.path.isdir(out / "manifests") and list((out / "manifests").glob("*.manifest"))
