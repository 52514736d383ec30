"""Verification against serving, per output token, for each engine: `detent-audit serve --engine E` over HTTP
answers N mixed requests from C concurrent clients, then `verify` re-executes the receipts by rescore.

Per engine, in order: the server starts (its start is not timed as serving); for each serving concurrency C
(a closed loop of C clients), N requests, a fresh set per C so that no run reuses another's prompts from the
prefix cache: chat and completion, greedy and seeded sampling, top-n logprobs, stop strings, a shared system
prompt; the wall time from the first request sent to the last answer, over the output tokens the answers
count (`usage.completion_tokens`), is serving's time per output token. The server stops (its run manifest
written); `verify --mode rescore --workers W` checks the whole run folder, every receipt and manifest, in a
child process of its own (one engine per process), which times the engine's start (step 7's rebuild) apart
from the re-execution. Verify's time per output token (all the run's output tokens) over serving's, at each
C: with the engine's start and without it. Every receipt must verify OK.

    python benchmarks/verify_speed.py --engines sglang,embedded,vllm --requests 200 --concurrency 1,8 \
        --out benchmarks/results/verify-speed

Raw outputs under --out/<engine>/ (answers per concurrency, server log, verify's report); the summary is
printed and written to --out/summary.json with the machine's load average at each phase.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

CLI = [str(Path(sys.executable).with_name("detent-audit"))]
ENV = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
MODEL = "smollm2-135m-instruct"
WORDS = ("river mountain lantern copper garden whisper orbit harbor meadow signal violet engine canyon "
         "thunder pepper marble falcon quiet ladder silver autumn cobalt tiger velvet ember puzzle").split()
SYSTEM = "You are a concise assistant. Answer in one or two short sentences and never use lists."
QUESTIONS = ("What is the capital of France?", "Name three colors of the rainbow.", "Why is the sky blue?",
             "Translate 'good morning' into Spanish.", "What is 12 times 7?", "Describe a cat in one line.",
             "Who wrote Romeo and Juliet?", "What does a compiler do?", "Give a synonym for happy.",
             "How many legs does a spider have?")


def requests_for(n: int, seed: int) -> list[tuple[str, dict]]:
    """`n` mixed requests (endpoint, body), reproducible from `seed`."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        body: dict = {"model": MODEL, "max_tokens": rng.randint(8, 40)}
        if i % 3 == 0:
            messages = [{"role": "user", "content": f"{rng.choice(QUESTIONS)} ({rng.choice(WORDS)})"}]
            if i % 2 == 0:
                messages.insert(0, {"role": "system", "content": SYSTEM})
            endpoint, body["messages"] = "/v1/chat/completions", messages
        else:
            words = " ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 60)))
            endpoint, body["prompt"] = "/v1/completions", f"Story {i}: {words}"
        if i % 2 == 1:
            body.update(temperature=rng.choice([0.6, 0.8, 1.0]), top_p=rng.choice([0.9, 0.95, 1.0]),
                        seed=rng.randrange(1 << 31))
        else:
            body["temperature"] = 0.0
        if i % 5 == 2:
            body["stop"] = [".", "\n\n"]
        if i % 4 == 0:
            body["logprobs"] = True if endpoint.endswith("chat/completions") else 3
            if endpoint.endswith("chat/completions"):
                body["top_logprobs"] = 3
        out.append((endpoint, body))
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def load() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def start_server(engine: str, key: Path, run: Path, log: Path,
                 max_model_len: int) -> tuple[subprocess.Popen, str]:
    port = free_port()
    proc = subprocess.Popen([*CLI, "serve", "--engine", engine, "--model", MODEL, "--signing-key", str(key),
                             "--manifest-out", str(run), "--port", str(port),
                             "--max-model-len", str(max_model_len)],
                            env=ENV, stdout=subprocess.DEVNULL, stderr=open(log, "w"))
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 1800
    while True:
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=5) as answer:
                if answer.status == 200:
                    return proc, url
        except (OSError, urllib.error.URLError):
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"the {engine} server did not start (see {log})")
        time.sleep(2)


def post(url: str, endpoint: str, body: dict) -> dict:
    data = json.dumps(body).encode()
    request = urllib.request.Request(url + endpoint, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=1800) as answer:
        return json.loads(answer.read())


def serve_closed_loop(url: str, work: list[tuple[str, dict]], clients: int) -> tuple[float, list[dict]]:
    """`clients` threads each sending the next request when their last was answered; the wall time from the
    first request to the last answer, and the answers in request order."""
    answers: list[dict | None] = [None] * len(work)
    next_index = iter(range(len(work)))
    lock = threading.Lock()
    errors: list[BaseException] = []

    def client() -> None:
        while True:
            with lock:
                i = next(next_index, None)
            if i is None or errors:
                return
            try:
                answers[i] = post(url, *work[i])
            except BaseException as exc:  # noqa: BLE001 - reported after the run
                errors.append(exc)
                return

    threads = [threading.Thread(target=client) for _ in range(clients)]
    began = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    seconds = time.perf_counter() - began
    if errors:
        raise RuntimeError(f"a request failed: {errors[0]!r}")
    return seconds, [a for a in answers if a is not None]


