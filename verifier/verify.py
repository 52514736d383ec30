"""`detent-audit verify`: receipts, folders and run manifests, checked step by step (docs/design.md 7).

(0) bounded read and decode (regular files only); (1) signature against the trusted keys; (2) schema,
canonical re-encoding, deployment and tuple hashes; (3) deployment: the local engine rebuilt from the
receipt's facts must match them field by field (stock mode, whose bits depend on the batch, is not
comparable); (4) the tuple must be legal for the solved pins, and the one the facts record; (5) before
re-executing, what the output itself refutes FAILs (ids outside the vocabulary, an empty output, a finish
other than the scheduler's rule gives); then re-execute: `rescore` (one teacher-forced prefill per request,
many requests batched: batch invariance makes batching legal; the seeded draw at every position is
recomputed from the logits) or `replay` (autoregressive, seeded, batched; its finish is compared too);
(6) compare token ids and logprob bits; (7) the report. A receipt that crashes a step is that receipt's
verdict, never the run's end. Run manifests: signature, the Merkle root of their receipts present, each
request answered once. `sample` draws its seed at random unless one is given, so a node cannot know it.

`workers` > 1 re-executes the batches in that many processes, each an engine of the receipt's own deployment
(its thread count included), so the bits are the same as one process's. A verifier's spare cores then
shorten the run (2 workers on 2 cores: 1.55-1.62x, benchmarks/verify.py), where giving them to one engine would
change the deployment and make every receipt not comparable. `workers="auto"` (the CLI's default) takes as
many as the cores allow at the receipts' thread count, no more than there are full batches of receipts (a
worker's start, 2.4-2.8 s on the CI CPU for the interpreter, torch and the engine, pays only then), and no
more than the available memory holds engines.
"""

from __future__ import annotations

import json
import math
import multiprocessing
import os
import random
import struct
import time
from collections import Counter
from collections.abc import Callable, Iterable
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from detent_audit.engine.facts import facts_hash
from detent_audit.engine.llm import EngineConfig
from detent_audit.engine.sampling_params import SamplingParams
from detent_audit.engine.stop_strings import check_stop, output_text
from detent_audit.engine.tuples import tuple_hash
from detent_audit.errors import BadInput, DetentError
from detent_audit.manifests import encoding as enc
from detent_audit.manifests.dsse import read_envelope_bytes
from detent_audit.manifests.errors import InvalidReceipt, ManifestMismatch
from detent_audit.manifests.receipt import Receipt, verify_envelope
from detent_audit.manifests.run_manifest import RunManifest, check_run, verify_run_manifest
from detent_audit.verifier.compare import Divergence, first_divergence, prompt_divergence
from detent_audit.verifier.reconstruct import NotComparable, reconstruct

RECEIPT_SUFFIX, MANIFEST_SUFFIX = ".receipt", ".manifest"
BATCH = 64  # requests re-executed together
EARLIEST_UNIX_NS = 1_577_836_800 * 10**9  # 2020-01-01T00:00:00Z: no receipt is older than this release line
CLOCK_SKEW_NS = 600 * 10**9  # a receipt may be dated this far after the verifier's clock
MAX_DEPLOYMENT_FILE = 16 << 20
_ENGINE_OVERHEAD = 512 << 20  # bytes a worker's engine needs besides its weights (torch, KV pool, activations)


@dataclass
class Outcome:
    """One receipt's or manifest's verdict."""

    path: str
    kind: str                      # receipt | manifest
    status: str                    # OK | FAIL | BAD | NOT_COMPARABLE
    message: str = ""
    request_id: str | None = None
    divergence: Divergence | None = None
    fields: list[str] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)  # a manifest's: digests of its receipts not found

    def to_json(self) -> dict:
        return {"path": self.path, "kind": self.kind, "status": self.status, "message": self.message,
                "request_id": self.request_id, "fields": self.fields, "missing": self.missing,
                "divergence": self.divergence.to_json() if self.divergence else None}


@dataclass
class Coverage:
    """Which receipts the run manifests cover: `receipts` found, `covered` by a manifest whose signature
    verified, the uncovered ones' paths, and the manifests read."""

    receipts: int = 0
    covered: int = 0
    manifests: int = 0
    uncovered: list[str] = field(default_factory=list)

    def to_json(self) -> dict:
        return {"receipts": self.receipts, "covered": self.covered, "manifests": self.manifests,
                "uncovered": self.uncovered}


@dataclass
class Report:
    outcomes: list[Outcome]
    mode: str
    sample_seed: int | None = None  # the seed the sample was drawn with (to repeat it), when sampling
    # facts checked against published deployments (their hashes); empty: the receipts' facts are self-asserted
    published: list[str] = field(default_factory=list)
    coverage: Coverage = field(default_factory=Coverage)

    @property
    def exit_code(self) -> int:
        statuses = {o.status for o in self.outcomes}
        return 1 if "FAIL" in statuses else 2 if "BAD" in statuses else 3 if "NOT_COMPARABLE" in statuses else 0

    def counts(self) -> dict[str, int]:
        return {s: sum(o.status == s for o in self.outcomes) for s in ("OK", "FAIL", "BAD", "NOT_COMPARABLE")}


