"""An lm-eval run rebuilt from the task's own data: every document, target and request, and every body sent.

verify-eval trusts nothing of the samples file for what was asked: the documents, their targets and the
requests come from the task (its YAML and its data, loaded by lm-eval's `TaskManager`), configured as the
run's results file says the run was (limit, few-shot count and seed, generation arguments, system
instruction, chat template), through lm-eval's own `build_all_requests`. lm-eval's per-sample hashes are
computed as its `evaluate` computes them (`hash_string` over the document's JSON, the first request's first
argument, the target's str()), and the run's per-task hash as its tracker does, so a logged document, prompt
or target that is not the task's is named. The bodies sent are rebuilt by running the request loop of the
run's lm-eval model class (its batching, tokenization, truncation and `_create_payload`) with the network
call replaced by a recorder: a receipt binds the canonical JSON of one of those bodies, or lm-eval never
sent it.
"""

from __future__ import annotations

import contextlib
import copy
import io
import json
from collections import defaultdict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from detent_audit.enums import ExitCode
from detent_audit.errors import BadInput, DetentError

if TYPE_CHECKING:
    from lm_eval.api.instance import Instance
    from lm_eval.api.model import LM
    from lm_eval.api.task import Task

API_OF_MODEL = {"local-completions": "openai/v1/completions",
                "local-chat-completions": "openai/v1/chat/completions"}


class TaskNotRebuilt(DetentError):
    """The task's own data or code cannot be loaded here: its documents cannot be rebuilt, so nothing of the
    run can be compared (the samples file's copy is never used in their place)."""

    exit_code = ExitCode.NOT_COMPARABLE


@dataclass(frozen=True)
class RunSettings:
    """What the run's results file says lm-eval was given, as far as it shapes the documents and requests."""

    limit: int | float | None
    num_fewshot: dict[str, int]
    fewshot_seed: int | None
    gen_kwargs: dict[str, Any] | None
    system_instruction: str | None
    apply_chat_template: bool
    fewshot_as_multiturn: bool
    batch_size: int

    @classmethod
    def of(cls, results: dict) -> RunSettings:
        config = results.get("config") or {}
        limit = config.get("limit")
        if limit is not None and (isinstance(limit, bool) or not isinstance(limit, (int, float))
                                  or limit <= 0):
            raise BadInput(f"the results file's config.limit {limit!r} is not a positive number")
        gen_kwargs = config.get("gen_kwargs") or None
        if isinstance(gen_kwargs, str):
            from lm_eval.utils import simple_parse_args_string

            gen_kwargs = simple_parse_args_string(gen_kwargs) or None
        batch = str(config.get("batch_size", 1))
        # lm-eval's API models run "auto" as 1
        return cls(limit, {str(k): int(v) for k, v in (results.get("n-shot") or {}).items()},
                   config.get("fewshot_seed"), gen_kwargs, results.get("system_instruction"),
                   results.get("chat_template") is not None, bool(results.get("fewshot_as_multiturn")),
                   int(batch) if batch.isdigit() and int(batch) > 0 else 1)


@dataclass
class RebuiltDoc:
    """One document of the task as the run must have seen it, with lm-eval's hashes of it."""

    doc_id: int
    doc: Any
    target: Any
    instances: list[Instance]  # lm-eval's Instances of the document, by idx
    doc_hash: str
    prompt_hash: str
    target_hash: str


@dataclass
class RebuiltTask:
    name: str
    task: Task                 # lm-eval's Task, configured as the run was
    docs: dict[int, RebuiltDoc]
    config: dict               # its config as lm-eval logs it (`dump_config`, JSON)
    task_documents: int        # the task's evaluation documents (the run's are all, or the limit's prefix)

    def task_hash(self, doc_ids: list[int]) -> str:
        """lm-eval's per-task hash (its tracker's `task_hashes`) over these documents, in this order."""
        from lm_eval.utils import hash_string

        return hash_string("".join(self.docs[i].doc_hash + self.docs[i].prompt_hash + self.docs[i].target_hash
                                   for i in doc_ids))


@dataclass(frozen=True)
class Sent:
    """One request as lm-eval sent it: the body of its HTTP request and its place in that body's batch."""

    api: str
    body: bytes                # the canonical JSON a receipt binds (manifests.receipt.body_json)
    position: int              # its prompt's index in a batched completions body, else 0
    kind: str                  # "score" (loglikelihood: echo) | "generate"
    ctxlen: int = 0            # score: the continuation starts here


