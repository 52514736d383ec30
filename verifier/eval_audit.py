"""`detent-audit verify-eval`: an lm-eval run's published score, recomputed from verified receipts alone.

(a) Read the run: lm-eval's `results_<time>.json` (the reported scores, the model, its arguments and the run's
settings, the task configs) and its `samples_<task>_<time>.jsonl` (`--log_samples`: per document its requests,
the responses lm-eval parsed, and its metrics). (b) Rebuild the run from the task's own data, never from the
samples file (eval_rebuild.py): every document, target and request with lm-eval's own task code, configured
as the run was; the run's task config, version, document count and task hash, and each logged document,
target and lm-eval hash (`doc_hash`, `prompt_hash`, `target_hash`) against the rebuilt ones; the run covers
exactly the task's documents (all, or the `--limit` prefix in lm-eval's order). Every body lm-eval sent, by
its own model class's request loop (batching, tokenization, truncation, `_create_payload`). (c) Open the
receipts (verification steps (1)-(3)) and match each request to the receipt that binds the very body
lm-eval sent for it, at its place in that body's batch (each receipt answers at most one request).
(d) Verify the matched receipts (`verify`, steps (1)-(10): among them, that the bound body gives the prompt
ids and sampling run). (e) From each verified receipt alone, rebuild the response the server gave (the same
response code: the echoed logprobs and top alternatives, or the output text cut at its stop string) and
parse it with lm-eval's own parser; it must equal the response lm-eval logged. (f) Recompute each
document's metrics with the task's own documents, filters and `process_results`, aggregate with its own
aggregations, over the documents whose every request verified (the coverage), and compare with the reported
score.

A document is named, with the reason, when it was not logged, its logged document, target or hashes are not
the task's, a request has no receipt of the body lm-eval sent, its receipt failed verification, or the
response lm-eval logged is not the one its receipt's tokens give. The run is failed, each named, for a
logged document that is not one of the run's, a samples file of a task the results do not list, a reported
task or group whose score cannot be recomputed, and a task config, version, count or task hash that is not
the task's. Exit codes: 0 when every document is covered, nothing is named and every recomputed score
equals the reported one bit for bit; 1 otherwise; 2 bad input; 3 when the task's data cannot be loaded here.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from detent_audit.errors import BadInput, DetentError
from detent_audit.manifests.receipt import Receipt
from detent_audit.runtime.stop_strings import output_text
from detent_audit.verifier.eval_inputs import find_run, read_results, read_samples
from detent_audit.verifier.eval_rebuild import (
    API_OF_MODEL,
    RebuiltDoc,
    RebuiltTask,
    RunSettings,
    Sent,
    position_of,
    rebuild_tasks,
    replay,
)

if TYPE_CHECKING:
    from lm_eval.api.model import LM

LOGPROB_FLOOR = -9999.0  # what the server writes for a logprob JSON cannot hold (server/responses.py)


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
        return {"task": self.task, "metric": self.metric, "reported": self.reported,
                "recomputed": self.recomputed, "equal": self.equal, "covered": self.covered,
                "total": self.total}


def score_line(score: Score, docs: Sequence[DocVerdict]) -> str:
    """A score's verdict line: OK only where the scores are equal and every document of its task is covered;
    a short coverage names the documents missing (each is named with its reasons on a line of its own)."""
    full = score.covered >= score.total
    tag = "OK" if score.equal and full else "FAIL"
    line = (f"{tag}: {score.task} {score.metric}: reported {score.reported}, recomputed from verified "
            f"receipts {score.recomputed}, coverage {score.covered}/{score.total}")
    if full:
        return line
    missing = [d.doc_id for d in docs if d.task == score.task and not d.covered]
    more = f" and {len(missing) - 10} more" if len(missing) > 10 else ""
    shown = ", ".join(map(str, missing[:10])) + more
    return (line + f": {score.total - score.covered} document(s) not covered"
            + (f" (doc {shown})" if missing else "")
            + f", so the recomputed score is over {score.covered} of the {score.total} documents the run "
            "reports")


@dataclass
class EvalReport:
    scores: list[Score]
    docs: list[DocVerdict]
    receipts_unmatched: int
    receipt_counts: dict[str, int]
    problems: list[str] = field(default_factory=list)  # the run's named failures beyond its documents
    # per task: the run's documents, the task's, the run's --limit
    documents: dict[str, dict[str, Any]] = field(default_factory=dict)
    seconds: dict[str, float] = field(default_factory=dict)
    published: list[str] = field(default_factory=list)  # deployment hashes the facts were checked against
    # per task: the SHA-256 of its rebuilt config (lm-eval's `hash_string` of it, its metadata apart), version
    task_configs: dict[str, dict[str, Any]] = field(default_factory=dict)
    # the receipts matched to the run's requests: request id, SHA-256 of the payload, verdict
    receipts: list[dict[str, str]] = field(default_factory=list)
    inputs: dict[str, str] = field(default_factory=dict)  # the results and samples files: name -> SHA-256

    @property
    def exit_code(self) -> int:
        full = all(d.covered for d in self.docs) and bool(self.docs) and not self.problems
        return 0 if full and all(s.equal for s in self.scores) else 1

    def to_json(self) -> dict:
        covered = sum(d.covered for d in self.docs)
        return {"scores": [s.to_json() for s in self.scores],
                "coverage": {"covered": covered, "total": len(self.docs)}, "documents": self.documents,
                "differing": [d.to_json() for d in self.docs if not d.covered], "problems": self.problems,
                "receipts": {**self.receipt_counts, "unmatched": self.receipts_unmatched},
                "published_deployments": self.published, "facts_self_asserted": not self.published,
                "seconds": self.seconds, "exit_code": self.exit_code}


# ---- (a): the run lm-eval wrote: `eval_inputs` reads it (bounded readers) and checks its shape


# ---- (b): lm-eval's own model class, as the run made it


def _model_args(results: dict) -> tuple[str, dict[str, object]]:
    config = results.get("config") or {}
    name, args = config.get("model"), config.get("model_args") or {}
    if name not in API_OF_MODEL:
        raise BadInput(f"the run used lm-eval model {name!r}",
                       remedy="verify-eval audits runs against an OpenAI-compatible server: "
                              "local-completions or local-chat-completions")
    if isinstance(args, str):
        from lm_eval.utils import simple_parse_args_string

        args = simple_parse_args_string(args)
    if not isinstance(args, dict):
        raise BadInput(f"the results file's config.model_args is not lm-eval's model arguments: {args!r:.80}")
    return name, dict(args)


def make_lm(results: dict, tokenizer_path: str | None, batch_size: int) -> LM:
    """lm-eval's model object for the run's model, arguments and batch size, built offline: its tokenizer from
    the run's `tokenizer` argument (else `tokenizer_path`: the deployment's checkpoint), no request sent."""
    from lm_eval.api.registry import get_model

    name, args = _model_args(results)
    args.pop("base_url", None)  # nothing is sent; a base_url would make it probe the server's tokenizer
    if name == "local-completions":
        run_tokenizer = str(args.get("tokenizer") or "")
        if not run_tokenizer or (Path(run_tokenizer).is_absolute() and not Path(run_tokenizer).exists()):
            # the run's folder is not on this machine: the deployment's checkpoint (a different tokenizer
            # gives other bodies, which no receipt binds)
            args["tokenizer"] = tokenizer_path
        args["tokenizer_backend"] = "huggingface"
    try:
        with contextlib.redirect_stderr(io.StringIO()):
            return get_model(name)(**{**args, "batch_size": batch_size})
    except Exception as exc:  # noqa: BLE001 (lm-eval raises many kinds for bad arguments)
        raise BadInput(f"cannot rebuild lm-eval's {name} model from the run's arguments: {exc}",
                       remedy="give --model the checkpoint folder lm-eval tokenized with") from None


# ---- (e): the response a verified receipt gives, parsed by lm-eval


def _json_logprob(value: float) -> float:
    return value if math.isfinite(value) else LOGPROB_FLOOR  # JSON has no -inf: the server writes -9999.0


def response_of(lm: LM, req: Sent, receipt: Any, decode: Callable) -> object:
    """What lm-eval parses from the response this receipt's bits give: the echoed prompt's logprobs, or the
    output text cut at its stop string (the server's rule, stop_strings.py).

    A response's top_logprobs entry maps each alternative's text, then the token's own, to its logprob, the
    first of equal texts kept; lm-eval reads only its values (`is_greedy`: the token's logprob equals the
    largest, the top-1's, which is always kept). Keyed here by token id, the values lm-eval reads are the
    same."""
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
        (ll, greedy), = type(lm).parse_logprobs(outputs={"choices": [choice]}, tokens=[ids],
                                                ctxlens=[req.ctxlen])
        return [ll, greedy]
    text, _ = output_text(decode, list(out.token_ids), receipt.request.sampling.stop)
    choice = {"index": 0, "text": text, "message": {"role": "assistant", "content": text}}
    return lm.parse_generations(outputs={"choices": [choice]})[0]


def _same(logged: object, rebuilt: object) -> bool:
    """lm-eval logs a loglikelihood response (a tuple) as the str() of each value, a generation as its text;
    str() of a float is its shortest round-trip form, so equal strings are equal bits."""
    if isinstance(rebuilt, list):
        return isinstance(logged, list) and [str(x) for x in logged] == [str(x) for x in rebuilt]
    return logged == rebuilt


# ---- (f): the metrics, with the task's own code


def recompute(task: RebuiltTask, responses: dict[int, list]) -> dict[str, tuple[float, int]]:
    """{"metric,filter": (aggregate, documents)} over the documents in `responses` (doc_id -> each request's
    response), each the task's own document and requests, through its filters, `process_results` and
    aggregations."""
    from lm_eval.api.instance import Instance

    task_obj = task.task
    scored = task_obj.OUTPUT_TYPE in ("loglikelihood", "multiple_choice")
    instances: dict[int, list] = {}
    for doc_id, resps in sorted(responses.items()):
        insts = [Instance(i.request_type, i.doc, i.arguments, i.idx, (task.name, doc_id, 1))
                 for i in task.docs[doc_id].instances]
        for inst, resp in zip(insts, resps):
            inst.resps.append(tuple(resp) if scored else resp)
        instances[doc_id] = insts
    flat = [inst for insts in instances.values() for inst in insts]
    if not flat:
        return {}
    for f in getattr(task_obj, "_filters", []):
        f.apply(flat)
    values: dict[str, list] = defaultdict(list)
    for doc_id, insts in instances.items():
        for filter_key in insts[0].filtered_resps:
            filtered = [i.filtered_resps[filter_key] for i in insts]
            metrics = task_obj.process_results(task.docs[doc_id].doc, filtered)
            for metric, value in metrics.items():
                values[f"{metric},{filter_key}"].append(value)
    aggregations = task_obj.aggregation()
    return {key: (aggregations[key.split(",")[0]](vals), len(vals)) for key, vals in values.items() if vals}


# ---- (b), checked: the run's record of its tasks and documents against the rebuilt ones


def _tasks_of(results: dict, sample_paths: dict[str, Path],
              results_path: Path) -> tuple[list[str], list[str]]:
    """The tasks to audit (reported, and logged), and the named failures of the run's task list: a samples
    file of a task the results do not list, a reported task with no samples file, a group's score."""
    reported = results.get("results")
    if not isinstance(reported, dict):
        raise BadInput(f"{results_path}: no \"results\" object of reported scores")
    subtasks = results.get("group_subtasks")
    groups = {g for g, subs in subtasks.items() if subs} if isinstance(subtasks, dict) else set()
    problems = [f"samples file of task {t}, which the results do not list"
                for t in sorted(set(sample_paths) - set(reported))]
    problems += [f"task {t} is reported, and its samples were not logged: its score cannot be recomputed"
                 for t in sorted(set(reported) - set(sample_paths) - groups)]
    problems += [f"group {g}: its score is not recomputed (verify-eval recomputes each task's)"
                 for g in sorted(groups)]
    configs = results.get("configs") or {}
    order = [t for t in configs if t in reported and t in sample_paths and t not in groups]  # lm-eval's order
    tasks = order + sorted(t for t in reported if t in sample_paths and t not in groups and t not in order)
    if not tasks:
        raise BadInput(f"{results_path}: its samples files name no task of its results")
    return tasks, problems


def config_hash(c: dict) -> str:
    """lm-eval's `hash_string` (SHA-256 hex) of a task config as JSON with sorted keys."""
    from lm_eval.utils import hash_string

    return str(hash_string(json.dumps(c, sort_keys=True, ensure_ascii=False)))


def _config_record(t: RebuiltTask) -> dict[str, Any]:
    config = dict(t.config)
    version = _at(config, "metadata", "version")
    config.pop("metadata", None)
    return {"sha256": config_hash(config), "version": version}


def _task_problems(t: RebuiltTask, results: dict, logged: list[dict]) -> list[str]:
    """The run's record of a task against the task rebuilt: its config (lm-eval's `dump_config`, but for the
    run-specific metadata), version, document count and per-task hash; and the logged documents: every one
    of the task's documents once (all, or the limit's prefix), none other."""
    problems = []
    logged_config = dict(_at(results, "configs", t.name) or {})
    ours = dict(t.config)
    logged_version, our_version = _at(logged_config, "metadata", "version"), _at(ours, "metadata", "version")
    logged_config.pop("metadata", None)
    ours.pop("metadata", None)

    if logged_config != ours:
        differ = sorted(k for k in set(logged_config) | set(ours) if logged_config.get(k) != ours.get(k))
        logged_hash, our_hash = config_hash(logged_config)[:16], config_hash(ours)[:16]
        problems.append(f"task {t.name}: the run's task config (hash {logged_hash}) is not the task's (hash "
                        f"{our_hash}): {', '.join(differ)} differ")
    if logged_version != our_version:
        problems.append(f"task {t.name}: the run logged version {logged_version!r}, the task is version "
                        f"{our_version!r}")
    expected = list(t.docs)
    effective = _at(results, "n-samples", t.name, "effective")
    if effective != len(expected):
        problems.append(f"task {t.name}: the run reports {effective!r} documents, the task's run has "
                        f"{len(expected)}")
    task_hash = _at(results, "task_hashes", t.name)
    ours_hash = t.task_hash(expected * max(1, len(getattr(t.task, "_filters", []))))
    if task_hash is not None and task_hash != ours_hash:
        problems.append(f"task {t.name}: the run's task hash {str(task_hash)[:16]} is not the task's "
                        f"documents' {ours_hash[:16]}")
    extra = sorted(int(s["doc_id"]) for s in logged if int(s["doc_id"]) not in t.docs)
    if extra:
        problems.append(f"task {t.name}: logged document(s) {', '.join(map(str, extra[:20]))} are not among "
                        f"the run's {len(expected)} documents of the task")
    return problems


def _at(obj: Any, *keys: str) -> Any:
    """obj[k1][k2]..., or None where a level is not a JSON object or lacks the key."""
    for key in keys:
        obj = obj.get(key) if isinstance(obj, dict) else None
    return obj


def _doc_problems(doc: RebuiltDoc, sample: dict | None) -> list[str]:
    """A logged document against the task's own: the document, its target, and lm-eval's three hashes."""
    from lm_eval.utils import handle_non_serializable

    if sample is None:
        return ["the run logged no sample of this document of the task"]

    def as_json(x: object) -> str:
        return json.dumps(x, sort_keys=True, default=handle_non_serializable, ensure_ascii=False)

    problems = []
    if as_json(sample.get("doc")) != as_json(doc.doc):
        problems.append("the logged document is not the task's document of this doc_id")
    if sample.get("target") != str(doc.target):  # lm-eval logs the target's str()
        problems.append(f"the logged target {as_json(sample.get('target'))[:40]} is not the task's "
                        f"{as_json(str(doc.target))[:40]}")
    arguments = {f"gen_args_{i}": {f"arg_{j}": a for j, a in enumerate(inst.args)}
                 for i, inst in enumerate(doc.instances)}  # as lm-eval's tracker logs them
    if as_json(sample.get("arguments")) != as_json(arguments):
        problems.append("the logged requests' arguments are not the task's requests")
    for name in ("doc_hash", "prompt_hash", "target_hash"):
        if sample.get(name) != getattr(doc, name):
            problems.append(f"{name} {str(sample.get(name))[:16]} is not the task's "
                            f"{getattr(doc, name)[:16]}")
    return problems


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
    results = read_results(results_path)
    tasks, problems = _tasks_of(results, sample_paths, results_path)
    samples = {t: read_samples(sample_paths[t]) for t in tasks}
    # (c), first half: every receipt opened (steps (1)-(3): read, signature, payload)
    files = collect(receipts)
    receipt_paths, bad = files.receipts, files.bad
    opened: dict[Path, Receipt] = {}
    failed_open: dict[Path, str] = {Path(o.path): o.message for o in bad}
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
    # (b): the documents and requests, from the task's own data; the bodies lm-eval sent for them
    settings = RunSettings.of(results)
    lm = make_lm(results, str(checkpoint), settings.batch_size)
    model_name, model_args = _model_args(results)
    rebuilt = rebuild_tasks(tasks, include_path or [], settings, lm, metadata=model_args)
    for t in tasks:
        problems += _task_problems(rebuilt[t], results, samples[t])
    api = API_OF_MODEL[model_name]
    sent = replay(lm, api, rebuilt)
    seconds["rebuild_requests"] = time.perf_counter() - start
    # (c), second half: each request's receipt binds the very body lm-eval sent for it, at its place
    pool: dict[tuple[str, bytes, int], list[tuple[str, int, int]]] = defaultdict(list)
    for key, s in sent.items():
        pool[(s.api, s.body, s.position)].append(key)
    matched: dict[tuple[str, int, int], Path] = {}
    unmatched = 0
    for p, r in sorted(opened.items()):
        client = r.request.client
        position = position_of(client.api, client.body_json, r.request.request_id)
        keys = pool.get((client.api, client.body_json, position)) if position is not None else None
        if keys:
            matched[keys.pop(0)] = p
        else:
            unmatched += 1
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
        logged = {int(s["doc_id"]): s for s in samples[t]}
        for doc_id, doc in rebuilt[t].docs.items():
            sample = logged.get(doc_id)
            verdict, resps = DocVerdict(t, doc_id, True, _doc_problems(doc, sample)), []
            for inst in doc.instances if sample is not None else []:
                where = f"request {inst.idx}"
                found = matched.get((t, doc_id, inst.idx))
                if found is None:
                    verdict.reasons.append(f"{where}: no receipt binds the body lm-eval sent for it")
                    continue
                outcome = status.get(found)
                if outcome is None or outcome.status != "OK":
                    why = f"{outcome.status}: {outcome.message}" if outcome else "no verdict"
                    verdict.reasons.append(f"{where}: receipt {found.name} did not verify ({why})")
                    continue
                response = response_of(lm, sent[(t, doc_id, inst.idx)], opened[found], decode)
                logged_resps = sample["resps"] if sample is not None else None
                in_range = isinstance(logged_resps, list) and inst.idx < len(logged_resps)
                got = logged_resps[inst.idx] if in_range and isinstance(logged_resps, list) else None
                first = got[0] if isinstance(got, list) and got else None
                if not _same(first, response):
                    verdict.reasons.append(f"{where}: lm-eval logged {json.dumps(first)[:80]}, the receipt "
                                           f"{found.name} gives {json.dumps(response)[:80]}")
                    continue
                resps.append(response)
            verdict.covered = not verdict.reasons
            if verdict.covered:
                verified[t][doc_id] = resps
            docs.append(verdict)
    # (f): the metrics from the verified responses alone, over the task's own documents
    scores = []
    for t in tasks:
        got = recompute(rebuilt[t], verified[t])
        reported = results["results"][t] if isinstance(results["results"][t], dict) else {}
        for key in sorted(k for k in reported if "," in k and not k.split(",")[0].endswith("_stderr")):
            value, n = got.get(key, (None, 0))
            scores.append(Score(t, key, reported[key], value, n, len(rebuilt[t].docs)))
    counts = report.counts()
    counts["not_opened"] = len(failed_open)
    documents = {t: {"run": len(rebuilt[t].docs), "task": rebuilt[t].task_documents, "limit": settings.limit}
                 for t in tasks}
    rests_on = [{"request_id": opened[p].request.request_id, "sha256": opened[p].digest,
                 "verdict": status[p].status if p in status else "not verified"}
                for p in sorted(set(matched.values()))]
    inputs = {p.name: _file_sha256(p) for p in (results_path, *(sample_paths[t] for t in tasks))}
    return EvalReport(scores, docs, unmatched, counts, problems, documents, seconds,
                      sorted(deployments or {}), {t: _config_record(rebuilt[t]) for t in tasks}, rests_on,
                      inputs)


def _file_sha256(path: Path) -> str:
    """The SHA-256 of a file the audit read, read in blocks."""
    import hashlib

    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _checkpoint(model: str | None) -> Path:
    """The checkpoint folder of `model` (None: the embedded default), whose tokenizer the server used."""
    from detent_audit.runtime.named_models import resolve_model

    return resolve_model(model).path
