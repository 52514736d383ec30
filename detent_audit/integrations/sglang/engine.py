"""`SglangEngine`: SGLang's own engine (`sglang.Engine`: tokenizer manager here, scheduler in its process)
behind `detent_audit.runtime.contract.Engine`.

SGLang runs its own continuous-batching loop in the scheduler process; this class submits requests to it
(`async_generate`, streamed, on one event loop thread) and `step()` waits a few milliseconds for requests to
finish, so the step-based protocol holds: requests added between steps join a running batch, and each step
publishes the tokens SGLang produced so far (a streamed response gets them as they come). A request SGLang
refuses after admission (its abort: beyond the context the selection was solved for, `guard.py`) fails alone:
`output_of` raises `BadInput` for it. SGLang's scheduler stopping (its SIGQUIT to this process, which SGLang's
own handler answers by killing this process) fails the engine instead: `step()` raises `SglangStopped`. Modes:
`detent` (the plugin's kernels through its entry point, the committed tuple, counter-hash sampling, fp32 raw
logprobs) and `stock` (SGLang as shipped). SGLang's own `--enable-deterministic-inference` refuses the CPU
backends.

Settings that change bits are fixed here and named in `facts()`: SGLang's version, the attention and sampling
backends, dtype, threads, the page size (1), the chunked-prefill size, the radix cache, the input-logprob
path, the FA3 build (none on a CPU: the torch_native backend runs), the plugin's sources and the tuple.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import json
import os
import shutil
import signal
import tempfile
import threading
import time
from collections.abc import Mapping
from collections.abc import Sequence as SequenceOf
from dataclasses import dataclass, replace
from functools import cached_property
from pathlib import Path
from typing import Any, NamedTuple

from detent_audit import __version__
from detent_audit.enums import ExitCode, Mode
from detent_audit.errors import BadInput, DetentError
from detent_audit.integrations.hosted import (  # noqa: F401  (re-exported)
    HostedEngine,
    HostedRequest,
    attention_names,
    attention_of_facts,
    checkpoint_folder,
)
from detent_audit.integrations.hosted import attention_form as _attention_form
from detent_audit.integrations.sglang import INSTALL_REMEDY, sglang_version
from detent_audit.integrations.sglang.config import ATTENTIONS, DETENT_SGLANG_ENV, PluginConfig
from detent_audit.integrations.sglang.launch import MAX_TOTAL_TOKENS, plugin_env, server_args
from detent_audit.integrations.sglang.selection import Limits
from detent_audit.runtime.contract import RequestHandle, RequestOutput, Rescored
from detent_audit.runtime.facts import source_hash
from detent_audit.runtime.named_models import ResolvedModel
from detent_audit.runtime.sampling_params import SamplingParams
from detent_audit.runtime.stop_strings import find_stop, output_text

NAME = "sglang"
SUPPORTED_VERSION = "0.5.21"   # the release whose wheel pins torch 2.13.0
STEP_SLICE_S = 0.05            # how long step() waits for a request to finish before it returns
_SOURCES = {"kernels": "detent_audit.kernels", "plugin": "detent_audit.integrations.sglang",
            "selection_programs": "detent_audit.selection.programs"}


class SglangUnavailable(DetentError):
    """SGLang cannot run here as asked."""

    exit_code = ExitCode.BAD_INPUT


class SglangStopped(RuntimeError):
    """SGLang's scheduler stopped while the engine ran (a failure inside SGLang: its log says which)."""


class Progress(NamedTuple):
    """A request's output so far, as SGLang streamed it (each a new object: the engine thread reads it while
    SGLang's client thread makes the next)."""

    token_ids: list[int]
    logprobs: list[float]
    top: list[list[tuple[int, float]]]
    cached_tokens: int = 0


