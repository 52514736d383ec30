"""Manifests that cannot go missing, failures clients understand (numbers: the defects these tests hold)."""

from __future__ import annotations

import errno
import json
import shutil
import sys
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
import pytest
from typer.testing import CliRunner

from detent_audit.cli import app
from detent_audit.errors import BadInput
from detent_audit.manifests.keys import load_private_key
from detent_audit.manifests.receipt import verify_envelope
from detent_audit.manifests.run_manifest import RunManifest, sign_run_manifest, verify_run_manifest
from detent_audit.server import node as node_module
from detent_audit.server.node import ServingNode
from detent_audit.server.offline import serve_offline

if TYPE_CHECKING:
    from conftest import Env

MODEL_NAME = "tiny-llama"
runner = CliRunner()


def _serve_lines(llm: Any, node: ServingNode, tmp: Path, ids: list[str], name: str = "in") -> None:
    lines = [{"id": i, "prompt_token_ids": [3 + n, 4, 5], "max_tokens": 2, "ignore_eos": True}
             for n, i in enumerate(ids)]
    (tmp / f"{name}.jsonl").write_text("\n".join(json.dumps(x) for x in lines))
    serve_offline(llm, node, tmp / f"{name}.jsonl", tmp / f"{name}.out.jsonl")


def _verify(env: Env, *paths: Path) -> tuple[int, dict]:
    res = runner.invoke(app, ["verify", *map(str, paths), "--key", str(env.key.public_path), "--model",
                              str(env.checkpoint), "--cache-dir", str(env.cache_dir), "--json"])
    return res.exit_code, json.loads(res.stdout)


@pytest.fixture(scope="module")
def llm(env: Env) -> Any:
    from detent_audit.engine.llm import LLM

    return LLM(env.engine_config())


def test_5_a_killed_runs_receipts_are_sealed_on_restart_and_coverage_is_checked(env: Env, llm: Any,
                                                                               tmp_path: Path) -> None:
    """A run killed before its manifest (close never ran) leaves receipts in no manifest: verify of the folder
    FAILs each of them; the next node on the folder seals them into a recovery manifest, and verify passes
    with every receipt covered."""
    key = load_private_key(env.key.private_path)
    out = tmp_path / "out"
    killed = ServingNode(llm, key, out, rotate=2)
    _serve_lines(llm, killed, tmp_path, ["a", "b", "c", "d", "e"])  # 2 rotations, "e" in no manifest
    killed._lock_fd and __import__("os").close(killed._lock_fd)  # what a SIGKILL does to the lock
    killed._lock_fd = None
    code, report = _verify(env, out)
    uncovered = [o for o in report["outcomes"] if o["kind"] == "coverage"]
    assert code == 1 and [o["request_id"] for o in uncovered] == ["e"], report
    assert report["coverage"]["covered"] == 4 and len(report["coverage"]["uncovered"]) == 1
    restarted = ServingNode(llm, key, out)
    assert len(restarted.recovered) == 1 and restarted.recovered[0].name.endswith("-recovery.manifest")
    restarted.close()
    code, report = _verify(env, out)
    assert code == 0 and report["coverage"] == {"receipts": 5, "covered": 5, "manifests": 3, "uncovered": [],
                                        "gaps": []}, report


def test_5_a_manifest_that_omits_a_receipt_of_its_range_fails(env: Env, llm: Any, tmp_path: Path) -> None:
    key = load_private_key(env.key.private_path)
    out = tmp_path / "out"
    node = ServingNode(llm, key, out)
    _serve_lines(llm, node, tmp_path, ["a", "b", "c", "d", "e"])
    node.close()
    receipts = [verify_envelope(p.read_bytes(), env.trusted).receipt
                for p in sorted((out / "receipts").glob("*"))]
    (manifest_file,) = (out / "manifests").glob("*.manifest")
    manifest = verify_run_manifest(manifest_file.read_bytes(), env.trusted).manifest
    # a signed manifest of four of the five: a recovery manifest may skip a number, but not a receipt present
    four = RunManifest.for_receipts([r for r in receipts if r.request.request_id != "c"],
                                    run_id=manifest.run_id,
                                    node_keyid=manifest.node_keyid, deployment_hash=manifest.deployment_hash,
                                    tuple_hash=manifest.tuple_hash, time_unix_ns=manifest.time_unix_ns,
                                    kind="recovery")
    manifest_file.write_bytes(sign_run_manifest(four, key))
    code, report = _verify(env, out)
    (m,) = [o for o in report["outcomes"] if o["kind"] == "manifest"]
    assert code == 1 and m["status"] == "FAIL", m
    assert "omits 1 receipt(s) present in its range" in m["message"], m


