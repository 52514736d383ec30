"""The evaluation audit on a real model: lm-eval against `detent-audit serve`, then `verify-eval`.

One run, in order: (1) serve the model in detent mode; lm-eval runs the shipped tasks (examples/eval: the
generate_until and the multiple-choice variant) through /v1/completions with --log_samples, timed (lm-eval's
serving time); (2) `verify-eval` on its output and receipts, timed; (3) the multiple-choice task again at
num_concurrent 1 and 8 (batch size 1), on a detent server and on a stock server, and the per-sample logprobs
compared bit for bit between the two concurrencies. Raw outputs (lm-eval's folders, verify-eval's JSON, the
comparison) go under --out; a summary JSON is printed and written there.

    python benchmarks/eval_audit.py --model smollm2-135m-instruct --out benchmarks/results/eval-smollm2
    python benchmarks/eval_audit.py --model smollm2-135m-instruct --only-concurrency \
        --out benchmarks/results/eval-smollm2-concurrency     # (3) alone, detent then stock
    python benchmarks/eval_audit.py --model smollm2-135m-instruct --only-concurrency --modes stock,detent \
        --threads 2 --concurrency-limit 10 --out benchmarks/results/eval-smollm2-concurrency-2-threads
    python benchmarks/eval_audit.py --model smollm2-135m-instruct --limit 8 --modes "" \
        --out benchmarks/results/eval-smollm2-verify-time     # (1), (2) only: verify-eval over serving time
    python benchmarks/eval_audit.py --model smollm2-135m-instruct --engine vllm --tasks detent_qa_mc \
        --limit 8 --modes "" --out benchmarks/results/eval-smollm2-vllm-mc   # (1), (2) on serve --engine vllm

Each concurrency run also records the server's steps by how many sequences shared each (from /health).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TASKS = ROOT / "examples" / "eval"
CLI = [str(Path(sys.executable).with_name("detent-audit"))]
ENV = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve(model: str, key: Path, out: Path, mode: str, name: str,
          threads: int, engine: str = "embedded") -> tuple[subprocess.Popen, str]:
    port = free_port()
    proc = subprocess.Popen([*CLI, "serve", "--engine", engine, "--model", model,
                             "--signing-key", str(key), "--manifest-out", str(out),
                             "--mode", mode, "--port", str(port), "--served-model-name", name,
                             "--threads", str(threads)],
                            env=ENV, stdout=subprocess.DEVNULL,
                            stderr=open(out.parent / f"serve-{mode}.log", "w"))
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 900
    while True:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1):
                return proc, url
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the {mode} server did not start") from None
            time.sleep(1)


def lm_eval(url: str, model: str, name: str, out: Path, tasks: str, *, limit: int | None, batch_size: int,
            concurrent: int) -> float:
    args = (f"model={name},base_url={url}/v1/completions,tokenizer={model},tokenizer_backend=huggingface,"
            f"num_concurrent={concurrent}")
    cmd = [sys.executable, "-m", "lm_eval", "--model", "local-completions", "--model_args", args,
           "--include_path", str(TASKS), "--tasks", tasks, "--batch_size", str(batch_size),
           "--output_path", str(out), "--log_samples"] + (["--limit", str(limit)] if limit else [])
    start = time.perf_counter()
    with open(out.parent / f"{out.name}.log", "w") as log:
        subprocess.run(cmd, env=ENV, check=True, stdout=log, stderr=subprocess.STDOUT)
    return time.perf_counter() - start


def step_batch_sizes(url: str) -> dict[int, int]:
    """The server's steps so far by how many sequences shared each (its /health counts them)."""
    with urllib.request.urlopen(f"{url}/health", timeout=30) as answer:
        return {int(n): c for n, c in json.load(answer).get("step_batch_sizes", {}).items()}


def steps_between(before: dict[int, int], after: dict[int, int]) -> dict[str, int]:
    return {str(n): after[n] - before.get(n, 0) for n in sorted(after) if after[n] - before.get(n, 0)}


def per_sample(run: Path, task: str) -> dict[str, list]:
    [path] = run.rglob(f"samples_{task}_*.jsonl")
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    return {f"{row['doc_id']}": row["resps"] for row in rows}


def new_receipts(node: Path, before: set[str]) -> list[Path]:
    folder = node / "receipts"
    return sorted(p for p in folder.iterdir() if p.name not in before) if folder.is_dir() else []


