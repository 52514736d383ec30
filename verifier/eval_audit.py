"""`detent-audit verify-eval`: an lm-eval run's published score, recomputed from verified receipts alone.

(a) Read the run: lm-eval's `results_<time>.json` (the reported scores, the model and its arguments, the task
configs) and its `samples_<task>_<time>.jsonl` (`--log_samples`: per document its requests, the responses
lm-eval parsed, and its metrics). (b) Rebuild every request lm-eval sent, with lm-eval's own model class (its
tokenization, truncation, payload): the prompt token ids, and for a generation its stop strings, max_tokens,
temperature and seed; a chat request's messages rendered by the deployment's chat template, as the server
renders them. (c) Open the receipts (verification steps (1)-(3)) and match each request to one receipt of
that exact request (each receipt answers at most one request). (d) Verify the matched receipts (`verify`,
steps (1)-(10)). (e) From each verified receipt alone, rebuild the response the server
gave (the same response code: the echoed logprobs and top alternatives, or the output text cut at its stop
string) and parse it with lm-eval's own parser; it must equal the response lm-eval logged. (f) Recompute each
document's metrics with the task's own filters and `process_results`, aggregate with its own aggregations,
over the documents whose every request verified (the coverage), and compare with the reported score.

A document is named, with the reason, when a request has no receipt, its receipt failed verification, or the
response lm-eval logged is not the one its receipt's tokens give. Exit codes: 0 when every document is covered
and every recomputed score equals the reported one bit for bit; 1 otherwise; 2 bad input.
"""

from __future__ import annotations

import contextlib
import copy
import io
import json
import math
import re
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from detent_audit.errors import BadInput, DetentError
from detent_audit.runtime.stop_strings import output_text

_RESULTS = re.compile(r"results_(.+)\.json")
LOGPROB_FLOOR = -9999.0  # what the server writes for a logprob JSON cannot hold (server/responses.py)


@dataclass(frozen=True)
class Request:
    """One request lm-eval sent, as the server saw it; `key` is what a receipt of it must record."""

    task: str
    doc_id: int
    index: int                 # the request's place among its document's requests
    kind: str                  # "score" (loglikelihood, echo) | "generate"
    prompt_ids: tuple[int, ...]
    max_tokens: int
    stop: tuple[str, ...]
    temperature: float
    seed: int
    ctxlen: int = 0            # score: the continuation starts here
    chat: bool = False

    @property
    def key(self) -> tuple:
        return (self.kind, self.prompt_ids, self.max_tokens, self.stop, self.temperature, self.seed)


@dataclass
class DocVerdict:
    task: str
    doc_id: int
    covered: bool
    reasons: list[str] = field(default_factory=list)

    def to_json(self) -> dict:
        return {"task": self.task, "doc_id": self.doc_id, "covered": self.covered, "reasons": self.reasons}


@dataclass
class Score:
    task: str
    metric: str                # lm-eval's "metric,filter" key
    reported: float | None
    recomputed: float | None
    covered: int
    total: int

    @property
    def equal(self) -> bool:
        return self.reported is not None and self.recomputed is not None and \
            json.dumps(self.reported) == json.dumps(self.recomputed)

    def to_json(self) -> dict:
        return {"task": self.task, "metric": self.metric, "reported": self.reported, "recomputed": self.recomputed,
                "equal": self.equal, "covered": self.covered, "total": self.total}


@dataclass
class EvalReport:
    scores: list[Score]
    docs: list[DocVerdict]
    receipts_unmatched: int
    receipt_counts: dict[str, int]
    seconds: dict[str, float] = field(default_factory=dict)
    published: list[str] = field(default_factory=list)  # deployment hashes the facts were checked against

    @property
    def exit_code(self) -> int:
        full = all(d.covered for d in self.docs) and bool(self.docs)
        return 0 if full and all(s.equal for s in self.scores) else 1

    def to_json(self) -> dict:
        covered = sum(d.covered for d in self.docs)
        return {"scores": [s.to_json() for s in self.scores],
                "coverage": {"covered": covered, "total": len(self.docs)},
                "differing": [d.to_json() for d in self.docs if not d.covered],
                "receipts": {**self.receipt_counts, "unmatched": self.receipts_unmatched},
                "published_deployments": self.published, "facts_self_asserted": not self.published,
                "seconds": self.seconds, "exit_code": self.exit_code}


# ---- (a): the run lm-eval wrote


