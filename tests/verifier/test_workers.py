"""`verify --workers 2` ended by a signal leaves no process behind: its workers (an engine each) and the
multiprocessing resource tracker are gone within seconds of SIGTERM, SIGINT or SIGKILL of the verifier,
checked by process id."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")


def _children(pid: int) -> set[int]:
    found: set[int] = set()
    try:
        for task in Path(f"/proc/{pid}/task").iterdir():
            found |= {int(c) for c in (task / "children").read_text().split()}
    except (FileNotFoundError, ProcessLookupError):
        pass
    return found


def _alive(pid: int) -> bool:
    """Running (a zombie waiting for its reaper counts as gone)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state != "Z"


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except (FileNotFoundError, ProcessLookupError):
        return ""


@pytest.fixture(scope="module")
def receipts(new_node) -> tuple[Path, list[str]]:
    from detent_audit.server.offline import serve_offline

    root, ckpt, key, llm, node = new_node("workers")
    lines = [{"id": f"w{i}", "prompt_token_ids": list(range(3 + i, 40 + i)), "max_tokens": 8, "seed": 7 + i,
              "temperature": 0.8, "ignore_eos": True} for i in range(8)]
    (root / "in.jsonl").write_text("\n".join(json.dumps(x) for x in lines))
    serve_offline(llm, node, root / "in.jsonl", root / "out.jsonl")
    node.close()
    return root / "out", ["--key", str(key.public_path), "--model", str(ckpt), "--cache-dir",
                          str(root / "jit")]


# ~20 s each (a verifier started, then its workers): SIGINT ends them as SIGTERM does, so CI's tier skips it
@pytest.mark.parametrize("signum", [signal.SIGTERM, pytest.param(signal.SIGINT, marks=pytest.mark.slow),
                                    signal.SIGKILL], ids=lambda s: s.name)
def test_verify_workers_die_with_their_parent_on_every_signal(receipts: tuple[Path, list[str]],
                                                              signum: signal.Signals) -> None:
    out, args = receipts
    proc = subprocess.Popen([sys.executable, "-m", "detent_audit.cli", "verify", str(out), "--workers", "2",
                             *args],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    family: set[int] = set()
    try:
        deadline = time.monotonic() + 120
        workers: set[int] = set()
        while len(workers) < 2:  # both spawned: they are starting (importing torch, building engines)
            assert proc.poll() is None, f"verify ended before its workers: {proc.stderr.read().decode()}"
            assert time.monotonic() < deadline, "verify started no workers"
            workers = {c for c in _children(proc.pid) if "spawn_main" in _cmdline(c)}
            time.sleep(0.05)
        family = _children(proc.pid)  # the workers and the resource tracker
        assert workers <= family and any("resource_tracker" in _cmdline(c) for c in family), \
            {c: _cmdline(c) for c in family}
        os.kill(proc.pid, signum)
        proc.wait(60)
        deadline = time.monotonic() + 20
        while any(map(_alive, family)) and time.monotonic() < deadline:
            time.sleep(0.1)
        left = {pid: _cmdline(pid) for pid in family if _alive(pid)}
        assert not left, f"alive {signum.name} after 20 s: {left}"
    finally:
        for pid in {proc.pid, *family, *_children(proc.pid)}:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
        proc.wait(10)


def _keep_an_engine_with_a_child_process(marker: str) -> None:
    """In a verify worker: keep an engine (as `worker_batch` does) that has a process of its own, as SGLang's
    has its scheduler, which runs until the engine is shut down."""
    import multiprocessing

    from detent_audit.verifier import reexecute

    child = multiprocessing.get_context("spawn").Process(target=time.sleep, args=(120,))  # not a daemon
    child.start()

    class EngineWithAProcess:
        def shutdown(self) -> None:
            child.terminate()
            child.join()
            Path(marker).write_text("stopped")

    reexecute._WORKER_ENGINES[("deployment", "tuple")] = EngineWithAProcess()
    reexecute.stop_engines_at_exit()


def test_a_worker_stops_the_engines_it_keeps_as_it_exits(tmp_path: Path) -> None:
    """The pool's shutdown would otherwise wait for the engine's process (a verify of SGLang receipts with two
    workers never ended)."""
    from detent_audit.verifier.workers import worker_pool

    marker = tmp_path / "stopped"
    began = time.monotonic()
    with worker_pool(1) as pool:
        pool.submit(_keep_an_engine_with_a_child_process, str(marker)).result()
    assert time.monotonic() - began < 60 and marker.read_text() == "stopped"