def receipt_names(node: Path) -> set[str]:
    folder = node / "receipts"
    return {p.name for p in folder.iterdir()} if folder.is_dir() else set()


def receipts_by_prompt(paths: list[Path], key: Path) -> tuple[dict[tuple, dict], list[int]]:
    """The generations among `paths` by prompt ids (tokens and fp32 logprob bits), and every prompt's
    length."""
    from detent_audit.manifests.dsse import read_envelope_bytes
    from detent_audit.manifests.keys import load_trusted_keys
    from detent_audit.manifests.receipt import verify_envelope

    trusted = load_trusted_keys(Path(f"{key}.pub"))
    generations, lengths = {}, []
    for p in paths:
        r = verify_envelope(read_envelope_bytes(p), trusted).receipt
        lengths.append(len(r.request.prompt_token_ids))
        if r.scoring is None:
            generations[tuple(r.request.prompt_token_ids)] = {
                "tokens": list(r.output.token_ids), "logprob_bits": r.output.logprobs_f32le.hex(),
                "text": r.output.text}
    return generations, lengths


def concurrency_runs(spec: str, model: str, name: str, key: Path, out: Path, mode: str, limit: int,
                     threads: int, url: str | None = None) -> dict:
    """Both tasks at num_concurrent 1 and 8 (batch size 1) on one server of `mode` (started here unless
    `url`): the multiple-choice task's logged per-sample responses compared between the two, the generate
    task's per-sample output tokens and logprob bits compared from the receipts (lm-eval logs only a
    generation's text), each run's wall time, and how many sequences shared each of the engine's steps in each
    run (whether concurrency 8 co-batched at all: prefills of the scored prompts, decode steps of the
    generations)."""
    seconds, steps, receipts = {}, {}, {}
    node = out / f"{mode}-node"
    proc = None
    if url is None:
        proc, url = serve(spec, key, node, mode, name, threads)
    try:
        for c in (1, 8):
            before, names = step_batch_sizes(url), receipt_names(node)
            seconds[c] = lm_eval(url, model, name, out / f"{mode}-c{c}", "detent_qa_mc,detent_qa_gen",
                                 limit=limit, batch_size=1, concurrent=c)
            steps[c] = steps_between(before, step_batch_sizes(url))
            receipts[c] = new_receipts(node, names)
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(120)
    one, eight = (per_sample(out / f"{mode}-c{c}", "detent_qa_mc") for c in (1, 8))
    requests = [(doc, i) for doc in sorted(one, key=int) for i in range(len(one[doc]))]
    differ = [{"doc": int(doc), "choice": i, "c1": one[doc][i], "c8": eight[doc][i]} for doc, i in requests
              if one[doc][i] != eight[doc][i]]
    (gen1, lengths), (gen8, _) = (receipts_by_prompt(receipts[c], key) for c in (1, 8))
    gen_differ = [{"prompt_tokens": len(p), "c1": gen1[p],
                   "c8": gen8.get(p)} for p in gen1 if gen1[p] != gen8.get(p)]
    return {"requests": len(requests), "differ": len(differ),
            "docs_differing": len({d["doc"] for d in differ}),
            "where": differ, "generations": len(gen1), "generations_differing": len(gen_differ),
            "generations_differing_text": sum(d["c8"] is None or d["c1"]["text"] != d["c8"]["text"]
                                              for d in gen_differ),
            "generations_where": gen_differ, "receipts": {f"c{c}": len(r) for c, r in receipts.items()},
            "prompt_tokens": {"min": min(lengths), "max": max(lengths)},
            "seconds": {f"c{c}": s for c, s in seconds.items()},
            "step_batch_sizes": {f"c{c}": s for c, s in steps.items()}, "threads": threads}