def find_run(path: Path) -> tuple[Path, dict[str, Path]]:
    """The results file (`path`, or the newest results_*.json under the folder `path`) and its samples files
    by task (same timestamp, same folder)."""
    if path.is_dir():
        found = sorted(path.rglob("results_*.json"), key=lambda p: p.name)
        if not found:
            raise BadInput(f"{path}: no lm-eval results_*.json in this folder",
                           remedy="give lm-eval's --output_path folder (run with --log_samples)")
        path = found[-1]
    match = _RESULTS.fullmatch(path.name)
    if not path.is_file() or match is None:
        raise BadInput(f"{path}: not an lm-eval results_<time>.json file")
    stamp = match.group(1)
    samples = {p.name[len("samples_"):-len(f"_{stamp}.jsonl")]: p
               for p in path.parent.glob(f"samples_*_{stamp}.jsonl")}
    if not samples:
        raise BadInput(f"{path.parent}: no samples_*_{stamp}.jsonl beside {path.name}",
                       remedy="run lm-eval with --log_samples: the score is recomputed from each logged sample")
    return path, samples


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise BadInput(f"{path}: cannot read it as JSON ({exc})") from None


def read_samples(path: Path) -> list[dict]:
    """One logged sample per document (lm-eval writes one line per document and filter: the first is kept,
    the requests and responses are the same in each)."""
    seen: dict[int, dict] = {}
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError as exc:
        raise BadInput(f"{path}: cannot read it ({exc.strerror})") from None
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            sample = json.loads(line)
            doc_id = int(sample["doc_id"])
            sample["arguments"], sample["resps"]  # noqa: B018 (present)
        except (ValueError, KeyError, TypeError) as exc:
            raise BadInput(f"{path}:{n}: not an lm-eval logged sample ({exc})") from None
        seen.setdefault(doc_id, sample)
    return [seen[k] for k in sorted(seen)]


def _arguments(sample: dict) -> list[tuple]:
    """A logged sample's request arguments as lm-eval's `Instance.args`: lm-eval writes them as
    {"gen_args_0": {"arg_0": ..., "arg_1": ...}, ...} (or as lists)."""
    args = sample["arguments"]
    if isinstance(args, dict):
        return [tuple(v[f"arg_{i}"] for i in range(len(v))) for _, v in sorted(args.items(),
                                                                               key=lambda kv: int(kv[0].split("_")[-1]))]
    return [tuple(a) for a in args]


# ---- (b): the requests, rebuilt with lm-eval's own model class


def _model_args(results: dict) -> tuple[str, dict[str, Any]]:
    config = results.get("config") or {}
    name, args = config.get("model"), config.get("model_args") or {}
    if name not in ("local-completions", "local-chat-completions"):
        raise BadInput(f"the run used lm-eval model {name!r}",
                       remedy="verify-eval audits runs against an OpenAI-compatible server: local-completions "
                              "or local-chat-completions")
    if isinstance(args, str):
        from lm_eval.utils import simple_parse_args_string

        args = simple_parse_args_string(args)
    return name, dict(args)


def make_lm(results: dict, tokenizer_path: str | None) -> Any:
    """lm-eval's model object for the run's model and arguments, built offline: its tokenizer from the run's
    `tokenizer` argument (else `tokenizer_path`: the deployment's checkpoint), no request sent."""
    from lm_eval.api.registry import get_model

    name, args = _model_args(results)
    args.pop("base_url", None)  # nothing is sent; a base_url would make it probe the server's tokenizer
    if name == "local-completions":
        args.setdefault("tokenizer", tokenizer_path)
        args["tokenizer_backend"] = "huggingface"
    try:
        lm = get_model(name)(**{**args, "batch_size": 1})
    except Exception as exc:  # noqa: BLE001 (lm-eval raises many kinds for bad arguments)
        raise BadInput(f"cannot rebuild lm-eval's {name} model from the run's arguments: {exc}",
                       remedy="give --tokenizer the checkpoint folder lm-eval tokenized with") from None
    lm._concurrent = 1
    return lm


def _payloads(lm: Any, request_type: str, args: list[tuple]) -> list[tuple[dict, int]]:
    """What lm-eval sends for these requests of one document: (the payload, the context length), through
    its own loglikelihood / generate_until code with the network call replaced by a recorder (its progress
    bars, one per call, silenced)."""
    with contextlib.redirect_stderr(io.StringIO()):
        return _record_payloads(lm, request_type, args)