def collect(paths: Iterable[str | Path], in_folders: set[Path] | None = None
            ) -> tuple[list[Path], list[Path], list[Outcome]]:
    """Receipt and manifest files named or found under folders (sorted; those found under folders are added to
    `in_folders`); unreadable paths, and folders with neither, as BAD (nothing verified is not a pass)."""
    receipts: set[Path] = set()
    manifests: set[Path] = set()
    bad: list[Outcome] = []
    for p in map(Path, paths):
        if p.is_dir():
            found_r: set[Path] = set()
            found_m: set[Path] = set()

            def unreadable(exc: OSError) -> None:  # a folder skipped in silence could hide a receipt
                bad.append(Outcome(str(exc.filename), "receipt", "BAD",
                                   f"{exc.filename}: cannot list this folder ({exc.strerror or exc})"))

            for folder, _, names in os.walk(p, onerror=unreadable):  # symlinked folders are not followed
                found_r |= {Path(folder, n) for n in names if n.endswith(RECEIPT_SUFFIX)}
                found_m |= {Path(folder, n) for n in names if n.endswith(MANIFEST_SUFFIX)}
            if not found_r and not found_m:
                bad.append(Outcome(str(p), "receipt", "BAD",
                                   f"{p}: no *{RECEIPT_SUFFIX} or *{MANIFEST_SUFFIX} files in this folder"))
            receipts |= found_r
            manifests |= found_m
            if in_folders is not None:
                in_folders |= found_r
        elif p.is_file():
            (manifests if p.suffix == MANIFEST_SUFFIX else receipts).add(p)
        else:
            bad.append(Outcome(str(p), "receipt", "BAD", f"{p}: no such file or folder"))
    return sorted(receipts), sorted(manifests), bad


def sample_paths(paths: list[Path], fraction: float | None, seed: int) -> list[Path]:
    if fraction is None or fraction >= 1:
        return paths
    k = max(1, math.ceil(fraction * len(paths))) if paths else 0
    return sorted(random.Random(seed).sample(paths, k))


def _open_receipt(path: Path, trusted: dict) -> Receipt:
    # (0): bounded read; (1)-(2): signature before parsing, then schema and canonical re-encoding
    receipt = verify_envelope(read_envelope_bytes(path), trusted).receipt
    # (2): the hashes the receipt states are the hashes of what it carries
    if facts_hash(receipt.deployment_facts) != receipt.deployment_hash:
        raise InvalidReceipt(f"{path.name}: deployment hash does not match the facts it carries")
    if tuple_hash(receipt.tuple_values) != receipt.tuple_hash:
        raise InvalidReceipt(f"{path.name}: tuple hash does not match the tuple it carries")
    return receipt


def load_deployments(specs: Iterable[str]) -> dict[str, dict | None]:
    """Published deployments by hash: each spec a 64-hex deployment hash, or a file `serve --publish-deployment`
    wrote (its facts must hash to its hash). Raises `BadInput` naming the spec."""
    out: dict[str, dict | None] = {}
    for spec in specs:
        spec = str(spec)
        if len(spec) == 64 and enc.HEX_DIGITS.issuperset(spec):
            out.setdefault(spec, None)
            continue
        try:
            doc = json.loads(enc.read_bounded(spec, MAX_DEPLOYMENT_FILE, what="published deployment"))
        except InvalidReceipt as exc:
            raise BadInput(exc.message, remedy="pass a deployment hash (64 hex digits) or the file that "
                                               "`detent-audit serve --publish-deployment FILE` wrote") from None
        except (ValueError, RecursionError) as exc:
            raise BadInput(f"--deployment {spec}: not JSON ({str(exc)[:200]})") from None
        if not isinstance(doc, dict) or not isinstance(doc.get("facts"), dict) or not isinstance(doc.get("hash"), str):
            raise BadInput(f"--deployment {spec}: expected a published deployment ({{facts, hash}})")
        if facts_hash(doc["facts"]) != doc["hash"]:
            raise BadInput(f"--deployment {spec}: its facts do not hash to its hash {doc['hash'][:16]}...",
                           remedy="obtain the file from the node's operator again")
        out[doc["hash"]] = doc["facts"]
    return out


def _receipt_problem(p: Path, r: Receipt, deployments: dict[str, dict | None] | None, now_ns: int) -> str | None:
    """What a receipt's own content refutes before any engine: its file names another request; a time no node
    could have signed at; a deployment that is not among the published ones."""
    if p.name != f"{r.request.request_id}{RECEIPT_SUFFIX}":
        return (f"the file is named {p.name!r}, but it is the receipt of request {r.request.request_id!r} (a copy "
                "under another request's name)")
    if not EARLIEST_UNIX_NS <= r.time_unix_ns <= now_ns + CLOCK_SKEW_NS:
        return (f"signed at {r.time_unix_ns} ns since the epoch, outside [2020-01-01, the verifier's clock + "
                f"{CLOCK_SKEW_NS // 10**9} s]: no node signed it then")
    if deployments is not None and r.deployment_hash not in deployments:
        return (f"its deployment {r.deployment_hash[:16]}... is not among the {len(deployments)} published "
                "deployment(s) given with --deployment")
    return None