def gemm_invariant_rows(model: str) -> dict[str, int]:
    """Per thread count (1, 2): the fewest rows from which torch's fp32 F.linear gives a row the same bits at
    every M tried, on the model's GEMM shapes (the engine's own probe, kernels/gemm_probe.py)."""

    from detent_audit.engine.llm import LLM, EngineConfig
    from detent_audit.kernels.gemm_probe import check
    from detent_audit.kernels.params import GEMM_PAD_ROWS_SPACE, GemmParams
    from detent_audit.runtime.threads import set_threads

    shapes = tuple(LLM(EngineConfig(model=model, mode="stock")).model.gemm_shapes())
    found = {}
    # the probe's walk (least_pad_rows), also at two threads, where the engine refuses pad
    for threads in (1, 2):
        set_threads(threads)
        floor, found[str(threads)] = 0, 0
        for rows in GEMM_PAD_ROWS_SPACE:
            if rows > floor:
                failure = check(GemmParams(rows, "pad"), shapes).failure
                if failure is None:
                    found[str(threads)] = rows
                    break
                floor = failure[1]
    return found


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True, help="checkpoint folder, or a `--model` name of the project "
                    "(smollm2-135m-instruct: its imported folder is lm-eval's tokenizer)")
    ap.add_argument("--name", default="model", help="served model name")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--batch-size", type=int, default=4, help="lm-eval's batch (prompts per request)")
    ap.add_argument("--concurrency-limit", type=int, default=20, help="documents of the 1-vs-8 comparison")
    ap.add_argument("--only-concurrency", action="store_true", help="run only (3), the 1-vs-8 comparison")
    ap.add_argument("--modes", default="detent,stock", help="modes of the 1-vs-8 comparison, in run order")
    ap.add_argument("--threads", type=int, default=1,
                    help="engine threads of every server (a bit-relevant fact)")
    ap.add_argument("--limit", type=int, default=None,
                    help="documents per task of the full run (1); all if unset")
    ap.add_argument("--engine", default="embedded", help="the engine of the full run's server (1): embedded, "
                                                         "vllm or sglang")
    ap.add_argument("--tasks", default="detent_qa_gen,detent_qa_mc", help="the full run's tasks (1)")
    args = ap.parse_args()
    from detent_audit.runtime.named_models import resolve_model

    model = str(resolve_model(args.model).path)  # the folder lm-eval's tokenizer reads
    out = args.out
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    key = out / "node.key"
    subprocess.run([*CLI, "keygen", "--out", str(key)], env=ENV, check=True, stdout=subprocess.DEVNULL)
    summary: dict = {"model": args.model, "folder": model, "machine": os.uname().nodename,
                     "cpus": os.cpu_count(), "threads": args.threads, "limit": args.limit,
                     "engine": args.engine, "tasks": args.tasks,
                     "load_average_at_start": os.getloadavg()}
    modes = [m for m in args.modes.split(",") if m]

    if not args.only_concurrency:
        # (1) and (3, detent): one detent server
        node = out / "detent-node"
        proc, url = serve(args.model, key, node, "detent", args.name, args.threads, args.engine)
        try:
            summary["lm_eval_seconds"] = lm_eval(url, model, args.name, out / "lm-eval", args.tasks,
                                                 limit=args.limit, batch_size=args.batch_size, concurrent=1)
            if "detent" in modes:
                summary["concurrency_1_vs_8_detent"] = concurrency_runs(
                    args.model, model, args.name, key, out, "detent", args.concurrency_limit, args.threads,
                    url)
        finally:
            proc.terminate()
            proc.wait(120)
        # (2): verify-eval on the full run
        start = time.perf_counter()
        done = subprocess.run([*CLI, "verify-eval", str(out / "lm-eval"), "--receipts",
                               str(out / "detent-node"), "--key", f"{key}.pub", "--model", args.model,
                               "--include-path", str(TASKS), "--json"],
                              env=ENV, capture_output=True, text=True)
        summary["verify_eval_seconds"] = time.perf_counter() - start
        summary["verify_eval_exit"] = done.returncode
        (out / "verify-eval.json").write_text(done.stdout)
        (out / "verify-eval.stderr").write_text(done.stderr[-20000:])
        report = json.loads(done.stdout) if done.stdout.strip() else {}
        summary["verify_eval"] = {k: report.get(k) for k in ("scores", "coverage", "receipts", "seconds")}
        samples = report.get("coverage", {}).get("total") or 100
        summary["seconds_per_sample"] = {"lm_eval": summary["lm_eval_seconds"] / samples,
                                         "verify_eval": summary["verify_eval_seconds"] / samples}
        summary["verify_over_serving"] = summary["verify_eval_seconds"] / summary["lm_eval_seconds"]
    # (3): the comparison on a server of each remaining mode
    for mode in modes:
        if f"concurrency_1_vs_8_{mode}" not in summary:
            summary[f"concurrency_1_vs_8_{mode}"] = concurrency_runs(
                args.model, model, args.name, key, out, mode, args.concurrency_limit, args.threads)
        (out / "summary.json").write_text(json.dumps(summary, indent=2))
    if modes:
        summary["gemm_invariant_from_rows_by_threads"] = gemm_invariant_rows(args.model)
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