def test_5_one_server_per_folder_and_manifest_names_never_collide(env: Env, llm: Any, tmp_path: Path) -> None:
    key = load_private_key(env.key.private_path)
    out = tmp_path / "out"
    first = ServingNode(llm, key, out)
    with pytest.raises(BadInput, match="in use by another server"):
        ServingNode(llm, key, out)
    _serve_lines(llm, first, tmp_path, ["a"], "one")
    name_1 = first.close()
    assert name_1 is not None
    shutil.move(name_1, tmp_path / "moved.manifest")  # moved away: the next run must not reuse its name
    second = ServingNode(llm, key, out)  # (seals "a" again in a recovery manifest: its manifest is gone)
    _serve_lines(llm, second, tmp_path, ["b"], "two")
    name_2 = second.close()
    names = sorted(p.name for p in (out / "manifests").glob("*.manifest"))
    assert name_1.name not in names and name_2.name in names and len(names) == 2
    shutil.move(tmp_path / "moved.manifest", name_1)
    code, report = _verify(env, out)
    assert code == 0 and report["coverage"]["uncovered"] == [], report


def test_5_one_request_id_in_two_manifests_of_a_run_fails(env: Env, llm: Any, tmp_path: Path) -> None:
    """Two receipts of one run answering one request id, each in a manifest of its own: FAIL across
    manifests."""
    import dataclasses

    from detent_audit.manifests.receipt import RunRecord, sign_receipt

    key = load_private_key(env.key.private_path)
    out = tmp_path / "out"
    node = ServingNode(llm, key, out)
    _serve_lines(llm, node, tmp_path, ["a", "b"])
    node.close()
    a, b = (verify_envelope((out / "receipts" / f"{i}.receipt").read_bytes(), env.trusted).receipt
            for i in "ab")
    again = dataclasses.replace(b, request=dataclasses.replace(b.request, request_id="a"),
                                run=RunRecord(a.run.run_id, 7))
    (out / "again").mkdir()
    (out / "again" / "a.receipt").write_bytes(sign_receipt(again, key))
    m = RunManifest.for_receipts([again], run_id=a.run.run_id, node_keyid=a.node_keyid,
                                 deployment_hash=a.deployment_hash, tuple_hash=a.tuple_hash, time_unix_ns=1,
                                 kind="rotation")
    (out / "manifests" / "other.manifest").write_bytes(sign_run_manifest(m, key))
    code, report = _verify(env, out)
    cov = [o for o in report["outcomes"] if o["kind"] == "coverage"]
    assert code == 1 and any("request id" in o["message"] and "'a'" in o["message"] for o in cov), report