def _params(r: Receipt) -> SamplingParams:
    s = r.request.sampling
    # max_tokens 0 (an echo receipt that drew nothing): the engine's request draws one token, never compared
    return SamplingParams(temperature=s.temperature, top_k=s.top_k, top_p=s.top_p, max_tokens=max(1, s.max_tokens),
                          seed=r.request.seed, stop_token_ids=tuple(s.stop_token_ids), ignore_eos=s.ignore_eos,
                          logprobs=s.logprobs, stop=tuple(s.stop))


def _finish_problem(r: Receipt, eos: set[int], max_model_len: int, decode: Callable | None = None) -> str | None:
    """The stated finish must be the one generation reaches (the scheduler's rule): no stop token before the
    end, and no earlier token whose text completed a stop string (recomputed with the deployment's tokenizer,
    `decode`); 'stop' exactly when the last token is a stop token or completes a stop string (a stop wins over
    a length limit); else 'length', at max_tokens or where prompt and output fill the context."""
    s, tokens, reason = r.request.sampling, list(r.output.token_ids), r.output.finish_reason
    stops = set(s.stop_token_ids) | (set() if s.ignore_eos else eos)
    for i, t in enumerate(tokens[:-1]):
        if t in stops:
            return f"output token {i} ({t}) is a stop token, yet generation went on"
    if not tokens:
        if s.max_tokens == 0 and r.scoring is not None and reason == "length":
            return None  # echo only: the prompt scored, nothing drawn
        return "an empty output: the engine draws at least one token for every request it admits"
    if r.scoring is None and s.max_tokens == 0:
        return "max_tokens 0 in a receipt that scores no prompt"
    stopped_by_text = False
    if s.stop:
        if decode is None:
            return "the receipt has stop strings, and no tokenizer was given to check them"
        stopped_by_text, problem = check_stop(decode, tokens, s.stop)
        if problem is not None:
            return problem
    ends_on_stop = tokens[-1] in stops or stopped_by_text
    if ends_on_stop and reason != "stop":
        what = f"stop token {tokens[-1]}" if tokens[-1] in stops else "a token whose text completes a stop string"
        return f"the output ends on {what}, so it finished with 'stop', not {reason!r}"
    if reason == "stop" and not ends_on_stop:
        return ("finish 'stop' without a stop token at the end" + (", and the output text contains none of the "
                "stop strings (the node cut it early)" if s.stop else ""))
    total = len(r.request.prompt_token_ids) + len(tokens)
    if reason == "length" and len(tokens) != s.max_tokens and total < max_model_len:
        return (f"finish 'length' after {len(tokens)} of max_tokens={s.max_tokens} tokens, with {total} of the "
                f"context's {max_model_len} used")
    return None


def _kv_tokens(r: Receipt, mode: str) -> int:
    """The most tokens re-executing `r` holds in the KV cache: a rescore, its prompt and output; a replay, its
    prompt and the longer of its output and max_tokens (what the scheduler reserves). The engine caps it at its
    model's context."""
    prompt, output = len(r.request.prompt_token_ids), len(r.output.token_ids)
    return prompt + (output if mode == "rescore" else max(output, r.request.sampling.max_tokens))


def _tuple_problem(r: Receipt) -> str | None:
    """The tuple a receipt commits to must be the engine's own: its facts' mode and per-family tuple (the
    engine is rebuilt, and its facts compared, from the facts; a different signed tuple would go unchecked)."""
    try:
        recorded = {"mode": {"name": r.deployment_facts["engine"]["mode"]}, **r.deployment_facts["tuple"]}
    except (KeyError, TypeError):
        return "the receipt's facts record no engine mode or tuple"
    if facts_hash(dict(r.tuple_values)) != facts_hash(recorded):
        return "the receipt's tuple is not the one its deployment facts record"
    return None


def _vocabulary_problem(r: Receipt, vocab_size: int) -> str | None:
    """Token ids the model cannot have read or drawn (checked before they reach an embedding or a gather)."""
    for what, ids in (("prompt", r.request.prompt_token_ids), ("output", r.output.token_ids)):
        bad = next((t for t in ids if not 0 <= t < vocab_size), None)
        if bad is not None:
            return f"{what} token id {bad} is outside the model's vocabulary of {vocab_size}"
    return None