@dataclass(frozen=True)
class SglangConfig:
    """What shapes an SGLang engine; every bit-relevant part is in the facts."""

    model: str                         # a checkpoint folder or a model name (`runtime/named_models.py`)
    mode: str = Mode.DETENT.value
    num_threads: int = 1
    max_model_len: int | None = None   # None: the model's own within the KV pool (`served_context`)
    max_num_seqs: int = 64
    chunked_prefill_size: int = 8192
    prefix_caching: bool = True
    max_total_tokens: int = MAX_TOTAL_TOKENS  # the KV pool (not a bit-relevant fact)
    tuple: dict | None = None
    cache_dir: str | None = None
    attention: str = "auto"            # detent: c (kernels/attention_c.py) | torch | auto (c where it builds)

    def __post_init__(self) -> None:
        if self.attention not in (*ATTENTIONS, "auto"):
            raise BadInput(f"attention must be one of {', '.join(ATTENTIONS)} or auto, "
                           f"got {self.attention!r}")
        if self.mode not in (Mode.DETENT, Mode.STOCK):
            raise BadInput(f"--engine sglang runs mode detent or stock, got {self.mode!r}",
                           remedy="SGLang's deterministic mode refuses its CPU backends; use detent")
        if self.num_threads < 1 or self.chunked_prefill_size < 1:
            raise BadInput("num_threads and chunked_prefill_size must be >= 1")
        if self.tuple is not None and self.mode != Mode.DETENT:
            raise BadInput("a tuple is committed only in detent mode",
                           remedy="drop --tuple or use --mode detent")

    @cached_property
    def resolved_model(self) -> ResolvedModel:
        return checkpoint_folder(self.model, self.cache_dir, "SGLang")


class SglangRequest(HostedRequest):
    """A request inside the SGLang engine, as `add_request` returns it."""

    def __init__(self, seq_id: int, request_id: str, prompt_ids: list[int], params: SamplingParams) -> None:
        super().__init__(seq_id, request_id, prompt_ids, params)
        self.score_prompt = False
        self.prompt_logprobs: list[float] | None = None
        self.prompt_top: list[list[tuple[int, float]]] | None = None
        self.rid = f"detent-{seq_id}"
        self.future: concurrent.futures.Future | None = None
        self.progress = Progress([], [], [])  # written by SGLang's client thread only
        self.stop_checked = 0  # output tokens whose text holds no stop string
        self.stopped_at: int | None = None  # the output tokens kept: a stop string's token ends the output
        self.error: BadInput | None = None  # SGLang refused the request after admission

    def submitted(self) -> concurrent.futures.Future:
        """SGLang's future of this request (`add_request` sets it)."""
        if self.future is None:
            raise RuntimeError(f"request {self.rid} was never submitted to SGLang")
        return self.future


def sglang_params(params: SamplingParams, max_tokens: int | None = None) -> dict[str, Any]:
    """Our SamplingParams as SGLang's sampling_params dict (greedy: temperature 0)."""
    out: dict[str, Any] = {"max_new_tokens": max_tokens or params.max_tokens,
                           "ignore_eos": params.ignore_eos,
                           "stop_token_ids": list(params.stop_token_ids) or None,
                           "skip_special_tokens": False, "temperature": float(params.temperature)}
    if params.temperature > 0:
        out.update(top_p=float(params.top_p), top_k=int(params.top_k) if params.top_k else -1,
                   sampling_seed=_signed64(params.seed))
    return out


def _advanced(progress: Progress, chunk: Mapping[str, Any], top_n: int) -> Progress:
    """`progress` with the tokens of SGLang's `chunk` (the whole output so far) it does not hold yet: each
    token with its logprob (and its top-`top_n`), as far as both have come."""
    meta = chunk["meta_info"]
    ids, entries = chunk["output_ids"], meta.get("output_token_logprobs") or []
    have, end = len(progress.token_ids), min(len(chunk["output_ids"]), len(entries))
    cached = int(meta.get("cached_tokens") or 0)
    if end <= have:
        return progress._replace(cached_tokens=cached)
    top = progress.top
    if top_n:
        rows = (meta.get("output_top_logprobs") or [])[have:end]
        top = top + [[(int(t), float(lp)) for lp, t, *_ in row or []] for row in rows]
    return Progress(progress.token_ids + [int(t) for t in ids[have:end]],
                    progress.logprobs + [float(e[0]) for e in entries[have:end]], top, cached)