def load_tasks(names: list[str], include_path: list[str], metadata: dict | None = None) -> dict[str, Any]:
    """lm-eval's task objects (their data loaded) of these names; `metadata`: what lm-eval's command line
    gives every task (the model's arguments), which some tasks read."""
    from lm_eval.tasks import TaskManager, get_task_dict

    manager = None
    if include_path:  # the include path alone first: indexing lm-eval's thousands of own tasks takes minutes
        manager = TaskManager(include_path=include_path, include_defaults=False, metadata=metadata)
        if any(n not in manager.all_tasks for n in names):
            manager = None
    # a task of the path takes precedence
    manager = manager or TaskManager(include_path=include_path or None, metadata=metadata)
    missing = [n for n in names if n not in manager.all_tasks]
    if missing:
        raise BadInput(f"lm-eval does not know the task(s) {', '.join(missing)}",
                       remedy="give --include-path the folder of the run's task YAML (as the run's "
                              "--include_path)")
    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            return get_task_dict(names, manager)
    except Exception as exc:  # noqa: BLE001 (a dataset load raises what its loader raises)
        raise TaskNotRebuilt(f"the data of task(s) {', '.join(names)} cannot be loaded here: "
                             f"{type(exc).__name__}: {exc}",
                             remedy="make the task's dataset loadable on this machine (its files, or the "
                                    "hub cache); verify-eval rebuilds every document from the task's own "
                                    "data and never uses the samples file's copy") from None


def _configure(name: str, task: Task, settings: RunSettings) -> None:
    """The overrides lm-eval's `simple_evaluate` applies to a loaded task, from the run's settings."""
    if task.get_config("output_type") == "generate_until" and settings.gen_kwargs is not None:
        task.set_config(key="generation_kwargs", value=copy.deepcopy(settings.gen_kwargs), update=True)
    if task.get_config("num_fewshot") != 0:  # a task's own 0 is never overridden, as lm-eval keeps it
        task.set_config(key="num_fewshot", value=settings.num_fewshot.get(name, 0))
    task.set_fewshot_seed(seed=settings.fewshot_seed)


def _logged_config(task: Task) -> dict:
    from lm_eval.utils import handle_non_serializable

    return json.loads(json.dumps(task.dump_config(), default=handle_non_serializable, ensure_ascii=False))


def rebuild_tasks(names: list[str], include_path: list[str], settings: RunSettings, lm: LM,
                  metadata: dict | None = None) -> dict[str, RebuiltTask]:
    """Each task's documents (all, or the run's `--limit` prefix in lm-eval's order) and their requests,
    built by lm-eval's own code from the task's own data (`metadata`: as `load_tasks`)."""
    from lm_eval.evaluator_utils import get_sample_size
    from lm_eval.utils import handle_non_serializable, hash_string

    loaded = load_tasks(names, include_path, metadata)
    out: dict[str, RebuiltTask] = {}
    for name in names:
        task = loaded[name]
        if int(task.config.repeats or 1) != 1:
            raise BadInput(f"task {name} repeats each request {task.config.repeats} times: verify-eval "
                           "audits tasks of one response per request")
        _configure(name, task, settings)
        limit = get_sample_size(task, settings.limit)
        try:
            with contextlib.redirect_stderr(io.StringIO()):
                task.build_all_requests(
                    limit=limit, rank=0, world_size=1, system_instruction=settings.system_instruction,
                    apply_chat_template=settings.apply_chat_template,
                    fewshot_as_multiturn=settings.fewshot_as_multiturn,
                    chat_template=lm.apply_chat_template if settings.apply_chat_template else None,
                    tokenizer_name=lm.tokenizer_name if settings.apply_chat_template else "")
                docs_in_order = list(task.doc_iterator(rank=0, limit=limit, world_size=1))
        except Exception as exc:  # noqa: BLE001 (lm-eval and the task's own functions raise many kinds)
            raise TaskNotRebuilt(f"task {name}: its documents cannot be rebuilt here: "
                                 f"{type(exc).__name__}: {exc}",
                                 remedy="run verify-eval where the task's data and code load") from None
        by_doc: dict[int, list] = defaultdict(list)
        for inst in task.instances:
            by_doc[int(inst.doc_id)].append(inst)
        docs = {}
        for doc_id, doc in docs_in_order:
            instances = sorted(by_doc[int(doc_id)], key=lambda i: i.idx)
            target = task.doc_to_target(doc)
            docs[int(doc_id)] = RebuiltDoc(
                int(doc_id), doc, target, instances,
                hash_string(json.dumps(instances[0].doc, indent=2, default=handle_non_serializable,
                                       ensure_ascii=False)),
                hash_string(instances[0].arguments[0]), hash_string(str(target)))
        out[name] = RebuiltTask(name, task, docs, _logged_config(task), len(task.eval_docs))
    return out