def verify(paths: Iterable[str | Path], trusted: dict, *, model: str | Path | None = None, mode: str = "rescore",
           sample: float | None = None, seed: int | None = None, cache_dir: str | None = None,
           threads: int | None = None, tuple_override: dict | None = None, workers: int | str = 1,
           progress: Callable[[int, int], None] | None = None,
           deployments: dict[str, dict | None] | None = None) -> Report:
    """Verify every receipt and run manifest under `paths`; never raises for a bad receipt: reports it.
    `workers`: processes that re-execute (see the module docstring). `deployments`: the published ones
    (`load_deployments`); every receipt's deployment must be one of them (None: facts are self-asserted)."""
    if mode not in ("rescore", "replay"):
        raise DetentError(f"unknown mode {mode!r}", remedy="use --mode rescore or --mode replay")
    if workers != "auto" and (isinstance(workers, bool) or not isinstance(workers, int) or workers < 1):
        raise BadInput(f"workers must be a whole number >= 1 or 'auto', got {workers!r}")
    in_folders: set[Path] = set()
    receipt_paths, manifest_paths, outcomes = collect(paths, in_folders)
    opened: dict[Path, Receipt] = {}
    now_ns = time.time_ns()
    for p in receipt_paths:
        try:
            receipt = _open_receipt(p, trusted)
            problem = _receipt_problem(p, receipt, deployments, now_ns)
            if problem is None:
                opened[p] = receipt
            else:
                outcomes.append(Outcome(str(p), "receipt", "FAIL", problem, receipt.request.request_id))
        except DetentError as exc:
            outcomes.append(Outcome(str(p), "receipt", "FAIL" if exc.exit_code == 1 else "BAD", exc.message))
        except Exception as exc:  # noqa: BLE001 (a signed payload that breaks a check is a bad receipt, not a crash)
            outcomes.append(Outcome(str(p), "receipt", "BAD", f"{p.name}: {type(exc).__name__}: {exc}"))
    manifests: list[RunManifest] = []
    for m in manifest_paths:
        outcome, manifest = _check_manifest(m, trusted, opened)
        outcomes.append(outcome)
        if manifest is not None:
            manifests.append(manifest)
    coverage = Coverage(len(opened), manifests=len(manifests))
    outcomes += _check_coverage(opened, manifests, in_folders, coverage)

    if sample is not None and seed is None:  # unpredictable unless stated: a node must not know the sample
        seed = int.from_bytes(os.urandom(8), "little")
    chosen = sample_paths(sorted(opened), sample, seed or 0)
    groups: dict[tuple[str, str], list[Path]] = {}
    for p in chosen:
        groups.setdefault((opened[p].deployment_hash, opened[p].tuple_hash), []).append(p)
    if workers == "auto":
        workers = auto_workers(len(chosen), [opened[g[0]].deployment_facts for g in groups.values()], threads)
    # the batches, each of one deployment and tuple; with workers, small enough that every worker gets one
    batches = []
    for _, group in sorted(groups.items()):
        size = BATCH if workers == 1 else max(1, min(BATCH, math.ceil(len(group) / workers)))
        batches += [group[start:start + size] for start in range(0, len(group), size)]
    kv_tokens = {key: max(_kv_tokens(opened[p], mode) for p in group) for key, group in groups.items()}
    options = _Options(None if model is None else str(model), mode, cache_dir, threads, tuple_override, kv_tokens)
    done, total = 0, len(chosen)
    if workers == 1 or len(batches) <= 1:
        engines: dict = {}
        for batch in batches:
            outcomes += _run_batch([(p, opened[p]) for p in batch], options, engines)
            done += len(batch)
            if progress:
                progress(done, total)
    else:
        spawn = multiprocessing.get_context("spawn")  # no fork of a process that holds torch's threads
        with ProcessPoolExecutor(min(workers, len(batches)), mp_context=spawn) as pool:
            pending: dict[Future, int] = {
                pool.submit(_worker_batch, [(str(p), opened[p].to_bytes()) for p in batch], options): len(batch)
                for batch in batches}
            while pending:
                finished, _ = wait(pending, return_when=FIRST_COMPLETED)
                for future in finished:
                    outcomes += future.result()  # an engine that cannot be built raises here, as serially
                    done += pending.pop(future)
                    if progress:
                        progress(done, total)
    order = {str(p): i for i, p in enumerate([*receipt_paths, *manifest_paths])}
    outcomes.sort(key=lambda o: (order.get(o.path, -1), o.path))
    return Report(outcomes, mode, seed if sample is not None else None, sorted(deployments or {}), coverage)