def _signed64(seed: int | None) -> int:
    seed = int(seed or 0) % (1 << 64)
    return seed - (1 << 64) if seed >= 1 << 63 else seed


def _scored_positions(meta: Mapping[str, Any], top_n: int
                      ) -> tuple[list[float], list[list[tuple[int, float]]]]:
    """The input positions SGLang scored (the first token of a sequence has no logprob and is left out): each
    position's logprob and its top-`top_n` (token, logprob), best first."""
    entries = meta.get("input_token_logprobs") or []
    rows = meta.get("input_top_logprobs") or [None] * len(entries)
    logprobs, tops = [], []
    for entry, row in zip(entries, rows, strict=True):
        if entry is None or entry[0] is None:
            continue
        logprobs.append(float(entry[0]))
        tops.append([(int(t), float(lp)) for lp, t, *_ in (row or [])[:top_n]] if top_n else [])
    return logprobs, tops


class SglangEngine(HostedEngine[SglangRequest]):
    """SGLang behind the engine contract (see `detent_audit.runtime.contract` for the contract)."""

    name = NAME
    handle_type = SglangRequest
    config: SglangConfig

    def __init__(self, config: SglangConfig) -> None:
        version = sglang_version()
        if version is None:
            raise SglangUnavailable("SGLang is not installed", remedy=INSTALL_REMEDY)
        self.config = config
        self.version = version
        began = time.perf_counter()
        self._load_model()
        self.selection = None
        self.attention = _attention_form(config.attention) if config.mode == Mode.DETENT else None
        # what SGLang serves with, and so what the selection is solved for
        self.limits = Limits.served(self._max_len, config.max_num_seqs, config.chunked_prefill_size)
        if config.mode == Mode.DETENT:
            from detent_audit.integrations.sglang.selection import cpu_selection

            self.selection = cpu_selection(self.model_path, config.num_threads, config.tuple, self.limits)
        self.start_profile: dict[str, float] = {}  # seconds per phase of the start (benchmarks/sglang_cpu.py)
        self.start_profile["model_and_selection_s"] = round(time.perf_counter() - began, 2)
        self._ids = itertools.count()
        self._live: dict[str, SglangRequest] = {}
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="sglang-client", daemon=True)
        self._thread.start()
        self._report_dir = Path(tempfile.mkdtemp(prefix="detent-sglang-"))
        self._chunk = config.chunked_prefill_size
        self._stopped: str | None = None  # why SGLang's scheduler stopped (its SIGQUIT)
        self._previous_sigquit: Any = None
        self.engine = self._build()

    # ---- construction
    def _plugin_config(self) -> PluginConfig:
        cfg = self.config
        limits = self.limits
        return PluginConfig(mode=cfg.mode, model_path=self.model_path, num_threads=cfg.num_threads,
                            tuple=self.selection.tuple if self.selection else {},
                            report_dir=str(self._report_dir), launcher_pid=os.getpid(),
                            attention=self.attention or "c", max_model_len=limits.max_model_len,
                            max_num_seqs=limits.max_num_seqs,
                            max_num_batched_tokens=limits.max_num_batched_tokens)

    def _build(self) -> Any:
        cfg = self.config
        plugin = self._plugin_config()
        for key in DETENT_SGLANG_ENV:  # stock mode: SGLang's settings as it ships them
            os.environ.pop(key, None)
        os.environ.update(plugin_env(plugin))
        for old in self._report_dir.glob("*.json"):
            old.unlink()
        began = time.perf_counter()
        import sglang

        self.start_profile["import_sglang_s"] = round(time.perf_counter() - began, 2)
        began = time.perf_counter()
        args = server_args(self.model_path, plugin, chunked_prefill_size=cfg.chunked_prefill_size,
                           prefix_caching=cfg.prefix_caching, max_total_tokens=cfg.max_total_tokens)
        engine = sglang.Engine(**args, skip_tokenizer_init=True, log_level="error")
        self.start_profile["sglang_engine_s"] = round(time.perf_counter() - began, 2)
        self._check_plugin(engine)
        if threading.current_thread() is threading.main_thread():  # where Python runs signal handlers
            self._previous_sigquit = signal.signal(signal.SIGQUIT, self._scheduler_stopped)
        self.start_profile.update({f"scheduler_{k}": r[k] for r in self.plugin_report[:1]
                                   for k in ("before_plugin_s", "plugin_s")})
        return engine

    def _scheduler_stopped(self, signum: int, frame: Any) -> None:
        """SIGQUIT from SGLang's processes (a child failed), in place of SGLang's handler, which kills this
        process: the engine fails (`step()` raises) and the process that hosts it carries on."""
        self._stopped = ("SGLang's scheduler stopped (a child process of SGLang failed and sent SIGQUIT; "
                         "SGLang's log says why)")

    def _check_plugin(self, engine: Any) -> None:
        """Refuse to run unless the plugin loaded in the scheduler and applied every hook (detent mode)."""
        from detent_audit.integrations.sglang import control, guard, rescore
        from detent_audit.integrations.sglang.cpu_kernels import TARGETS

        reports = [json.loads(p.read_text()) for p in sorted(self._report_dir.glob("*.json"))]
        children = set(engine.get_all_child_pids())
        # the launcher's own report does not count
        scheduler = [r for r in reports if r.get("pid") in children]
        detent_hooks = (*TARGETS, guard.TARGET, rescore.TARGET) if self.config.mode == Mode.DETENT else ()
        wanted = {control.TARGET, *detent_hooks}
        problem = None
        if not scheduler:
            problem = "the plugin did not report from SGLang's scheduler (is the entry point installed?)"
        for r in scheduler:
            missing = sorted(wanted - set(r.get("hooks", [])))
            if r.get("error") or missing or r.get("mode") != self.config.mode:
                problem = (f"process {r.get('pid')}: mode {r.get('mode')}, error {r.get('error')}, "
                           f"hooks missing {missing}")
        if problem:
            engine.shutdown()
            raise SglangUnavailable(f"detent's SGLang plugin is not active: {problem}",
                                    remedy="reinstall detent-audit (pip install -e .) so SGLang finds "
                                           "its sglang.srt.plugins entry point")
        self.plugin_report = scheduler

    # ---- the engine boundary (its read-only properties: HostedEngine's)
    def facts(self) -> dict[str, Any]:
        cfg = self.config
        plugin_facts = ({"name": "detent-audit", "version": __version__,
                         "hooks": sorted(self.plugin_report[0]["hooks"]),
                         "attention": attention_names()[self.attention or "c"],
                         "sources": {k: source_hash(v) for k, v in sorted(_SOURCES.items())}}
                        if cfg.mode == Mode.DETENT else {})
        settings = {"attention_backend": "torch_native", "sampling_backend": "pytorch", "device": "cpu",
                    "fa3_build": "none", "cuda_graph": False,
                    "enable_fast_input_logprobs": cfg.mode != Mode.DETENT,
                    "enable_deterministic_inference": False}
        return {
            "engine": {"name": NAME, "version": self.version, "mode": cfg.mode, "plugin": plugin_facts,
                       "settings": settings},
            "deployment": (self.selection_deployment() if self.selection else {}),
            "scheduler": {"block_size": 1, "chunked_prefill_size": self._chunk,
                          "max_num_seqs": cfg.max_num_seqs, "max_model_len": self._max_len,
                          "prefix_caching": cfg.prefix_caching},
            **self.hosted_facts("float32"),
        }

    def selection_deployment(self) -> dict:
        """The deployment the CPU selection was solved for, with what the GEMM probe proved here."""
        if self.selection is None or self.selection.deployment is None:
            raise RuntimeError("this SGLang engine solved no CPU selection (stock mode)")
        return self.selection.deployment.to_canonical()

    def _submit(self, coro: Any) -> concurrent.futures.Future:
        return asyncio.run_coroutine_threadsafe(coro, self._loop)

    def add_request(self, prompt: str | SequenceOf[int], params: SamplingParams,
                    request_id: str | None = None, *, score_prompt: bool = False) -> SglangRequest:
        """Queue one request in SGLang's scheduler. `score_prompt` (echo): also the logprob of every prompt
        token after the first (and `params.logprobs` alternatives), from the prefill that samples the output
        (SGLang then matches no cached prefix)."""
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else [int(t) for t in prompt]
        if not ids:
            raise BadInput("the prompt is empty", remedy="pass at least one prompt token")
        if len(ids) + 1 > self._max_len:
            raise BadInput(f"the prompt has {len(ids)} tokens, beyond the context of {self._max_len}")
        if params.temperature > 0 and params.seed is None:
            raise BadInput("a sampled request needs a seed", remedy="pass seed")
        seq = SglangRequest(next(self._ids), request_id or "", ids, params)
        seq.request_id = seq.request_id or str(seq.seq_id)
        seq.score_prompt = score_prompt
        scoring = {"logprob_start_len": 0} if score_prompt else {}
        seq.future = self._submit(self._streamed(seq, input_ids=ids, sampling_params=sglang_params(params),
                                                 return_logprob=True, top_logprobs_num=params.logprobs or 0,
                                                 rid=seq.rid, **scoring))
        self._live[seq.rid] = seq
        return seq

    async def _streamed(self, seq: SglangRequest, **request: Any) -> dict[str, Any]:
        """SGLang's chunks of one request as it produces them (on SGLang's client thread): each holds the
        whole output so far (SGLang streams snapshots unless `--incremental-streaming-output`), its new
        tokens published to `seq.progress`; returns the last chunk."""
        last: dict[str, Any] = {}
        async for last in await self.engine.async_generate(stream=True, **request):
            seq.progress = _advanced(seq.progress, last, seq.params.logprobs or 0)
        return last

    def _take(self, seq: SglangRequest) -> bool:
        """The tokens SGLang streamed so far made the request's output, up to the first whose text holds a
        stop string (`_stop_string_cut`); True once a stop string has ended it."""
        progress = seq.progress
        if seq.stopped_at is None and len(progress.token_ids) > len(seq.token_ids):
            seq.stopped_at = self._stop_string_cut(seq, progress.token_ids)
            end = len(progress.token_ids) if seq.stopped_at is None else seq.stopped_at
            seq.token_ids, seq.output_logprobs = progress.token_ids[:end], progress.logprobs[:end]
            seq.top = progress.top[:end] if seq.params.logprobs else []
        seq.num_cached_tokens = progress.cached_tokens
        if seq.stopped_at is not None:
            seq.finish_reason = "stop"
        return seq.stopped_at is not None

    def _finish(self, seq: SglangRequest) -> None:
        """The request's last chunk: its output, or `seq.error` where SGLang refused it."""
        try:
            out = seq.submitted().result()
        except Exception as exc:  # noqa: BLE001 - SGLang refuses with ValueError or fastapi's HTTPException
            seq.error = BadInput(f"SGLang refused request {seq.request_id}: {getattr(exc, 'detail', exc)}")
            return
        meta = out["meta_info"]
        finish = meta.get("finish_reason") or {}
        if finish.get("type") == "abort":
            seq.error = BadInput(f"SGLang refused request {seq.request_id}: {finish.get('message')}")
            return
        seq.progress = _advanced(seq.progress, out, seq.params.logprobs or 0)
        if len(seq.progress.token_ids) != len(out["output_ids"]):
            raise RuntimeError(f"SGLang returned {len(seq.progress.logprobs)} logprobs for "
                               f"{len(out['output_ids'])} tokens")
        if not self._take(seq):
            seq.finish_reason = "stop" if finish.get("type") == "stop" else "length"
        if seq.score_prompt:
            seq.prompt_logprobs, seq.prompt_top = _scored_positions(meta, seq.params.logprobs or 0)
            if len(seq.prompt_logprobs) != len(seq.prompt_token_ids) - 1:
                raise RuntimeError(f"SGLang scored {len(seq.prompt_logprobs)} prompt positions of "
                                   f"{len(seq.prompt_token_ids)} tokens")

    def _stop_string_cut(self, seq: SglangRequest, token_ids: list[int]) -> int | None:
        """How many output tokens a request with stop strings keeps: up to the first whose text contains one
        (the tokens before `seq.stop_checked` hold none). SGLang runs here without its tokenizer, so it cannot
        check stop strings itself: the engine ends the request there (batch invariance makes the kept tokens
        what stopping there would give)."""
        if not seq.params.stop:
            return None
        for n in range(seq.stop_checked + 1, len(token_ids) + 1):
            if find_stop(self.tokenizer.decode(token_ids[:n]), seq.params.stop) is not None:
                return n
        seq.stop_checked = len(token_ids)
        return None

    def step(self) -> list[SglangRequest]:
        """Wait up to `STEP_SLICE_S` for a request to finish; publish every live request's tokens so far.
        Raises `SglangStopped` once SGLang's scheduler has stopped."""
        if self._stopped is not None:
            raise SglangStopped(self._stopped)
        if not self._live:
            return []
        futures = [s.submitted() for s in self._live.values()]
        concurrent.futures.wait(futures, timeout=STEP_SLICE_S, return_when=concurrent.futures.FIRST_COMPLETED)
        finished = []
        for rid, seq in list(self._live.items()):
            if seq.submitted().done():
                self._finish(seq)
            elif self._take(seq) and not seq.score_prompt:  # a stop string ended it (echo: once SGLang
                self._cancel(seq)                              # has sent the prompt's logprobs, at its end)
            else:
                continue
            del self._live[rid]
            finished.append(seq)
        return finished

    def has_unfinished(self) -> bool:
        return bool(self._live)

    def output_of(self, seq: RequestHandle) -> RequestOutput:
        """A finished request's output; `BadInput` where SGLang refused it (that request alone)."""
        seq = self.own(seq)
        if seq.error is not None:
            raise seq.error
        text, _ = output_text(self.tokenizer.decode, seq.token_ids, seq.params.stop)
        return RequestOutput(seq.request_id, list(seq.prompt_token_ids), list(seq.token_ids), text,
                             list(seq.output_logprobs), seq.finish_reason, list(seq.top),
                             seq.num_cached_tokens, seq.prompt_logprobs,
                             seq.prompt_top if seq.prompt_logprobs is not None else None)

    def abort(self, seq: RequestHandle) -> None:
        seq = self.own(seq)
        if self._live.pop(seq.rid, None) is not None:
            self._cancel(seq)

    def _cancel(self, seq: SglangRequest) -> None:
        """SGLang stops computing for the request (its output, if any, is what `seq` holds)."""
        self._loop.call_soon_threadsafe(self.engine.tokenizer_manager.abort_request, seq.rid)
        seq.submitted().cancel()

    @property
    def block_size(self) -> int:
        return 1  # SGLang's radix cache shares prefixes by token

    def kv_pool_tokens(self) -> int | None:
        return self.config.max_total_tokens  # SGLang's KV pool

    def reset(self, *, max_prefill_chunk: int | None = None, drop_unfinished: bool = False) -> None:
        """Forget every request and the radix cache. `max_prefill_chunk` sets SGLang's chunked-prefill size in
        its running scheduler (the plugin's `control` hook), for the battery's chunked-prefill cell."""
        if self._live and not drop_unfinished:
            raise RuntimeError("reset() with requests still running")
        for seq in list(self._live.values()):
            self.abort(seq)
        if not self._flush():
            raise RuntimeError("SGLang did not flush its radix cache")
        chunk = self.config.chunked_prefill_size if max_prefill_chunk is None else max_prefill_chunk
        if chunk != self._chunk:
            from sglang.srt.managers.io_struct import SetInternalStateReq

            from detent_audit.integrations.sglang.control import CHUNK_KEY

            req = SetInternalStateReq(server_args={CHUNK_KEY: chunk})
            updated = self._submit(self.engine.tokenizer_manager.set_internal_state(req)).result()
            if not updated or not all(updated):
                raise RuntimeError(f"SGLang's scheduler refused the chunked-prefill size {chunk}")
            self._chunk = chunk

    def _flush(self, attempts: int = 100) -> bool:
        """Flush the radix cache; SGLang refuses while its scheduler still holds a finished request, so retry
        briefly."""
        for _ in range(attempts):
            result = self._submit(self.engine.tokenizer_manager.flush_cache()).result()
            if bool(getattr(result, "success", True)):
                return True
            time.sleep(0.1)
        return False

    def rescore_batch(self, pairs: SequenceOf[tuple[SequenceOf[int], SequenceOf[int]]],
                      params: SequenceOf[SamplingParams] | None = None) -> list[Rescored]:
        """Teacher-forced logprobs through SGLang's input logprobs: one prefill of prompt + output per pair,
        all submitted at once, so SGLang's scheduler batches them; nothing is generated again. The token drawn
        at each position: the argmax for greedy requests (rank 1 of the input top logprobs); for sampled ones
        the counter-hash draw of the request's own sampling over that position's logits, which the plugin
        computes in the same prefill (`rescore.py`)."""
        from detent_audit.integrations.sglang.rescore import RID_PREFIX, take_draws

        params = list(params) if params is not None else [SamplingParams(temperature=0.0)] * len(pairs)
        if len(params) != len(pairs):
            raise BadInput(f"{len(pairs)} pairs but {len(params)} sampling parameters")
        scored, rids = [], []
        for (prompt, output), p in zip(pairs, params, strict=True):
            if not output:
                raise BadInput("rescore needs at least one output token")
            ids = [int(t) for t in prompt] + [int(t) for t in output]
            if len(ids) > self._max_len:
                raise BadInput(f"prompt and output have {len(ids)} tokens, beyond the context of "
                               f"{self._max_len}")
            greedy = p.temperature == 0
            # a sampled request is scored with its own sampling (one new token, never compared), so the plugin
            # draws at each position what generation drew there
            sampling = ({"max_new_tokens": 1, "temperature": 0.0, "ignore_eos": True} if greedy
                        else {**sglang_params(p, max_tokens=1), "ignore_eos": True})
            rid = None if greedy else f"{RID_PREFIX}{next(self._ids)}"
            rids.append(rid)
            scored.append(self._submit(self.engine.async_generate(
                input_ids=ids, sampling_params=sampling, rid=rid,
                # from the last prompt token: SGLang then matches at most that much cached prefix, so the
                # logits before the first output token are computed, not served from the radix cache
                return_logprob=True, logprob_start_len=len(prompt) - 1,
                top_logprobs_num=max(1, p.logprobs or 0))))
        out = []
        for i, (future, (prompt, output)) in enumerate(zip(scored, pairs, strict=True)):
            n = params[i].logprobs or 0
            logprobs, tops = _scored_positions(future.result()["meta_info"], max(1, n))
            # SGLang leaves the first position of the range unscored (its logprob is None: here the last
            # prompt token's), so the positions scored are the output's
            expected = len(output)
            if len(logprobs) != expected:
                raise RuntimeError(f"SGLang scored {len(logprobs)} positions, expected {expected}")
            tokens = [row[0][0] if row else -1 for row in tops]
            rid = rids[i]
            if rid is not None:  # the token at absolute position q + 1 was drawn at position q
                draws = take_draws(self._report_dir, rid)
                first = len(prompt) - 1
                missing = [q for q in range(first, first + expected) if q not in draws]
                if missing:
                    raise RuntimeError(f"SGLang's scheduler drew no token at position(s) {missing[:8]} "
                                       "of a rescore")
                tokens = [draws[q] for q in range(first, first + expected)]
            out.append(Rescored(logprobs, tokens, [row[:n] for row in tops] if n else []))
        return out

    def shutdown(self) -> None:
        """Stop SGLang's processes (idempotent: a second call does nothing)."""
        engine, self.engine = getattr(self, "engine", None), None
        if engine is None:
            return
        if self._previous_sigquit is not None and threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGQUIT, self._previous_sigquit)
        try:
            engine.shutdown()
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            shutil.rmtree(self._report_dir, ignore_errors=True)

    def __del__(self) -> None:  # a crashed caller still stops SGLang's processes
        engine = getattr(self, "engine", None)
        if engine is not None:
            try:
                engine.shutdown()
            except Exception:  # noqa: BLE001
                pass


__all__ = ["SglangConfig", "SglangEngine", "SglangUnavailable", "replace", "sglang_version"]