# ---- the bodies lm-eval sent


def replay(lm: LM, api: str, tasks: dict[str, RebuiltTask]) -> dict[tuple[str, int, int], Sent]:
    """Every request of the run as lm-eval sent it: its request loop run per request type over all the
    tasks' instances in the run's order (as `evaluate` pools them, so batches span tasks as they did), with
    the network call replaced by a recorder of the payload it builds (`_create_payload`, as its `model_call`
    does)."""
    by_type: dict[str, list] = defaultdict(list)
    for t in tasks.values():
        for doc in t.docs.values():
            by_type[doc.instances[0].request_type].extend(doc.instances)
    lm._concurrent = 1  # the batches are the same; its synchronous loop is the one recorded
    sent: dict[tuple[str, int, int], Sent] = {}
    with contextlib.redirect_stderr(io.StringIO()):
        for request_type, instances in by_type.items():
            if request_type not in ("loglikelihood", "generate_until"):
                raise BadInput(f"lm-eval request type {request_type!r} is not audited (loglikelihood and "
                               "generate_until are)")
            bodies: list[tuple[bytes, list[int]]] = []
            markers = _record(lm, request_type, instances, bodies)
            for inst, (batch, position) in zip(instances, markers):
                body, ctxlens = bodies[batch]
                sent[(inst.task_name, int(inst.doc_id), int(inst.idx))] = Sent(
                    api, body, position if _batched(api, body) else 0,
                    "score" if request_type == "loglikelihood" else "generate",
                    ctxlens[position] if ctxlens else 0)
    return sent


def _record(lm: LM, request_type: str, instances: list, bodies: list[tuple[bytes, list[int]]]) -> list:
    """Run lm-eval's loop for these instances; `bodies` gets each body sent (with its context lengths); the
    result is, per instance in order, (the body's index in `bodies`, the prompt's place in it)."""
    from detent_audit.manifests.receipt import body_json

    ctxlens: list[list[int]] = []
    batch_requests = lm.batch_loglikelihood_requests

    def batch_loglikelihood_requests(chunks: Any) -> tuple:
        inputs, lens, keys = batch_requests(chunks)
        ctxlens.append(list(lens))
        return inputs, lens, keys

    def model_call(messages: Any, *, generate: bool = True, gen_kwargs: dict | None = None,
                   **kw: Any) -> dict:
        payload = lm._create_payload(lm.create_message(messages), generate=generate,
                                     gen_kwargs=copy.deepcopy(gen_kwargs), seed=lm._seed, eos=lm.eos_string,
                                     **kw)
        # as the HTTP client sends it (json.dumps), then canonical as the node binds it
        bodies.append((body_json(json.loads(json.dumps(payload))), ctxlens[-1] if not generate else []))
        return {"batch": len(bodies) - 1, "size": len(messages)}

    def markers(outputs: Any, **_: Any) -> list[tuple[int, int]]:
        one = outputs[0] if isinstance(outputs, list) else outputs
        return [(one["batch"], i) for i in range(one["size"])]

    lm.batch_loglikelihood_requests = batch_loglikelihood_requests
    lm.model_call = model_call
    lm.parse_logprobs = markers
    lm.parse_generations = markers
    try:
        if request_type == "loglikelihood":
            return list(lm.loglikelihood(instances, disable_tqdm=True))
        return list(lm.generate_until(instances, disable_tqdm=True))
    finally:
        for name in ("batch_loglikelihood_requests", "model_call", "parse_logprobs", "parse_generations"):
            vars(lm).pop(name, None)


def _batched(api: str, body: bytes) -> bool:
    """Whether the server answers this body as a batch (one receipt per prompt, named <id>-<position>): a
    completions prompt that is a list of prompts (server/protocol.py)."""
    if api != API_OF_MODEL["local-completions"]:
        return False
    prompt = json.loads(body).get("prompt")
    return isinstance(prompt, list) and bool(prompt) and not all(isinstance(t, int) for t in prompt)


def position_of(api: str, body: bytes, request_id: str) -> int | None:
    """A receipt's prompt's place in its bound body: the suffix the server gives a batch's receipts, else
    0 (None: a batch's receipt without one)."""
    if not _batched(api, body):
        return 0
    index = request_id.rsplit("-", 1)[-1]
    return int(index) if index.isdigit() and str(int(index)) == index else None
