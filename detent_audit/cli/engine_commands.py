"""Commands of the embedded engine: info, battery, generate, tune, import-gguf."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import typer

from detent_audit.cli.engines import open_engine
from detent_audit.cli.options import (
    ATTENTION_STREAMING,
    DEVICE,
    DTYPE,
    ENGINE,
    JSON,
    MAX_MODEL_LEN,
    MODE,
    MODEL,
    TENSOR_PARALLEL,
    THREADS,
    TUPLE,
)
from detent_audit.cli.output import Progress, emit_json
from detent_audit.enums import Mode


def info(model: str = MODEL, mode: str = MODE, dtype: str = DTYPE, threads: int = THREADS,
         device: str = DEVICE, tuple_file: Path = TUPLE, as_json: bool = JSON,
         checkpoint_path: bool = typer.Option(False, "--checkpoint-path",
                                              help="Print only the model's checkpoint folder (what lm-eval's "
                                                   "tokenizer= and Hugging Face tools read), importing a "
                                                   "named model first if needed.")) -> None:
    """Print the running engine's deployment facts and their hash (or, with --checkpoint-path, where the
    model's checkpoint folder is)."""
    from detent_audit.manifests.encoding import facts_hash

    if checkpoint_path:
        from detent_audit.runtime.named_models import resolve_model

        resolved = resolve_model(model)
        doc = {"model": resolved.name, "checkpoint": str(resolved.path), "source": resolved.source}
        (emit_json if as_json else typer.echo)(json.dumps(doc) if as_json else str(resolved.path))
        return
    llm = open_engine(model, mode, dtype, threads, tuple_file, device=device)
    facts = llm.facts()
    digest = facts_hash(facts)
    if as_json:
        emit_json(json.dumps({"facts": facts, "facts_hash": digest}, indent=2, sort_keys=True))
        return
    typer.echo(json.dumps(facts, indent=2, sort_keys=True))
    typer.echo(f"facts hash: {digest}")


def battery(
    model: str = MODEL, mode: str = MODE, dtype: str = DTYPE, threads: int = THREADS, device: str = DEVICE,
    seed: int = typer.Option(0, "--seed", help="Seed of the target and neighbour prompts."),
    target_len: int = typer.Option(None, "--target-len", min=3, show_default=False,
                                   help="Tokens of the target prompt [default: 40 with 16-token KV pages, "
                                        "600 with larger ones (vLLM CPU), which crosses its KV splits]."),
    engine: str = ENGINE, tensor_parallel_size: int = TENSOR_PARALLEL, as_json: bool = JSON,
) -> None:
    """Run the 35-cell invariance battery; exit 1 if any cell fails. The prefix cells share whole KV pages of
    the engine (16 tokens on the embedded engine, 32 on vLLM CPU)."""
    from rich.console import Console
    from rich.table import Table

    from detent_audit.bench.battery import cells, default_target_len, prefix_block, run_battery

    llm = open_engine(model, mode, dtype, threads, device=device, engine=engine,
                      tensor_parallel_size=tensor_parallel_size)
    block = prefix_block(llm)
    target_len = default_target_len(block) if target_len is None else target_len
    try:
        with Progress("battery", "cells") as progress:
            progress.update(0, len(cells(block)))
            results = run_battery(llm, seed=seed, progress=progress.advance, target_len=target_len,
                                  block=block)
    finally:  # a tensor-parallel engine's other ranks stop with it
        llm.shutdown()
    failed = [r for r in results if not r.passed]
    if as_json:
        emit_json(json.dumps({"engine": engine, "mode": mode, "dtype": dtype, "threads": threads,
                               "tensor_parallel_size": tensor_parallel_size,
                               "target_len": target_len, "prefix_block": block,
                               "passed": len(results) - len(failed), "total": len(results),
                               "cells": [r.to_json() for r in results]}, indent=2))
    else:
        table = Table(title=f"invariance battery: {engine} engine, mode {mode}, {dtype}, {threads} threads"
                            + (f" per rank, TP={tensor_parallel_size}" if tensor_parallel_size > 1 else ""))
        for col in ("cell", "group", "what changes", "result", "first diff", "expected bits", "got bits"):
            table.add_column(col)
        for r in results:
            table.add_row(r.name, r.group, r.description, "PASS" if r.passed else "FAIL",
                          "-" if r.first_diff is None else str(r.first_diff), r.expected_bits or "-",
                          r.got_bits or "-")
        Console(file=sys.stdout, width=150).print(table)
        typer.echo(f"{len(results) - len(failed)}/{len(results)} cells pass")
    if failed:
        raise typer.Exit(1)


def generate(
    prompt: list[str] = typer.Argument(..., help="Prompts (submitted together)."),
    model: str = MODEL, mode: str = MODE, dtype: str = DTYPE, threads: int = THREADS, device: str = DEVICE,
    max_tokens: int = typer.Option(16, "--max-tokens"),
    temperature: float = typer.Option(0.0, "--temperature"),
    top_p: float = typer.Option(1.0, "--top-p"),
    top_k: int = typer.Option(0, "--top-k"),
    seed: int = typer.Option(None, "--seed",
                             help="Sampling seed (default: fresh when sampling, and printed)."),
    max_model_len: int = MAX_MODEL_LEN, as_json: bool = JSON,
) -> None:
    """Generate completions offline."""
    from detent_audit.runtime.sampling_params import SamplingParams, seed_for

    llm = open_engine(model, mode, dtype, threads, device=device, max_model_len=max_model_len)
    params = SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k, max_tokens=max_tokens,
                            seed=seed_for(temperature, seed))
    outs = llm.generate(prompt, params)
    if as_json:
        emit_json(json.dumps([{"prompt": p, "text": o.text, "token_ids": o.token_ids,
                                "logprobs": o.logprobs, "finish_reason": o.finish_reason, "seed": params.seed}
                               for p, o in zip(prompt, outs)], indent=2))
        return
    for p, o in zip(prompt, outs):
        typer.echo(f"{p!r} -> {o.text!r} ({len(o.token_ids)} tokens, {o.finish_reason})")
    if not params.is_greedy:
        typer.echo(f"seed {params.seed}")