def _record_payloads(lm: Any, request_type: str, args: list[tuple]) -> list[tuple[dict, int]]:
    from lm_eval.api.instance import Instance

    instances = [Instance(request_type, {}, a, i, (None, 0, 1)) for i, a in enumerate(args)]
    out: list[tuple[dict, int]] = []
    if request_type == "loglikelihood":
        captured: list = []

        def record(reqs: list, **_: Any) -> list:
            captured.extend(reqs)
            return [(0.0, False)] * len(reqs)

        lm._loglikelihood_tokens = record
        lm.loglikelihood(instances, disable_tqdm=True)
        inputs, ctxlens, _ = lm.batch_loglikelihood_requests([captured])
        for inp, ctxlen in zip(inputs, ctxlens):
            out.append((lm._create_payload(lm.create_message([inp]), generate=False, seed=lm._seed), ctxlen))
        return out
    if request_type != "generate_until":
        raise BadInput(f"lm-eval request type {request_type!r} is not audited (loglikelihood and generate_until "
                       "are)")
    for inst in instances:
        def model_call(messages: Any, *, generate: bool = True, gen_kwargs: dict | None = None, **_: Any) -> dict:
            payload = lm._create_payload(lm.create_message(messages), generate=True,
                                         gen_kwargs=copy.deepcopy(gen_kwargs), seed=lm._seed, eos=lm.eos_string)
            out.append((payload, 0))
            return {"choices": [{"index": 0, "text": "", "message": {"content": ""}}]}

        lm.model_call = model_call
        lm.generate_until([inst], disable_tqdm=True)
    return out


def rebuild_requests(lm: Any, task: str, request_type: str, sample: dict, tokenizer: Any) -> list[Request]:
    """The requests of one logged document, as the server received them (prompt ids as the server made them)."""
    args = _arguments(sample)
    chat = type(lm).__name__ == "LocalChatCompletion"
    if chat:
        from lm_eval.models.api_models import JsonChatStr

        args = [(JsonChatStr(a[0][0] if isinstance(a[0], list) else a[0]), *a[1:]) for a in args]
    requests = []
    for index, (payload, ctxlen) in enumerate(_payloads(lm, request_type, args)):
        if chat:  # the server renders the messages with the deployment's chat template
            messages = [{"role": m["role"], "content": m["content"]} for m in payload["messages"]]
            prompt = tuple(tokenizer.encode_chat(messages))
        else:  # a batch of one: [ids] or [text]; or ids or text
            one = payload["prompt"]
            one = one[0] if isinstance(one, list) and len(one) == 1 and isinstance(one[0], (list, str)) else one
            prompt = tuple(tokenizer.encode(one) if isinstance(one, str) else one)
        stop = payload.get("stop") or ()
        stop = (stop,) if isinstance(stop, str) else tuple(stop)
        requests.append(Request(task, int(sample["doc_id"]), index,
                                "score" if payload.get("echo") else "generate", prompt,
                                int(payload.get("max_tokens", 16)), stop, float(payload.get("temperature", 1.0)),
                                int(payload.get("seed", 0)), ctxlen, chat))
    return requests


# ---- (c): receipts by request


def receipt_key(r: Any) -> tuple:
    s = r.request.sampling
    return ("score" if r.scoring is not None else "generate", tuple(r.request.prompt_token_ids), s.max_tokens,
            tuple(s.stop), s.temperature, r.request.seed)


# ---- (e): the response a verified receipt gives, parsed by lm-eval


def _json_logprob(value: float) -> float:
    return value if math.isfinite(value) else LOGPROB_FLOOR  # JSON has no -inf: the server writes -9999.0


def response_of(lm: Any, req: Request, receipt: Any, decode: Callable) -> Any:
    """What lm-eval parses from the response this receipt's bits give: the echoed prompt's logprobs, or the
    output text cut at its stop string (the server's rule, stop_strings.py).

    A response's top_logprobs entry maps each alternative's text, then the token's own, to its logprob, the
    first of equal texts kept; lm-eval reads only its values (`is_greedy`: the token's logprob equals the
    largest, the top-1's, which is always kept). Keyed here by token id, the values lm-eval reads are the same."""
    out = receipt.output
    if req.kind == "score":
        sc = receipt.scoring
        prompt = list(receipt.request.prompt_token_ids)
        lps = [_json_logprob(v) for v in (*sc.logprobs, *out.logprobs)]
        tops: list[dict[str, float]] = []
        for i, token in enumerate([*prompt[1:], *out.token_ids]):
            alternatives = sc.tops[i] if sc.top_n and i < sc.num_positions else []
            entry = {f"token_id:{a}": _json_logprob(v) for a, v in alternatives}
            entry.setdefault(f"token_id:{token}", lps[i])
            tops.append(entry)
        choice = {"index": 0, "logprobs": {"token_logprobs": [None, *lps], "top_logprobs": [None, *tops]}}
        ids = [*prompt, *out.token_ids]
        (ll, greedy), = type(lm).parse_logprobs(outputs={"choices": [choice]}, tokens=[ids], ctxlens=[req.ctxlen])
        return [ll, greedy]
    text, _ = output_text(decode, list(out.token_ids), receipt.request.sampling.stop)
    choice = {"index": 0, "text": text, "message": {"role": "assistant", "content": text}}
    return lm.parse_generations(outputs={"choices": [choice]})[0]


