"""The evaluation tests' helpers: a live server of `detent-audit serve`'s app, and lm-eval run on it in this
process (imported once per test process) as its command line runs, writing the folder
`lm_eval --output_path ... --log_samples` writes."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from threaded_server import threaded_server

from detent_audit.engine.llm import LLM, EngineConfig
from detent_audit.enums import Mode
from detent_audit.manifests.dsse import read_envelope_bytes
from detent_audit.manifests.keys import GeneratedKey, load_private_key, load_trusted_keys
from detent_audit.manifests.receipt import verify_envelope
from detent_audit.runtime import registry
from detent_audit.runtime.contract import Engine
from detent_audit.server.app import create_app
from detent_audit.server.async_engine import AsyncEngine
from detent_audit.server.node import ServingNode

MODEL_NAME = "smollm2-135m-instruct"
TASKS = Path(__file__).resolve().parents[2] / "examples" / "eval"
# the shipped tasks read a jsonl of the repository: nothing of the hub is needed, and nothing may be fetched
for _name in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE"):
    os.environ.setdefault(_name, "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@dataclass
class Served:
    url: str
    out: Path          # receipts/ and manifests/
    checkpoint: Path
    key: GeneratedKey
    node: ServingNode
    llm: Engine

    @property
    def trusted(self) -> dict:
        return load_trusted_keys(self.key.public_path)

    def steps(self) -> dict[int, int]:
        """The engine's steps so far by how many sequences shared each (the embedded engine counts them)."""
        assert isinstance(self.llm, LLM), "the embedded engine counts its steps"
        return dict(self.llm.step_batch_sizes)


@contextmanager
def serving(checkpoint: Path, key: GeneratedKey, out: Path, cache_dir: Path, mode: str = "detent",
            threads: int = 1, engine: str = "embedded") -> Iterator[Served]:
    """`detent-audit serve`'s app on 127.0.0.1 in a thread, on `engine` (built as `serve --engine` builds
    it); on exit it shuts down and writes its run manifest."""
    if engine == "embedded":
        llm: Engine = LLM(EngineConfig(model=str(checkpoint), mode=mode, cache_dir=str(cache_dir),
                                       num_threads=threads))
    else:
        llm = registry.build(engine, registry.EngineOptions(model=str(checkpoint), mode=Mode(mode),
                                                            threads=threads, cache_dir=str(cache_dir)))
    node = ServingNode(llm, load_private_key(key.private_path), out)
    async_engine = AsyncEngine(llm)
    try:
        with threaded_server(create_app(async_engine, node, MODEL_NAME), start_timeout=60) as url:
            yield Served(url, out, checkpoint, key, node, llm)
    finally:
        async_engine.shutdown(drain=False)
        llm.shutdown()


def lm_eval_argv(served: Served, out: Path, tasks: str, *, limit: int, chat: bool, batch_size: int,
                 concurrent: int, task_path: Path = TASKS, remote_tokenizer: bool = False) -> list[str]:
    """lm-eval's command line (after `lm_eval`) for the tasks of `task_path` (the shipped ones) against the
    server, with --log_samples. `remote_tokenizer`: no `tokenizer=`, so lm-eval finds the server's
    /tokenizer_info and tokenizes through it."""
    if chat:
        model, args = "local-chat-completions", f"base_url={served.url}/v1/chat/completions"
    elif remote_tokenizer:
        model, args = "local-completions", f"base_url={served.url}/v1/completions"
    else:
        model = "local-completions"
        args = (f"base_url={served.url}/v1/completions,tokenizer={served.checkpoint},"
                "tokenizer_backend=huggingface")
    return ["--model", model, "--model_args",
            f"model={MODEL_NAME},{args},num_concurrent={concurrent},max_retries=1", "--include_path",
            str(task_path), "--tasks", tasks, "--limit", str(limit), "--batch_size", str(batch_size),
            "--output_path", str(out), "--log_samples"] + (["--apply_chat_template"] if chat else [])


def run_lm_eval(served: Served, out: Path, tasks: str, *, limit: int = 4, chat: bool = False,
                batch_size: int = 4, concurrent: int = 1, task_path: Path = TASKS,
                remote_tokenizer: bool = False) -> Path:
    """lm-eval against the server, in this process, as its CLI runs (`lm_eval_argv`): `simple_evaluate`, then
    its tracker writes the output folder (results_*.json, samples_*.jsonl). The one difference: the task
    manager indexes only the tasks' folder (lm-eval's own thousands of tasks take minutes to index, and no
    test uses them). Raises what lm-eval raised (a request the server refused fails the run:
    max_retries=1)."""
    from lm_eval import simple_evaluate
    from lm_eval.loggers import EvaluationTracker
    from lm_eval.tasks import TaskManager

    argv = lm_eval_argv(served, out, tasks, limit=limit, chat=chat, batch_size=batch_size,
                        concurrent=concurrent, task_path=task_path, remote_tokenizer=remote_tokenizer)
    tracker = EvaluationTracker(output_path=str(out))
    results = simple_evaluate(model=argv[argv.index("--model") + 1],
                              model_args=argv[argv.index("--model_args") + 1], tasks=tasks.split(","),
                              batch_size=batch_size, limit=limit, log_samples=True,
                              evaluation_tracker=tracker, apply_chat_template=chat,
                              task_manager=TaskManager(include_path=str(task_path), include_defaults=False))
    samples = results.pop("samples")
    tracker.save_results_aggregated(results=results, samples=samples)
    for task in results["configs"]:
        tracker.save_results_samples(task_name=task, samples=samples[task])
    if not any(out.rglob("results_*.json")):
        raise AssertionError(f"lm-eval wrote no results under {out}")
    return out


def generations_of(paths, trusted: dict) -> dict[tuple[int, ...], tuple[tuple[int, ...], bytes]]:
    """The generations among the receipts `paths`, by prompt ids: their output tokens and fp32 logprob
    bits."""
    found = {}
    for p in paths:
        r = verify_envelope(read_envelope_bytes(p), trusted).receipt
        if r.scoring is None:
            found[tuple(r.request.prompt_token_ids)] = (tuple(r.output.token_ids),
                                                        bytes(r.output.logprobs_f32le))
    return found