def auto_workers(num_receipts: int, facts: Iterable[Any], threads: int | None = None, *,
                 cores: int | None = None, available_memory: int | None = None) -> int:
    """Worker processes for `workers="auto"`: the cores over the receipts' thread count (`threads` where the
    verifier states its own), at most one per full batch of receipts, at most the engines that the available
    memory holds (when it is known); at least 1, and 1 for GPU receipts (their engines would share one
    device). `cores`/`available_memory` default to this machine's."""
    facts = list(facts)
    if any(_device(f) != "cpu" for f in facts):
        return 1
    per_engine = max([threads or _num_threads(f) for f in facts] or [1])
    if cores is None:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    limits = [cores // per_engine, num_receipts // BATCH]
    if available_memory is None:
        available_memory = _available_memory()
    if available_memory is not None and facts:
        limits.append(available_memory // max(_engine_bytes(f) for f in facts))
    return max(1, min(limits))


def _device(facts: Any) -> Any:
    try:
        return facts["runtime"]["device"]
    except (KeyError, TypeError):
        return None


def _num_threads(facts: Any) -> int:
    try:
        return max(1, int(facts["runtime"]["num_threads"]))
    except (KeyError, TypeError, ValueError):
        return 1


def _engine_bytes(facts: Any) -> int:
    """An engine's memory for these facts: its weights and its default KV pool (from the model's shape, the
    page size and the dtype) and the overhead."""
    try:
        m = facts["deployment"]["model"]
        h, layers, hd = m["hidden_size"], m["num_layers"], m["head_dim"]
        attention = h * hd * (2 * m["num_heads"] + 2 * m["num_kv_heads"])
        mlp = (3 * h * m["moe_intermediate_size"] * m["num_experts"] + h * m["num_experts"] if m["num_experts"]
               else 3 * h * m["intermediate_size"])
        params = layers * (attention + mlp) + 2 * m["vocab_size"] * h
        width = 2 if facts["runtime"]["dtype"] in ("bfloat16", "float16") else 4
        kv_pool = EngineConfig.num_kv_blocks * facts["scheduler"]["block_size"] * layers * 2 * m["num_kv_heads"] * hd
    except (KeyError, TypeError):
        return _ENGINE_OVERHEAD
    return (params + kv_pool) * width + _ENGINE_OVERHEAD


def _available_memory() -> int | None:
    """MemAvailable from /proc/meminfo (Linux), in bytes; None elsewhere."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


@dataclass(frozen=True)
class _Options:
    """What rebuilds and runs a group's engine, besides its receipts (picklable, for the workers)."""

    model: str | None
    mode: str
    cache_dir: str | None
    threads: int | None
    tuple_override: dict | None
    # per (deployment, tuple) group, its longest receipt's tokens: the group's engine holds one of them (the
    # engine caps it at its own model's context, so a receipt's claims cannot size another group's memory)
    kv_tokens: dict = field(default_factory=dict)


def _run_batch(batch: list[tuple[Path, Receipt]], options: _Options, engines: dict) -> list[Outcome]:
    """Re-execute and compare one batch of receipts of one deployment and tuple, on the engine `engines` keeps
    for it (built on first use: (3) deployment, (4) tuple; batches come in group order, so one engine at a
    time is kept)."""
    first = batch[0][1]
    key = (first.deployment_hash, first.tuple_hash)
    if key not in engines:
        engines.clear()
        try:
            engines[key] = reconstruct(first.deployment_facts, first.tuple_values, options.model,
                                       options.cache_dir, options.threads, options.tuple_override,
                                       kv_tokens=options.kv_tokens.get(key, 0))
        except NotComparable as exc:
            engines[key] = exc
        except DetentError as exc:  # facts that cannot be rebuilt: the group's receipts are bad input
            engines[key] = exc
        except Exception as exc:  # noqa: BLE001 (signed facts the engine chokes on must not end the run)
            engines[key] = BadInput(f"the receipt's deployment could not be rebuilt here: "
                                    f"{type(exc).__name__}: {exc}")
    llm = engines[key]
    if isinstance(llm, NotComparable):
        return [Outcome(str(p), "receipt", "NOT_COMPARABLE", llm.message, r.request.request_id, fields=llm.fields)
                for p, r in batch]
    if isinstance(llm, DetentError):
        return [Outcome(str(p), "receipt", "BAD", llm.message, r.request.request_id) for p, r in batch]
    return _reexecute_isolating(llm, batch, options.mode, set(llm.tokenizer.eos_token_ids))


def _reexecute_isolating(llm: Any, batch: list[tuple[Path, Receipt]], mode: str, eos: set[int]) -> list[Outcome]:
    """`_reexecute`, and where the engine refuses the batch (a receipt it cannot run: a request longer than
    the deployment's context, say), each receipt alone, so that the refusal lands on the receipts it concerns
    (a FAIL: the deployment could not have served them) and the others are still checked."""
    try:
        return _reexecute(llm, batch, mode, eos)
    except DetentError as exc:
        llm.reset(drop_unfinished=True)
        if len(batch) == 1:
            p, r = batch[0]
            return [Outcome(str(p), "receipt", "FAIL", f"the deployment cannot re-execute it: {exc.message}",
                            r.request.request_id)]
    except Exception as exc:  # noqa: BLE001 (one receipt's crash must not take the others' verdicts with it)
        llm.reset(drop_unfinished=True)
        if len(batch) == 1:
            p, r = batch[0]
            return [Outcome(str(p), "receipt", "BAD", f"re-execution raised {type(exc).__name__}: {exc}",
                            r.request.request_id)]
    return [o for item in batch for o in _reexecute_isolating(llm, [item], mode, eos)]


_WORKER_ENGINES: dict = {}  # a worker process's engines, kept across its batches


def _worker_batch(batch: list[tuple[str, bytes]], options: _Options) -> list[Outcome]:
    """A worker's batch: receipts as their payload bytes (already signature-checked by the parent)."""
    return _run_batch([(Path(p), Receipt.from_bytes(b)) for p, b in batch], options, _WORKER_ENGINES)


def _f32_bits(values: Iterable[float]) -> bytes:
    values = list(values)
    return struct.pack(f"<{len(values)}f", *values)


def _binding_problem(r: Receipt, llm: Any, max_prompt_chars: int) -> str | None:
    """The request the engine ran must be the client's: its bound body, parsed by the node's own parser for
    its api on this deployment (whose context and vocabulary the verifier's engine has), gives exactly the
    receipt's prompt ids, sampling and seed, and would have been admitted. The returned text must be the
    output tokens' text."""
    from detent_audit.server.offline import API as OFFLINE_API
    from detent_audit.server.offline import parse_line
    from detent_audit.server.protocol import Limits, parse_request

    client, rid = r.request.client, r.request.request_id
    max_len, vocab = llm.max_model_len, llm.vocab_size
    try:
        body = client.body()
        if client.api == OFFLINE_API:
            if "id" in body and str(body["id"]) != rid:
                return f"the client's request has id {body['id']!r}, the receipt answers {rid!r}"
            _, ids, params = parse_line(body, rid, llm.tokenizer, max_len, vocab, "the client's request")
            asked_max, echo = params.max_tokens, False
        else:
            chat = client.api.endswith("/chat/completions")
            if not rid.startswith("chatcmpl-" if chat else "cmpl-"):
                return f"request id {rid!r} is not one the server gives a {client.api} response"
            name = body.get("model") if isinstance(body.get("model"), str) else ""
            parsed = parse_request(body, chat, Limits(name, max_len, vocab, max_prompt_chars), llm.tokenizer)
            ids, params, asked_max, echo = parsed.prompt_ids, parsed.params, parsed.max_tokens, parsed.echo
            if parsed.batched:  # a batch: the receipt of prompt i is named <response id>-<i>
                index = rid.rsplit("-", 1)[-1]
                if not (index.isdigit() and str(int(index)) == index and int(index) < len(parsed.prompts)):
                    return f"request id {rid!r} names no prompt of the client's batch of {len(parsed.prompts)}"
                ids = parsed.prompts[int(index)]
    except DetentError as exc:
        return (f"no front end of this deployment (context {max_len}) admits the client's request as bound: "
                f"{exc.message}")
    if tuple(ids) != tuple(r.request.prompt_token_ids):
        return (f"the prompt run ({len(r.request.prompt_token_ids)} tokens) is not the client's request "
                f"({len(ids)} tokens)")
    s = r.request.sampling
    ran = {"temperature": enc.f64_to_bits(s.temperature), "top_p": enc.f64_to_bits(s.top_p), "top_k": s.top_k,
           "max_tokens": s.max_tokens, "stop_token_ids": tuple(s.stop_token_ids), "ignore_eos": s.ignore_eos,
           "logprobs": s.logprobs, "seed": r.request.seed, "stop": tuple(s.stop), "echo": r.scoring is not None}
    asked = {"temperature": enc.f64_to_bits(params.temperature), "top_p": enc.f64_to_bits(params.top_p),
             "top_k": params.top_k, "max_tokens": asked_max, "stop_token_ids": tuple(params.stop_token_ids),
             "ignore_eos": params.ignore_eos, "logprobs": params.logprobs, "seed": params.seed,
             "stop": tuple(params.stop), "echo": echo}
    if body.get("seed") is None:  # a seed the client left to the node is the node's draw (returned as `seed`)
        del ran["seed"], asked["seed"]
    differ = [k for k in ran if ran[k] != asked[k]]
    if differ:
        return "the sampling run is not the client's request: " + ", ".join(
            f"{k} {ran[k]!r} where the client asked {asked[k]!r}" for k in differ)
    k = r.output.top_k
    if r.output.token_ids and k != (s.logprobs or 0):
        return f"the response returned {k} alternatives per token, the request asked for {s.logprobs or 0}"
    text, _ = output_text(llm.tokenizer.decode, list(r.output.token_ids), s.stop)  # cut at a stop string
    if text != r.output.text:
        return "the text returned is not the text of the output tokens"
    return None


def _tops_problem(r: Receipt, tops: list[list[tuple[int, float]]]) -> str | None:
    """The alternatives a response returned, against those recomputed (ids equal, fp32 bits equal)."""
    k = r.output.top_k
    if not k:
        return None
    got_ids = tuple(i for t in tops for i, _ in t)
    got_bits = _f32_bits(v for t in tops for _, v in t)
    if got_ids != r.output.top_token_ids or got_bits != r.output.top_logprobs_f32le:
        first = next((i for i, t in enumerate(tops) if [a for a, _ in t] != [a for a, _ in r.output.top_logprobs[i]]
                      or _f32_bits(v for _, v in t) != _f32_bits(v for _, v in r.output.top_logprobs[i])), len(tops))
        return f"the top-{k} alternatives returned differ from the recomputed ones at output position {first}"
    return None


def _reexecute(llm: Any, batch: list[tuple[Path, Receipt]], mode: str, eos: set[int]) -> list[Outcome]:
    # what the output's own shape already refutes is not re-executed: out-of-vocabulary ids, a wrong finish,
    # a request that is not the client's
    max_len, vocab = llm.max_model_len, llm.vocab_size
    max_chars = getattr(llm, "_verify_max_prompt_chars", None)
    if max_chars is None:
        words = llm.tokenizer.tokenizer.get_vocab(with_added_tokens=True)
        max_chars = llm._verify_max_prompt_chars = max_len * max(map(len, words), default=1)
    decode = llm.tokenizer.decode
    problems = {p: _tuple_problem(r) or _vocabulary_problem(r, vocab) or _finish_problem(r, eos, max_len, decode)
                or _binding_problem(r, llm, max_chars)
                for p, r in batch}
    usable = [(p, r) for p, r in batch if problems[p] is None]
    # (5): re-execute, all of the batch together. An echo receipt's prompt is scored by the same teacher-forced
    # prefill (from its second token on, with its top-n), its output with it (rescore) or after it (replay)
    scored = {p: _score_prompt(r, mode) for p, r in usable}
    prompt_scores: dict[Path, Any] = {}
    if mode == "rescore":
        jobs = [(p, r) for p, r in usable if scored[p] or r.output.token_ids]
        got = llm.rescore_batch([_rescore_pair(r, scored[p]) for p, r in jobs], [_params(r) for _, r in jobs])
        results = {p: (list(r.output.token_ids), [], None, []) for p, r in usable}
        for (p, r), res in zip(jobs, got):
            skip = len(r.request.prompt_token_ids) - 1 if scored[p] else 0  # the prompt's scores come first
            results[p] = (res.tokens[skip:], res.logprobs[skip:], None, res.tops[skip:])
            if scored[p]:
                prompt_scores[p] = (res.logprobs[:skip], res.tops[:skip])
    else:
        drawn = [(p, r) for p, r in usable if r.output.token_ids]
        outs = llm.generate([list(r.request.prompt_token_ids) for _, r in drawn], [_params(r) for _, r in drawn])
        results = {p: ([], [], None, []) for p, _ in usable}
        results.update({p: (o.token_ids, o.logprobs, o.finish_reason, o.top_logprobs)
                        for (p, _), o in zip(drawn, outs)})
        jobs = [(p, r) for p, r in usable if scored[p]]
        got = llm.rescore_batch([_rescore_pair(r, True, with_output=False) for _, r in jobs],
                                [_params(r) for _, r in jobs])
        prompt_scores = {p: (res.logprobs, res.tops) for (p, _), res in zip(jobs, got)}
    out = []
    for p, r in batch:
        rid = r.request.request_id
        if problems[p] is not None:
            out.append(Outcome(str(p), "receipt", "FAIL", problems[p], rid))
            continue
        if p in prompt_scores:
            lps, tops = prompt_scores[p]
            problem = prompt_divergence(list(r.request.prompt_token_ids), list(r.scoring.logprobs), lps,
                                        r.scoring.tops, tops if r.scoring.top_n else [])
            if problem is not None:
                out.append(Outcome(str(p), "receipt", "FAIL", problem, rid))
                continue
        tokens, lps, finish, tops = results[p]
        # (6): compare token ids and logprob bits, the alternatives returned (and, replayed, the finish reason)
        div = first_divergence(list(r.output.token_ids), list(r.output.logprobs), list(tokens), list(lps))
        tops_problem = None if div is not None else _tops_problem(r, tops)
        if div is not None:
            out.append(Outcome(str(p), "receipt", "FAIL", div.describe(), rid, div))
        elif tops_problem is not None:
            out.append(Outcome(str(p), "receipt", "FAIL", tops_problem, rid))
        elif finish is not None and finish != r.output.finish_reason:
            out.append(Outcome(str(p), "receipt", "FAIL", f"finish reason {r.output.finish_reason!r}, replay "
                                                           f"finished with {finish!r}", rid))
        else:
            scored_note = f", {r.scoring.num_positions} prompt positions" if r.scoring is not None else ""
            out.append(Outcome(str(p), "receipt", "OK", f"request {rid}: the client's request, {len(tokens)} tokens, "
                                                       f"text and bits equal{scored_note} ({mode})", rid))
    return out


def _score_prompt(r: Receipt, mode: str) -> bool:
    """Whether `r`'s prompt scores are re-executed: an echo receipt with at least one scored position."""
    return r.scoring is not None and r.scoring.num_positions > 0


def _rescore_pair(r: Receipt, score_prompt: bool, with_output: bool = True) -> tuple[list[int], list[int]]:
    """The (prefix, targets) of `r`'s teacher-forced prefill: after the first prompt token, the rest of the
    prompt and the output (echo), or after the prompt, the output."""
    prompt, output = list(r.request.prompt_token_ids), list(r.output.token_ids) if with_output else []
    return (prompt[:1], prompt[1:] + output) if score_prompt else (prompt, output)


def _check_manifest(path: Path, trusted: dict, opened: dict[Path, Receipt]
                    ) -> tuple[Outcome, RunManifest | None]:
    """A manifest's verdict, and the manifest itself when its signature verified (it then covers its digests):
    its receipts present reproduce its root; none of its run's receipts present in its range is left out;
    after a final manifest, its run has no receipt; each request is answered once in it."""
    manifest: RunManifest | None = None
    try:
        manifest = verify_run_manifest(read_envelope_bytes(path, error=InvalidReceipt), trusted).manifest
        wanted = set(manifest.receipt_digests)
        present = [r for r in opened.values() if r.digest in wanted]
        check_run(manifest, present)
        of_run = [r for r in opened.values() if r.run.run_id == manifest.run_id and r.node_keyid == manifest.node_keyid]
        omitted = sorted(r.request.request_id for r in of_run
                         if manifest.seq_first <= r.run.seq <= manifest.seq_last and r.digest not in wanted)
        if omitted:  # a receipt of its range it does not list: the manifest leaves out an answered request
            return Outcome(str(path), "manifest", "FAIL", f"omits {len(omitted)} receipt(s) present in its range "
                           f"{manifest.seq_first}-{manifest.seq_last} of run {manifest.run_id}: "
                           f"{', '.join(map(repr, omitted[:3]))}"), manifest
        later = sorted(r.request.request_id for r in of_run if r.run.seq > manifest.seq_last)
        if manifest.kind == "final" and later:
            return Outcome(str(path), "manifest", "FAIL", f"the run's final manifest ends at receipt "
                           f"{manifest.seq_last}, yet {len(later)} receipt(s) of the run come after it: "
                           f"{', '.join(map(repr, later[:3]))}"), manifest
        repeated = sorted(i for i, n in Counter(r.request.request_id for r in present).items() if n > 1)
        if repeated:  # one request answered twice in a run: a node could keep the draw it liked
            return Outcome(str(path), "manifest", "FAIL", f"request id(s) answered more than once in this run: "
                                                           f"{', '.join(map(repr, repeated[:3]))}"), manifest
    except ManifestMismatch as exc:
        shown = ", ".join(exc.missing[:3]) + (", ..." if len(exc.missing) > 3 else "")
        return Outcome(str(path), "manifest", "FAIL",
                       exc.message + (f" (receipt digests missing: {shown})" if exc.missing else ""),
                       missing=list(exc.missing)), manifest
    except DetentError as exc:
        return Outcome(str(path), "manifest", "FAIL" if exc.exit_code == 1 else "BAD", exc.message), manifest
    return Outcome(str(path), "manifest", "OK", f"{manifest.kind} manifest of run {manifest.run_id[:12]}, receipts "
                   f"{manifest.seq_first}-{manifest.seq_last}: {manifest.receipt_count} receipts, Merkle root "
                   f"{manifest.merkle_root[:16]}..."), manifest


def _check_coverage(opened: dict[Path, Receipt], manifests: list[RunManifest], in_folders: set[Path],
                    coverage: Coverage) -> list[Outcome]:
    """Across all manifests: where manifests were given, a receipt found in a folder that no manifest covers
    FAILs (a node's folder accounts for every answer; receipts alone, with no manifest at all, are counted as
    uncovered and shown, not failed); one (run, sequence number) or one request id twice in a run FAILs."""
    covered = {d for m in manifests for d in m.receipt_digests}
    out = []
    coverage.covered = sum(r.digest in covered for r in opened.values())
    for p, r in sorted(opened.items()):
        if r.digest not in covered:
            coverage.uncovered.append(str(p))
            if p in in_folders and manifests:
                out.append(Outcome(str(p), "coverage", "FAIL", f"receipt {r.run.seq} of run {r.run.run_id} is in "
                                   "no run manifest (a manifest was lost, or the node was killed and not "
                                   "restarted on its folder, which seals such receipts)", r.request.request_id))
    runs: dict[str, list[tuple[Path, Receipt]]] = {}
    for p, r in opened.items():
        runs.setdefault(r.run.run_id, []).append((p, r))
    for run_id, items in sorted(runs.items()):
        for what, key in (("sequence number", lambda r: r.run.seq), ("request id", lambda r: r.request.request_id)):
            counts = Counter(key(r) for _, r in items)
            twice = sorted(k for k, n in counts.items() if n > 1)
            if twice:
                out.append(Outcome(f"run {run_id}", "coverage", "FAIL", f"{len(twice)} {what}(s) appear in more "
                                   f"than one receipt of this run: {', '.join(map(repr, twice[:3]))}"))
    return out
