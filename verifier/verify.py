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

import math
import multiprocessing
import os
import random
from collections import Counter
from collections.abc import Callable, Iterable
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from detent_audit.engine.facts import facts_hash
from detent_audit.engine.llm import EngineConfig
from detent_audit.engine.sampling_params import SamplingParams
from detent_audit.engine.tuples import tuple_hash
from detent_audit.errors import BadInput, DetentError
from detent_audit.manifests.dsse import read_envelope_bytes
from detent_audit.manifests.errors import InvalidReceipt, ManifestMismatch
from detent_audit.manifests.receipt import Receipt, verify_envelope
from detent_audit.manifests.run_manifest import RunManifest, check_run, verify_run_manifest
from detent_audit.verifier.compare import Divergence, first_divergence
from detent_audit.verifier.reconstruct import NotComparable, reconstruct

RECEIPT_SUFFIX, MANIFEST_SUFFIX = ".receipt", ".manifest"
BATCH = 64  # requests re-executed together
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
class Report:
    outcomes: list[Outcome]
    mode: str
    sample_seed: int | None = None  # the seed the sample was drawn with (to repeat it), when sampling

    @property
    def exit_code(self) -> int:
        statuses = {o.status for o in self.outcomes}
        return 1 if "FAIL" in statuses else 2 if "BAD" in statuses else 3 if "NOT_COMPARABLE" in statuses else 0

    def counts(self) -> dict[str, int]:
        return {s: sum(o.status == s for o in self.outcomes) for s in ("OK", "FAIL", "BAD", "NOT_COMPARABLE")}


def collect(paths: Iterable[str | Path]) -> tuple[list[Path], list[Path], list[Outcome]]:
    """Receipt and manifest files named or found under folders (sorted); unreadable paths, and folders with
    neither, as BAD (nothing verified is not a pass)."""
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


def _params(r: Receipt) -> SamplingParams:
    s = r.request.sampling
    return SamplingParams(temperature=s.temperature, top_k=s.top_k, top_p=s.top_p, max_tokens=s.max_tokens,
                          seed=r.request.seed, stop_token_ids=tuple(s.stop_token_ids), ignore_eos=s.ignore_eos,
                          logprobs=s.logprobs)


def _finish_problem(r: Receipt, eos: set[int], max_model_len: int) -> str | None:
    """The stated finish must be the one generation reaches (the scheduler's rule): no stop token before the
    end; 'stop' exactly when the last token is a stop token (a stop wins over a length limit); else 'length',
    at max_tokens or where prompt and output fill the context."""
    s, tokens, reason = r.request.sampling, list(r.output.token_ids), r.output.finish_reason
    stops = set(s.stop_token_ids) | (set() if s.ignore_eos else eos)
    for i, t in enumerate(tokens[:-1]):
        if t in stops:
            return f"output token {i} ({t}) is a stop token, yet generation went on"
    if not tokens:
        return "an empty output: the engine draws at least one token for every request it admits"
    ends_on_stop = tokens[-1] in stops
    if ends_on_stop and reason != "stop":
        return f"the output ends on stop token {tokens[-1]}, so it finished with 'stop', not {reason!r}"
    if reason == "stop" and not ends_on_stop:
        return "finish 'stop' without a stop token at the end"
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
           progress: Callable[[int, int], None] | None = None) -> Report:
    """Verify every receipt and run manifest under `paths`; never raises for a bad receipt: reports it.
    `workers`: processes that re-execute (see the module docstring)."""
    if mode not in ("rescore", "replay"):
        raise DetentError(f"unknown mode {mode!r}", remedy="use --mode rescore or --mode replay")
    if workers != "auto" and (isinstance(workers, bool) or not isinstance(workers, int) or workers < 1):
        raise BadInput(f"workers must be a whole number >= 1 or 'auto', got {workers!r}")
    receipt_paths, manifest_paths, outcomes = collect(paths)
    opened: dict[Path, Receipt] = {}
    for p in receipt_paths:
        try:
            opened[p] = _open_receipt(p, trusted)
        except DetentError as exc:
            outcomes.append(Outcome(str(p), "receipt", "FAIL" if exc.exit_code == 1 else "BAD", exc.message))
        except Exception as exc:  # noqa: BLE001 (a signed payload that breaks a check is a bad receipt, not a crash)
            outcomes.append(Outcome(str(p), "receipt", "BAD", f"{p.name}: {type(exc).__name__}: {exc}"))
    outcomes += [_check_manifest(m, trusted, opened) for m in manifest_paths]

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
    return Report(outcomes, mode, seed if sample is not None else None)


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