def _same(logged: Any, rebuilt: Any) -> bool:
    """lm-eval logs a loglikelihood response (a tuple) as the str() of each value, a generation as its text;
    str() of a float is its shortest round-trip form, so equal strings are equal bits."""
    if isinstance(rebuilt, list):
        return isinstance(logged, list) and [str(x) for x in logged] == [str(x) for x in rebuilt]
    return logged == rebuilt


# ---- (f): the metrics, with the task's own code


def load_tasks(names: list[str], include_path: list[str]) -> dict[str, Any]:
    from lm_eval.tasks import TaskManager, get_task_dict

    manager = None
    if include_path:  # the include path alone first: indexing lm-eval's thousands of own tasks takes minutes
        manager = TaskManager(include_path=include_path, include_defaults=False)
        if any(n not in manager.all_tasks for n in names):
            manager = None
    manager = manager or TaskManager(include_path=include_path or None)  # a task of the path takes precedence
    missing = [n for n in names if n not in manager.all_tasks]
    if missing:
        raise BadInput(f"lm-eval does not know the task(s) {', '.join(missing)}",
                       remedy="give --include-path the folder of the run's task YAML (as the run's --include_path)")
    return get_task_dict(names, manager)


def recompute(task_obj: Any, task: str, docs: list[dict], responses: dict[int, list]) -> dict[str, tuple[float, int]]:
    """{"metric,filter": (aggregate, documents)} over the documents in `responses` (doc_id -> each request's
    response), through the task's filters, `process_results` and aggregations."""
    from lm_eval.api.instance import Instance

    by_doc = {int(s["doc_id"]): s for s in docs}
    instances: dict[int, list] = {}
    for doc_id, resps in sorted(responses.items()):
        sample = by_doc[doc_id]
        insts = [Instance(task_obj.OUTPUT_TYPE, sample["doc"], a, i, (task, doc_id, 1))
                 for i, a in enumerate(_arguments(sample))]
        for inst, resp in zip(insts, resps):
            inst.resps.append(resp if task_obj.OUTPUT_TYPE != "loglikelihood" and
                              task_obj.OUTPUT_TYPE != "multiple_choice" else tuple(resp))
        instances[doc_id] = insts
    flat = [inst for insts in instances.values() for inst in insts]
    if not flat:
        return {}
    for f in getattr(task_obj, "_filters", []):
        f.apply(flat)
    values: dict[str, list] = defaultdict(list)
    for doc_id, insts in instances.items():
        for filter_key in (insts[0].filtered_resps if insts else {}):
            metrics = task_obj.process_results(by_doc[doc_id]["doc"], [i.filtered_resps[filter_key] for i in insts])
            for metric, value in metrics.items():
                values[f"{metric},{filter_key}"].append(value)
    aggregations = task_obj.aggregation()
    return {key: (aggregations[key.split(",")[0]](vals), len(vals)) for key, vals in values.items() if vals}


# ---- the whole audit