def tune(
    workload: Path = typer.Option(..., "--workload",
                                  help="Profiling workload: requests as jsonl (serve's format)."),
    out: Path = typer.Option(..., "--out", help="Tuple file to write (msgpack; never overwritten)."),
    model: str = MODEL, dtype: str = DTYPE, threads: int = THREADS,
    tuple_file: Path = typer.Option(None, "--tuple",
                                    help="Start from this tuple (default: the preferred one)."),
    exhaustive: bool = typer.Option(False, "--exhaustive", help="Measure every candidate (validation)."),
    budget: float = typer.Option(0.15, "--budget", help="Fraction of each family's grid to measure."),
    seed: int = typer.Option(0, "--seed"),
    device: str = DEVICE, attention_streaming: bool = ATTENTION_STREAMING,
    concurrency: str = typer.Option("all", "--concurrency",
                                    help="Profile the workload at these concurrencies, comma-separated "
                                         "(e.g. 1,8; all: every request submitted together), the calls added "
                                         "up: tune for the batch sizes you serve at."),
    as_json: bool = JSON,
) -> None:
    """Profile a workload, search each family's legal grid on its recorded calls, commit the best tuple."""
    from rich.console import Console
    from rich.table import Table

    from detent_audit.bench.workloads import parse_concurrencies
    from detent_audit.engine.llm import LLM
    from detent_audit.engine.tune import tune_engine
    from detent_audit.errors import BadInput
    from detent_audit.runtime.tuples import save_tuple
    from detent_audit.server.offline import read_requests

    if out.exists():
        raise BadInput(f"{out} exists", remedy="choose another --out or remove the old tuple first")
    levels = parse_concurrencies(concurrency)
    llm = open_engine(model, Mode.DETENT, dtype, threads, tuple_file, device=device,
                      attention_streaming=attention_streaming)
    if not isinstance(llm, LLM):  # the embedded engine: tuning reads its kernels' calls
        raise BadInput("tune runs on the embedded engine")
    requests = [r[:3] for r in read_requests(llm, workload)]  # (id, prompt ids, sampling): no binding needed
    with Progress("measuring candidates", "candidates") as progress:
        committed, reports = tune_engine(llm, requests, mode="exhaustive" if exhaustive else "budgeted",
                                         budget_fraction=budget, seed=seed, concurrency=levels,
                                         progress=lambda family, done, total: progress.update(done, total))
    save_tuple(committed, out)
    if as_json:
        emit_json(json.dumps({"tuple": committed, "out": str(out), "families": [r.to_json() for r in reports],
                               "concurrency": ["all" if c is None else c for c in levels]},
                              indent=2, sort_keys=True))
        return
    table = Table(title=f"detent-audit tune: {workload.name} -> {out}")
    for col in ("family", "grid", "measured", "predicted (default)", "predicted (tuned)", "speed-up",
                "chosen"):
        table.add_column(col)
    for r in reports:
        grouped = r.distinct_launches not in (0, r.grid_size)
        classes = f" ({r.distinct_launches} launch classes)" if grouped else ""
        table.add_row(r.family, f"{r.grid_size}{classes}", f"{r.measured} ({r.measured / r.grid_size:.0%})",
                      f"{r.default_cost * 1e3:.1f} ms", f"{r.tuned_cost * 1e3:.1f} ms",
                      f"{r.default_cost / r.tuned_cost:.2f}x", json.dumps(r.chosen))
    Console(file=sys.stdout, width=150).print(table)
    typer.echo(f"OK: tuple written to {out}")


def import_gguf(
    file: Path = typer.Argument(..., help="A llama.cpp GGUF file "
                                          "(Llama architecture; F32/F16/BF16/Q8_0/Q4_0/Q4_1)."),
    out: Path = typer.Option(..., "--out",
                             help="Folder to write the Hugging Face checkpoint into (new or empty)."),
    dtype: str = typer.Option("float32", "--dtype", help="float32 | bfloat16: the safetensors' dtype."),
    as_json: bool = JSON,
) -> None:
    """Import a GGUF file as a Hugging Face checkpoint folder (config, safetensors, tokenizer, chat
    template)."""

    from detent_audit.runtime.gguf_import import check_import
    from detent_audit.runtime.gguf_import import import_gguf as run_import

    check_import(file, out, dtype)  # bad input fails before the progress bar starts
    with Progress("dequantizing", "tensors") as progress:
        result = run_import(file, out, dtype, progress=progress.update)
    if as_json:
        emit_json(json.dumps({"out": str(result.path), "sha256": result.sha256, "tensors": result.num_tensors,
                               "quantizations": list(result.quantizations), "dtype": dtype}, indent=2))
        return
    typer.echo(f"OK: {file} (sha256 {result.sha256}) -> {result.path}: {result.num_tensors} tensors "
               f"({', '.join(result.quantizations)} -> {dtype})")
