"""`detent-audit sglang-config`: SGLang's own server (`python -m sglang.launch_server`) with the detent
plugin, for a model and a tuple: the environment to export and the command, printed (or as JSON)."""

from __future__ import annotations

import json
from pathlib import Path

import typer

from detent_audit.cli.options import CACHE_DIR, JSON, MAX_MODEL_LEN, MODE, MODEL, THREADS, TUPLE
from detent_audit.cli.output import emit_json
from detent_audit.enums import Mode
from detent_audit.errors import BadInput


def sglang_config(
    model: str = MODEL, mode: str = MODE, threads: int = THREADS, tuple_file: Path = TUPLE,
    max_model_len: int = MAX_MODEL_LEN,
    max_running_requests: int = typer.Option(64, "--max-running-requests", min=1,
                                             help="SGLang's running requests (the selection assumes them)."),
    chunked_prefill_size: int = typer.Option(8192, "--chunked-prefill-size", min=1,
                                             help="SGLang's tokens of one prefill batch."),
    attention: str = typer.Option("auto", "--attention", help="detent's attention: c | torch | auto (c where "
                                                              "this machine builds it)."),
    as_json: bool = JSON, cache_dir: Path = CACHE_DIR,
) -> None:
    """Print how to start SGLang's own server with the detent plugin: the environment (`DETENT_SGLANG`, the
    threads, SGLang's settings that change bits) and `python -m sglang.launch_server` with the flags the
    plugin's selection is solved for. In detent mode the tuple (`--tuple`, or the preferred legal one) is
    solved and its GEMM form proven here first. SGLang's server signs nothing: no receipts (serve them with
    `detent-audit serve --engine sglang`)."""
    from detent_audit.integrations.hosted import attention_form, checkpoint_folder
    from detent_audit.integrations.sglang import launch
    from detent_audit.integrations.sglang.config import PluginConfig
    from detent_audit.integrations.sglang.selection import Limits, cpu_selection, solved_context
    from detent_audit.runtime.model_config import ModelConfig

    if mode not in (Mode.DETENT, Mode.STOCK):
        raise BadInput(f"SGLang's server runs mode detent or stock, got {mode!r}",
                       remedy="SGLang's deterministic mode refuses its CPU backends; use detent")
    if tuple_file is not None and mode != Mode.DETENT:
        raise BadInput("a tuple is committed only in detent mode", remedy="drop --tuple or use --mode detent")
    path = str(checkpoint_folder(model or "", str(cache_dir) if cache_dir else None, "SGLang").path)
    context = max_model_len or ModelConfig.from_pretrained(path).max_position_embeddings
    limits = Limits.served(context, max_running_requests, chunked_prefill_size)
    limits = Limits(solved_context(path, limits), limits.max_num_seqs, limits.max_num_batched_tokens)
    values: dict = {}
    form = "c"
    if mode == Mode.DETENT:
        from detent_audit.runtime.tuples import load_tuple

        committed = load_tuple(tuple_file) if tuple_file is not None else None
        values = dict(cpu_selection(path, threads, committed, limits).tuple)
        form = attention_form(attention)
    config = PluginConfig(mode=mode, model_path=path, num_threads=threads, tuple=values, attention=form,
                          max_model_len=limits.max_model_len, max_num_seqs=limits.max_num_seqs,
                          max_num_batched_tokens=limits.max_num_batched_tokens)
    server = launch.for_server(path, config, chunked_prefill_size)
    if as_json:
        emit_json(json.dumps(server.to_json(), indent=2, sort_keys=True))
        return
    print(f"# SGLang's own server with the detent plugin ({mode}); it signs nothing: no receipts")
    print(server.shell())