def verify_eval(run: Path, receipts: list[Path], trusted: dict, *, model: str | None = None,
                include_path: list[str] | None = None, workers: int | str = 1, cache_dir: str | None = None,
                progress: Callable[[int, int], None] | None = None,
                deployments: dict[str, dict | None] | None = None) -> EvalReport:
    """The audit's steps (a)-(f) of the module docstring. `deployments`: the published ones
    (`load_deployments`), as `verify` takes them: a receipt whose facts are not among them fails, and so does
    its sample's coverage (None: the facts are self-asserted, and the report says so)."""
    import time

    from detent_audit.runtime.tokenizer import Tokenizer
    from detent_audit.verifier.plan import collect
    from detent_audit.verifier.receipt_file import open_receipt
    from detent_audit.verifier.verify import verify

    seconds: dict[str, float] = {}
    start = time.perf_counter()
    # (a): the run
    results_path, sample_paths = find_run(run)
    results = _read_json(results_path)
    reported = results.get("results") or {}
    tasks = sorted(t for t in sample_paths if t in reported)
    if not tasks:
        raise BadInput(f"{results_path}: its samples files name no task of its results")
    samples = {t: read_samples(sample_paths[t]) for t in tasks}
    # (c), first half: every receipt opened (steps (1)-(3): read, signature, payload)
    files = collect(receipts)
    receipt_paths, bad = files.receipts, files.bad
    opened: dict[Path, Any] = {}
    failed_open: dict[Path, str] = {o.path: o.message for o in bad}
    for p in receipt_paths:
        try:
            opened[p] = open_receipt(p, trusted)
        except DetentError as exc:
            failed_open[p] = exc.message
    if not opened:
        raise BadInput(f"no receipt under {', '.join(map(str, receipts))} opened with the trusted keys",
                       remedy="give the run's receipts folder and the node's public key")
    checkpoint = _checkpoint(model)
    tokenizer = Tokenizer.from_pretrained(checkpoint)
    # (b): the requests
    lm = make_lm(results, str(checkpoint))
    task_objs = load_tasks(tasks, include_path or [])
    requests: dict[tuple[str, int], list[Request]] = {}
    for t in tasks:
        request_type = "loglikelihood" if task_objs[t].OUTPUT_TYPE in ("loglikelihood", "multiple_choice") else \
            task_objs[t].OUTPUT_TYPE
        for sample in samples[t]:
            requests[(t, int(sample["doc_id"]))] = rebuild_requests(lm, t, request_type, sample, tokenizer)
    seconds["rebuild_requests"] = time.perf_counter() - start
    # (c), second half: one receipt per request, of exactly that request
    pool: dict[tuple, list[Path]] = defaultdict(list)
    for p, r in sorted(opened.items()):
        pool[receipt_key(r)].append(p)
    matched: dict[tuple[str, int, int], Path] = {}
    for (t, doc_id), reqs in requests.items():
        for req in reqs:
            if pool.get(req.key):
                matched[(t, doc_id, req.index)] = pool[req.key].pop(0)
    unmatched = sum(len(v) for v in pool.values())
    # (d): verify the matched receipts, in batches
    start = time.perf_counter()
    report = verify(sorted(set(matched.values())), trusted, model=model, workers=workers, cache_dir=cache_dir,
                    progress=progress, deployments=deployments)
    seconds["verify"] = time.perf_counter() - start
    status = {Path(o.path): o for o in report.outcomes if o.kind == "receipt"}
    # (e): each document's responses from its verified receipts, against what lm-eval logged
    decode = tokenizer.decode
    docs: list[DocVerdict] = []
    verified: dict[str, dict[int, list]] = {t: {} for t in tasks}
    for t in tasks:
        for sample in samples[t]:
            doc_id = int(sample["doc_id"])
            verdict, resps = DocVerdict(t, doc_id, True), []
            for req in requests[(t, doc_id)]:
                where = f"request {req.index}"
                p = matched.get((t, doc_id, req.index))
                if p is None:
                    verdict.reasons.append(f"{where}: no receipt of this request")
                    continue
                outcome = status.get(p)
                if outcome is None or outcome.status != "OK":
                    why = f"{outcome.status}: {outcome.message}" if outcome else "no verdict"
                    verdict.reasons.append(f"{where}: receipt {p.name} did not verify ({why})")
                    continue
                rebuilt = response_of(lm, req, opened[p], decode)
                logged = sample["resps"][req.index][0] if sample["resps"][req.index] else None
                if not _same(logged, rebuilt):
                    verdict.reasons.append(f"{where}: lm-eval logged {json.dumps(logged)[:80]}, the receipt "
                                           f"{p.name} gives {json.dumps(rebuilt)[:80]}")
                    continue
                resps.append(rebuilt)
            verdict.covered = not verdict.reasons
            if verdict.covered:
                verified[t][doc_id] = resps
            docs.append(verdict)
    # (f): the metrics from the verified responses alone
    scores = []
    for t in tasks:
        got = recompute(task_objs[t], t, samples[t], verified[t])
        for key in sorted(k for k in reported[t] if "," in k and not k.split(",")[0].endswith("_stderr")):
            value, n = got.get(key, (None, 0))
            scores.append(Score(t, key, reported[t][key], value, n, len(samples[t])))
    counts = report.counts()
    counts["not_opened"] = len(failed_open)
    return EvalReport(scores, docs, unmatched, counts, seconds, sorted(deployments or {}))


def _checkpoint(model: str | None) -> Path:
    """The checkpoint folder of `model` (None: the embedded default), whose tokenizer the server used."""
    from detent_audit.runtime.named_models import resolve_model

    return resolve_model(model).path