def verify_child(run: str, key: str, workers: int) -> None:
    """In a child process: `verify` of the run folder, the engine's start (step 7's rebuild) timed apart."""
    from detent_audit.manifests.keys import load_trusted_keys
    from detent_audit.verifier import reexecute
    from detent_audit.verifier.verify import verify

    starts: list[float] = []
    rebuild = reexecute._rebuild

    def timed(*args, **kwargs):
        began = time.perf_counter()
        try:
            return rebuild(*args, **kwargs)
        finally:
            starts.append(time.perf_counter() - began)

    reexecute._rebuild = timed
    began = time.perf_counter()
    def progress(done: int, total: int) -> None:
        print(f"verify: {done}/{total} receipts at {time.perf_counter() - began:.0f} s", file=sys.stderr,
              flush=True)

    report = verify([run], load_trusted_keys(Path(key)), mode="rescore", workers=workers, progress=progress)
    seconds = time.perf_counter() - began
    print(json.dumps({"seconds": seconds, "engine_start_seconds": sum(starts), "counts": report.counts(),
                      "exit_code": report.exit_code,
                      "not_ok": [o.to_json() for o in report.outcomes if o.status != "OK"][:20]}))


def run_engine(engine: str, args: argparse.Namespace, key: Path, out: Path) -> dict:
    folder = out / engine
    folder.mkdir(parents=True, exist_ok=True)
    run = folder / "run"
    result: dict = {"engine": engine, "serving": [], "load_at_start": load()}
    began = time.perf_counter()
    proc, url = start_server(engine, key, run, folder / "serve.log", args.max_model_len)
    result["server_start_seconds"] = round(time.perf_counter() - began, 1)
    print(f"{engine}: server up in {result['server_start_seconds']} s", file=sys.stderr, flush=True)
    try:
        for c in args.concurrency:
            work = requests_for(args.requests, seed=1000 + c)
            before = load()
            seconds, answers = serve_closed_loop(url, work, c)
            tokens = sum(a["usage"]["completion_tokens"] for a in answers)
            (folder / f"answers-c{c}.jsonl").write_text("".join(json.dumps(a) + "\n" for a in answers))
            result["serving"].append({"concurrency": c, "requests": len(answers),
                                      "seconds": round(seconds, 2), "output_tokens": tokens,
                                      "ms_per_output_token": 1e3 * seconds / tokens,
                                      "load_before": before, "load_after": load()})
            print(f"{engine}: served {len(answers)} requests at concurrency {c} in {seconds:.1f} s, {tokens} "
                  f"output tokens ({1e3 * seconds / tokens:.1f} ms each)", file=sys.stderr, flush=True)
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=600)
    before = load()
    child = subprocess.run([sys.executable, __file__, "--verify-child", str(run), "--key", str(key) + ".pub",
                            "--workers", str(args.workers)], env=ENV, capture_output=True, text=True)
    (folder / "verify.stderr").write_text(child.stderr)
    if child.returncode != 0:
        raise RuntimeError(f"{engine}: verify's child failed:\n{child.stderr[-3000:]}")
    verified = json.loads(child.stdout.strip().splitlines()[-1])
    (folder / "verify.json").write_text(json.dumps(verified, indent=2))
    tokens = sum(s["output_tokens"] for s in result["serving"])
    verify_s, start_s = verified["seconds"], verified["engine_start_seconds"]
    result["verify"] = {**verified, "workers": args.workers, "output_tokens": tokens, "load_before": before,
                        "load_after": load(), "ms_per_output_token": 1e3 * verify_s / tokens,
                        "ms_per_output_token_without_start": 1e3 * (verify_s - start_s) / tokens}
    for s in result["serving"]:
        s["verify_over_serving"] = result["verify"]["ms_per_output_token"] / s["ms_per_output_token"]
        s["verify_over_serving_without_start"] = (result["verify"]["ms_per_output_token_without_start"]
                                                  / s["ms_per_output_token"])
    print(f"{engine}: verify {verify_s:.1f} s (engine start {start_s:.1f} s), {verified['counts']}",
          file=sys.stderr, flush=True)
    return result


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--engines", default="sglang,embedded,vllm")
    ap.add_argument("--requests", type=int, default=200, help="requests per serving concurrency")
    ap.add_argument("--concurrency", default="1,8", help="serving concurrencies (closed-loop clients)")
    ap.add_argument("--workers", type=int, default=1, help="verify --workers")
    ap.add_argument("--max-model-len", type=int, default=1024)
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/verify-speed"))
    ap.add_argument("--verify-child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--key", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.verify_child:
        verify_child(args.verify_child, args.key, args.workers)
        return 0
    args.concurrency = [int(c) for c in args.concurrency.split(",")]
    args.out.mkdir(parents=True, exist_ok=True)
    key = args.out / "node.key"
    if not key.exists():
        subprocess.run([*CLI, "keygen", "--out", str(key)], env=ENV, check=True, stdout=subprocess.DEVNULL)
    summary = {"machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores",
               "model": MODEL, "requests_per_concurrency": args.requests, "concurrency": args.concurrency,
               "command": " ".join([Path(sys.argv[0]).as_posix(), *sys.argv[1:]]), "engines": []}
    ok = True
    for engine in args.engines.split(","):
        result = run_engine(engine, args, key, args.out)
        summary["engines"].append(result)
        ok = ok and result["verify"]["exit_code"] == 0
        (args.out / "summary.json").write_text(json.dumps(summary, indent=2))
    print("| engine | serving concurrency | serve ms/output token | verify ms/output token (with start) | "
          "verify / serve (with start) | verify / serve (without start) |")
    print("|---|---|---|---|---|---|")
    for r in summary["engines"]:
        v = r["verify"]
        for s in r["serving"]:
            print(f"| {r['engine']} | {s['concurrency']} | {s['ms_per_output_token']:.1f} | "
                  f"{v['ms_per_output_token_without_start']:.1f} ({v['ms_per_output_token']:.1f}) | "
                  f"{s['verify_over_serving']:.2f} | **{s['verify_over_serving_without_start']:.2f}** |")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