def _full_disk(monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """Every receipt or manifest write fails with ENOSPC while the returned flag is set."""
    full = [True]
    real = node_module.write_atomically

    def write(path, data):
        if full[0]:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(path, data)

    monkeypatch.setattr(node_module, "write_atomically", write)
    return full


def test_6_a_full_disk_is_a_507_an_error_event_and_unhealthy_and_shutdown_survives(
        env: Env, serve_live: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    body = {"model": MODEL_NAME, "prompt": [3, 1, 4], "max_tokens": 3, "ignore_eos": True}
    with serve_live(tmp_path / "out") as live:
        ok = httpx.post(f"{live.url}/v1/completions", json=body, timeout=30)
        assert ok.status_code == 200 and ok.json()["receipt"]["digest"]
        assert ok.headers["x-detent-receipt-digest"]
        full = _full_disk(monkeypatch)
        r = httpx.post(f"{live.url}/v1/completions", json=body, timeout=30)
        assert r.status_code == 507 and r.json()["error"]["code"] == "insufficient_storage", r.text
        assert r.headers["content-type"] == "application/json"
        health = httpx.get(f"{live.url}/health")
        assert health.status_code == 503 and health.json()["status"] == "storage_failed"
        r = httpx.post(f"{live.url}/v1/completions", json=body, timeout=30)  # refused before computing
        assert r.status_code == 507
        full[0] = False  # space again: the next write succeeds and health recovers
        live.node.storage_error = None
        with httpx.stream("POST", f"{live.url}/v1/completions", json={**body, "stream": True},
                          timeout=30) as s:
            full[0] = True
            events = [line for line in s.iter_lines() if line.startswith("data: ")]
        assert events[-1] == "data: [DONE]" and "insufficient_storage" in events[-2], events
        # shutdown with the disk still full: no exception, the final manifest reported as not written
    assert "the final run manifest was not written" in capsys.readouterr().err
    assert len(list((tmp_path / "out" / "receipts").glob("*.receipt"))) == 1


def test_7_bodies_share_one_in_flight_budget_and_json_is_parsed_off_the_event_loop(
        env: Env, serve_live: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from detent_audit.server import bodies as app_module

    monkeypatch.setattr(app_module, "MAX_INFLIGHT_BODY_BYTES", 24 << 20)
    big = b'{"model": "tiny-llama", "prompt": [1], "user": "' + b"x" * (8 << 20) + b'"}'

    def slow_body(chunks: int = 16):  # a client that sends its 8 MiB slowly: it holds budget meanwhile
        part = len(big) // chunks
        for i in range(chunks):
            yield big[i * part:(i + 1) * part] if i < chunks - 1 else big[i * part:]
            time.sleep(0.1)

    with serve_live(tmp_path / "out") as live:
        results: list[int] = []

        def send() -> None:
            r = httpx.post(f"{live.url}/v1/completions", content=slow_body(), timeout=60)
            results.append(r.status_code)

        threads = [threading.Thread(target=send) for _ in range(3)]
        for t in threads:
            t.start()
        time.sleep(0.5)
        start = time.monotonic()
        assert httpx.get(f"{live.url}/health", timeout=10).status_code == 200
        health_s = time.monotonic() - start
        for t in threads:
            t.join()
    # 3 x 8 MiB (held twice: the chunks and the joined body) pass a 24 MiB budget: some are refused, 503
    assert 503 in results and health_s < 2.0, (results, health_s)
    assert all(code in (200, 400, 503) for code in results), results



def test_a_freed_disk_is_written_again_without_a_restart_and_health_follows(
        env: Env, serve_live: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Once space is freed the next request's receipt is written (no 507 until a restart), and /health says
    ok."""
    body = {"model": MODEL_NAME, "prompt": [3, 1, 4], "max_tokens": 3, "ignore_eos": True}
    with serve_live(tmp_path / "out") as live:
        full = _full_disk(monkeypatch)
        assert httpx.post(f"{live.url}/v1/completions", json=body, timeout=30).status_code == 507
        assert httpx.get(f"{live.url}/health").json()["status"] == "storage_failed"
        still_full = httpx.post(f"{live.url}/v1/completions", json=body, timeout=30)
        assert still_full.status_code == 507
        full[0] = False  # space again
        health = httpx.get(f"{live.url}/health")
        assert health.status_code == 200 and health.json()["status"] == "ok", health.text
        r = httpx.post(f"{live.url}/v1/completions", json=body, timeout=30)
        assert r.status_code == 200, r.text
        receipts = list((tmp_path / "out" / "receipts").glob("*.receipt"))
        assert [p.stem for p in receipts] == [r.json()["receipt_id"]]
        full[0] = True  # full again, then freed: a streamed request recovers as well
        assert httpx.post(f"{live.url}/v1/completions", json=body, timeout=30).status_code == 507
        full[0] = False
        streamed = {**body, "stream": True}
        with httpx.stream("POST", f"{live.url}/v1/completions", json=streamed, timeout=30) as s:
            events = [line for line in s.iter_lines() if line.startswith("data: ")]
        assert events[-1] == "data: [DONE]" and '"receipt_id"' in events[-2], events
        assert not list((tmp_path / "out").glob(node_module.PROBE_NAME))


def test_stalled_uploads_time_out_and_never_starve_other_requests(
        env: Env, serve_live: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two clients that send all but the last byte of a 64 MiB body and stall held the whole body budget:
    every other request got a 503 for as long as they stayed connected, while /health said ok. Small requests
    are read from a reserve the large ones cannot take, and a stalled body is cut off (408) after the read
    timeout, its budget given back."""
    import socket
    import urllib.parse

    from detent_audit.server import bodies

    monkeypatch.setattr(bodies, "BODY_IDLE_TIMEOUT_S", 4.0)
    size = bodies.MAX_BODY_BYTES
    prefix = b'{"model": "tiny-llama", "prompt": [1], "user": "'

    def upload(sock: socket.socket) -> None:
        try:
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Content-Length: %d\r\n\r\n" % size)
            sock.sendall(prefix + b"x" * (size - 1 - len(prefix)))  # all but the last byte, then nothing
        except OSError:  # refused (503) while sending: the server closed the connection
            pass

    def body_bytes() -> Any:
        return httpx.get(f"{live.url}/health", timeout=10).json().get("request_body_bytes")

    with serve_live(tmp_path / "out") as live:
        where = urllib.parse.urlsplit(live.url)
        stalled = [socket.create_connection((where.hostname, where.port)) for _ in range(2)]
        senders = [threading.Thread(target=upload, args=(sock,)) for sock in stalled]
        for t in senders:
            t.start()
        for t in senders:
            t.join(60)
        before, now = -1, body_bytes()
        while now != before:  # until the server has read what it will of them
            time.sleep(0.5)
            before, now = now, body_bytes()
        small = {"model": MODEL_NAME, "prompt": [5, 6, 7], "max_tokens": 2, "ignore_eos": True}
        r = httpx.post(f"{live.url}/v1/completions", json=small, timeout=30)
        assert r.status_code == 200, r.text
        answers = []
        for sock in stalled:
            sock.settimeout(30)
            try:
                answers.append(sock.recv(64)[:12])
            except ConnectionResetError:  # refused while sending: the reset can overtake the 503
                answers.append(b"reset")
            sock.close()
        assert b"HTTP/1.1 408" in answers, answers
        assert set(answers) <= {b"HTTP/1.1 408", b"HTTP/1.1 503", b"reset"}, answers
        health = httpx.get(f"{live.url}/health").json()
        assert health["status"] == "ok" and health["request_body_bytes"] == 0, health

@pytest.mark.slow
def test_5_sigkill_under_load_every_answer_has_a_receipt_and_every_receipt_a_manifest(env: Env,
                                                                                     tmp_path: Path) -> None:
    """The benchmark's loop (benchmarks/sigkill_serving.py), two kills."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    from sigkill_serving import run

    result = run(2, env.checkpoint, tmp_path, seed=3, clients=4)
    assert result["answered"] > 0 and result["answered_without_receipt"] == 0
    assert result["verify_exit_code"] == 0 and result["coverage"]["uncovered"] == []
    assert result["coverage"]["covered"] == result["receipts"] and result["recovery_manifests"] >= 1


def test_serve_input_refuses_too_many_stop_token_ids_before_serving_any_line(env: Env, llm: Any,
                                                                           tmp_path: Path) -> None:
    """A line of 1,025 stop token ids was served and then failed at signing, stopping the run midway with a
    traceback: it is refused with the other bad lines, before any request is served (no receipt written)."""
    node = ServingNode(llm, load_private_key(env.key.private_path), tmp_path / "out")
    lines = [{"id": "fine", "prompt_token_ids": [5, 6], "max_tokens": 2},
             {"id": "many", "prompt_token_ids": [5, 6], "max_tokens": 2,
              "stop_token_ids": [i % 300 for i in range(1025)]}]
    (tmp_path / "in.jsonl").write_text("\n".join(json.dumps(x) for x in lines))
    with pytest.raises(BadInput, match=r"in\.jsonl:2: .*stop_token_ids.* 1025 token ids, more than the 1024"):
        serve_offline(llm, node, tmp_path / "in.jsonl", tmp_path / "out.jsonl")
    node.close()
    assert not list((tmp_path / "out" / "receipts").glob("*.receipt"))