def _reexecute(llm: Any, batch: list[tuple[Path, Receipt]], mode: str, eos: set[int]) -> list[Outcome]:
    # what the output's own shape already refutes is not re-executed: out-of-vocabulary ids, a wrong finish
    max_len, vocab = llm.max_model_len, llm.vocab_size
    problems = {p: _tuple_problem(r) or _vocabulary_problem(r, vocab) or _finish_problem(r, eos, max_len)
                for p, r in batch}
    usable = [(p, r) for p, r in batch if problems[p] is None]
    # (5): re-execute, all of the batch together
    if mode == "rescore":
        got = llm.rescore_batch([(r.request.prompt_token_ids, r.output.token_ids) for _, r in usable],
                                [_params(r) for _, r in usable])
        results = {p: (res.tokens, res.logprobs, None) for (p, _), res in zip(usable, got)}
    else:
        outs = llm.generate([list(r.request.prompt_token_ids) for _, r in usable], [_params(r) for _, r in usable])
        results = {p: (o.token_ids, o.logprobs, o.finish_reason) for (p, _), o in zip(usable, outs)}
    out = []
    for p, r in batch:
        rid = r.request.request_id
        if problems[p] is not None:
            out.append(Outcome(str(p), "receipt", "FAIL", problems[p], rid))
            continue
        tokens, lps, finish = results[p]
        # (6): compare token ids and logprob bits (and, replayed, the finish reason)
        div = first_divergence(list(r.output.token_ids), list(r.output.logprobs), list(tokens), list(lps))
        if div is not None:
            out.append(Outcome(str(p), "receipt", "FAIL", div.describe(), rid, div))
        elif finish is not None and finish != r.output.finish_reason:
            out.append(Outcome(str(p), "receipt", "FAIL", f"finish reason {r.output.finish_reason!r}, replay "
                                                           f"finished with {finish!r}", rid))
        else:
            out.append(Outcome(str(p), "receipt", "OK", f"{len(tokens)} tokens, bits equal ({mode})", rid))
    return out


def _check_manifest(path: Path, trusted: dict, opened: dict[Path, Receipt]) -> Outcome:
    try:
        manifest: RunManifest = verify_run_manifest(read_envelope_bytes(path, error=InvalidReceipt), trusted).manifest
        wanted = set(manifest.receipt_digests)
        present = [r for r in opened.values() if r.digest in wanted]
        check_run(manifest, present)
        repeated = sorted(i for i, n in Counter(r.request.request_id for r in present).items() if n > 1)
        if repeated:  # one request answered twice in a run: a node could keep the draw it liked
            return Outcome(str(path), "manifest", "FAIL", f"request id(s) answered more than once in this run: "
                                                           f"{', '.join(map(repr, repeated[:3]))}")
    except ManifestMismatch as exc:
        shown = ", ".join(exc.missing[:3]) + (", ..." if len(exc.missing) > 3 else "")
        return Outcome(str(path), "manifest", "FAIL",
                       exc.message + (f" (receipt digests missing: {shown})" if exc.missing else ""),
                       missing=list(exc.missing))
    except DetentError as exc:
        return Outcome(str(path), "manifest", "FAIL" if exc.exit_code == 1 else "BAD", exc.message)
    return Outcome(str(path), "manifest", "OK", f"{manifest.receipt_count} receipts, Merkle root "
                   f"{manifest.merkle_root[:16]}...")
