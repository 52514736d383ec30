"""The offline engine: `LLM(...).generate(prompts, params)` and `rescore(prompt_ids, output_ids)`.

A step is: the scheduler picks tokens under its budget (continuous batching, chunked prefill, preemption),
the runner computes them through the mode's KernelSet and samples, the scheduler records the results. The
CPU thread count is fixed when the engine starts (it changes BLAS bits) and recorded in the facts.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
from collections import Counter
from collections.abc import Sequence as SequenceOf
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

import torch

from detent_audit.engine.generated import generate_model
from detent_audit.engine.loader import load_model
from detent_audit.engine.model import CausalLM
from detent_audit.engine.registration import DEFAULT_KV_BLOCKS
from detent_audit.engine.runner import ModelRunner, Sampled, SeqResult
from detent_audit.engine.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from detent_audit.engine.sequence import ScoreSpec, Sequence
from detent_audit.engine.tensor_parallel import (
    BACKEND,
    ORDERED,
    EmulatedRanks,
    TensorParallelLM,
    TPLayout,
    tensor_parallel_model,
)
from detent_audit.engine.tp_ranks import DrivenModel, ProcessRanks, RankProcesses, follow, init_group
from detent_audit.engine.weight_sync import NamedTensors, load_named_weights, weights_digest
from detent_audit.enums import Mode
from detent_audit.errors import BadInput
from detent_audit.runtime.base import EngineBase
from detent_audit.runtime.contract import (
    EMBEDDED,
    Facts,
    RequestHandle,
    RequestOutput,
    Rescored,
    TopLogprobs,
    TupleValues,
)
from detent_audit.runtime.dtypes import DTYPES, RUN_DTYPES
from detent_audit.runtime.kernel_select import Selection, engine_deployment, select_kernels
from detent_audit.runtime.model_config import served_context
from detent_audit.runtime.named_models import ResolvedModel, is_generated, resolve_model
from detent_audit.runtime.sampling_params import SamplingParams
from detent_audit.runtime.stop_strings import output_text
from detent_audit.runtime.threads import set_threads
from detent_audit.runtime.tokenizer import Tokenizer

GPU_MAX_NUM_SEQS = 256  # the default on a GPU, where decode graphs are captured up to it


@dataclass(frozen=True)
class EngineConfig:
    """Everything that shapes the engine; the bit-relevant parts go into the deployment facts."""

    # a name (named_models), a checkpoint folder or "random:<shape>"; None: the default
    model: str | None = None
    device: str = "cpu"                 # cpu | cuda
    cuda_graphs: bool = True            # GPU: replay captured decode steps (False: always eager)
    # GPU: decode batches up to this many rows replay graphs (None: max_num_seqs)
    graph_max_batch: int | None = None
    # GPU: a replayed decode step is followed by the next one, queued before its tokens reach the host
    # (Scheduler.schedule_ahead), so the host's work of one step runs while the device computes the next
    overlap: bool = True
    mode: str = Mode.DETENT.value                # detent | stock | det
    dtype: str = "float32"
    num_threads: int = 1                # CPU threads, fixed at start (a bit-relevant fact)
    block_size: int = 16
    num_kv_blocks: int = DEFAULT_KV_BLOCKS
    # more blocks if needed to hold one request this long (capped at the context)
    kv_pool_tokens: int = 0
    # prompt + output tokens; None: the model's positions, within the KV pool
    max_model_len: int | None = None
    # sequences a step holds; 0: 256 on a GPU (at most max_num_batched_tokens), 32 on a CPU
    max_num_seqs: int = 0
    max_num_batched_tokens: int = 512
    max_prefill_chunk: int | None = None
    prefix_caching: bool = True
    tuple: dict | None = None           # family -> axis -> value (detent mode); None: the preferred legal one
    attention_streaming: bool = False   # GPU det/detent: the Triton attention's streaming fold (a fact)
    cache_dir: str | None = None        # JIT cache directory
    tensor_parallel_size: int = 1       # ranks the model is split over (a fact; tensor_parallel.py)
    # processes: one per rank (rank 0 here); emulated: all here
    tensor_parallel_ranks: str = "processes"
    tensor_parallel_rank: int = 0       # a follower process's rank (set by the engine that starts it)
    # a follower's process-group address (set by the engine that starts it)
    tensor_parallel_init: str = ""

    def __post_init__(self) -> None:
        if self.max_num_seqs == 0:  # the default: a GPU's decode step is memory-bound well past 32 rows
            seats = min(GPU_MAX_NUM_SEQS, self.max_num_batched_tokens) if self.device == "cuda" else 32
            object.__setattr__(self, "max_num_seqs", seats)
        if self.mode not in {m.value for m in Mode}:
            raise BadInput(f"mode must be detent, stock or det, got {self.mode!r}")
        if self.dtype not in RUN_DTYPES:
            raise BadInput(f"dtype must be one of {sorted(RUN_DTYPES)}, got {self.dtype!r}")
        if self.device not in ("cpu", "cuda"):
            raise BadInput(f"device must be cpu or cuda, got {self.device!r}")
        if self.num_threads < 1:
            raise BadInput(f"num_threads must be >= 1, got {self.num_threads}")
        if self.attention_streaming and self.device != "cuda":
            raise BadInput("attention_streaming is a mode of the GPU attention kernel",
                           remedy="use device cuda")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise BadInput("max_model_len must be >= 2 (one prompt and one output token), got "
                           f"{self.max_model_len}")
        if self.tensor_parallel_size < 1:
            raise BadInput(f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")
        if self.tensor_parallel_ranks not in ("processes", "emulated"):
            raise BadInput("tensor_parallel_ranks must be processes or emulated, got "
                           f"{self.tensor_parallel_ranks!r}")
        if self.graph_max_batch is not None and self.graph_max_batch < 1:
            raise BadInput(f"graph_max_batch must be None or >= 1, got {self.graph_max_batch}")
        if self.tensor_parallel_size > 1 and self.device == "cuda" and self.cuda_graphs:
            raise BadInput("CUDA graphs are not captured for tensor-parallel models yet",
                           remedy="pass --eager")
        if self.tuple is not None and self.mode != Mode.DETENT:
            raise BadInput("a tuple is committed only in detent mode",
                           remedy="drop --tuple or use --mode detent")

    @cached_property
    def resolved_model(self) -> ResolvedModel:
        """The checkpoint `model` names, with the name and source a receipt records."""
        return resolve_model(self.model)

    @property
    def model_path(self) -> Path:
        return self.resolved_model.path


class LLM(EngineBase[Sequence]):
    """Offline engine. `generate` runs prompts to completion; requests are batched as the scheduler sees fit,
    and (batch invariance) every request's bits are what it would get alone. The embedded implementation of
    `detent_audit.runtime.contract.Engine`."""

    name = EMBEDDED
    handle_type = Sequence
    config: EngineConfig

    def __init__(self, config: EngineConfig | None = None, **overrides: Any) -> None:
        config = config or EngineConfig(**overrides)
        self.config = config
        set_threads(config.num_threads)
        self.tokenizer = Tokenizer.from_pretrained(config.model_path)
        if is_generated(config.model):
            full = generate_model(config.model, DTYPES[config.dtype], config.device)
        else:
            full = load_model(config.model_path, DTYPES[config.dtype], device=config.device)
        self.ranks: RankProcesses | None = None
        self.rank_group: ProcessRanks | None = None
        self.model = self._split(full) if config.tensor_parallel_size > 1 else full
        mc = full.config
        max_len = self._max_model_len(config, mc.max_position_embeddings)
        self.deployment = engine_deployment(
            mc, dtype=config.dtype, num_threads=config.num_threads, block_size=config.block_size,
            max_model_len=max_len, max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens, prefix_caching=config.prefix_caching,
            attention_backend="detent-streaming" if config.attention_streaming else "detent",
            batch_invariant=config.mode != Mode.STOCK, tensor_parallel_size=config.tensor_parallel_size)
        self.selection: Selection = select_kernels(
            config.mode, self.deployment, config.tuple, config.cache_dir, device=config.device,
            gemm_shapes=self.model.gemm_shapes() if config.device == "cpu" else None)
        self.deployment = self.selection.deployment or self.deployment  # with the GEMM probe's facts
        reduce = self.selection.tuple.get("embedded.all_reduce", {}).get("embedded.all_reduce.algorithm")
        if reduce is not None and reduce != ORDERED:  # the solver pins it: only the ordered sum is legal
            raise BadInput(f"the tuple's all-reduce {reduce!r} is not batch-invariant",
                           remedy=f"use {ORDERED}")
        # a verifier sizes the pool for its longest receipt: never past what this model's own context holds
        pool_blocks = -(-min(config.kv_pool_tokens, max_len) // config.block_size) + 2
        num_kv_blocks = max(config.num_kv_blocks, pool_blocks)
        usable_blocks = num_kv_blocks - (1 if config.device == "cuda" and config.cuda_graphs else 0)
        self._scheduler_config = SchedulerConfig(
            num_blocks=usable_blocks, block_size=config.block_size, max_model_len=max_len,
            max_num_seqs=config.max_num_seqs, max_num_batched_tokens=config.max_num_batched_tokens,
            max_prefill_chunk=config.max_prefill_chunk, eos_token_ids=tuple(self.tokenizer.eos_token_ids),
            prefix_caching=config.prefix_caching)
        self.scheduler = Scheduler(self._scheduler_config, decode=self.tokenizer.decode)
        self.runner = ModelRunner(self.model, self.selection.kernels, num_kv_blocks, config.block_size,
                                  device=config.device)
        if config.device == "cuda" and config.cuda_graphs:
            from detent_audit.engine.cuda_graphs import DecodeGraphs

            # the last KV block is the padding rows' scratch: never handed to a sequence
            self.runner.graphs = DecodeGraphs(self.model, self.selection.kernels, self.runner.kv_caches,
                                              config.block_size, max_len, num_kv_blocks - 1, config.device,
                                              max_size=config.graph_max_batch or config.max_num_seqs)
        self._ids = itertools.count()
        # a step queued on the device and not recorded yet; the sequences finished when such a step was
        # recorded outside `step` (the next `step` returns them)
        self._ahead: tuple[SchedulerOutput, Sampled] | None = None
        self._finished: list[Sequence] = []
        # steps run, by how many sequences shared them (how much co-batching a workload really got)
        self.step_batch_sizes: Counter[int] = Counter()
        # the in-memory weights' digest once changed after loading (`load_weights`); None: the checkpoint's
        self.weights_digest: str | None = None

    def _split(self, full: CausalLM) -> CausalLM | TensorParallelLM | DrivenModel:
        """The model over `tensor_parallel_size` ranks: all emulated here, or this process's rank of a group
        (rank 0 starts the others and drives them: tp_ranks.py)."""
        config, size = self.config, self.config.tensor_parallel_size
        algorithm = BACKEND if config.mode == Mode.STOCK else ORDERED
        if config.tensor_parallel_ranks == "emulated":
            return tensor_parallel_model(full, size, EmulatedRanks(size, algorithm))
        TPLayout(full.config, size)  # refuse a split that does not divide before any process starts
        backend = "nccl" if config.device == "cuda" else "gloo"
        rank, init_method = config.tensor_parallel_rank, config.tensor_parallel_init
        if not init_method:  # rank 0 starts the others (else a launcher started every rank at this address)
            if rank != 0:
                raise BadInput(
                    f"tensor-parallel rank {rank} needs its group's address (tensor_parallel_init)"
                )
            self.ranks = RankProcesses(size, functools.partial(_follow_as_rank, config))
            init_method = self.ranks.init_method
        if config.device == "cuda":
            torch.cuda.set_device(rank)
        try:
            init_group(backend, init_method, rank, size)
        except Exception:
            if self.ranks is not None:
                self.ranks.close(None)
            raise
        self.rank_group = ProcessRanks(size, rank, algorithm)
        model = tensor_parallel_model(full, size, self.rank_group,
                                      device=f"cuda:{rank}" if config.device == "cuda" else None)
        if rank != 0:
            return model
        alive = self.ranks.alive if self.ranks is not None else lambda: None
        return DrivenModel(model, self.rank_group, alive)

    @property
    def parallel_note(self) -> str:
        """How this engine runs a tensor-parallel model ("" at TP=1): what a verifier's OK line says."""
        size = self.config.tensor_parallel_size
        if size == 1:
            return ""
        if self.config.tensor_parallel_ranks == "emulated":
            return f"TP={size} by rank emulation"
        return f"TP={size}"

    def shutdown(self) -> None:
        """Rank 0: tell the other tensor-parallel ranks to stop, and stop the processes this engine started
        (no-op without tensor parallelism). Idempotent."""
        if self.ranks is not None:
            self.ranks.close(self.rank_group)
            self.ranks = None
        elif self.rank_group is not None and self.rank_group.rank == 0:
            self.rank_group.send(("stop",))
            self.rank_group = None

    @staticmethod
    def _max_model_len(config: EngineConfig, positions: int) -> int:
        """The context: `config.max_model_len` if given, else the model's positions bounded by what the
        configured KV pool holds; never past the model's positions (the facts then record the cap, so a
        receipt that claims more is not comparable, and `serve` refuses such an option before)."""
        return served_context(config.max_model_len, positions, config.num_kv_blocks * config.block_size)

    def reset(self, *, max_prefill_chunk: int | None = None, drop_unfinished: bool = False) -> None:
        """Forget every request and the prefix cache (the KV memory is kept: stale slots are never read).
        `max_prefill_chunk`: tokens of one request's prefill per step from now on (None: the configured one).
        Requests still queued or running are an error, unless `drop_unfinished` (after a refused batch)."""
        self._drain()
        if self.scheduler.has_unfinished() and not drop_unfinished:
            raise RuntimeError("reset() with requests still running")
        self._finished = []
        chunk = self.config.max_prefill_chunk if max_prefill_chunk is None else max_prefill_chunk
        self.scheduler = Scheduler(dataclasses.replace(self._scheduler_config, max_prefill_chunk=chunk),
                                   decode=self.tokenizer.decode)
        if self.runner.graphs is not None:  # the captured graphs stay; their rows hold no request
            self.runner.graphs.forget()

    def load_weights(self, weights: NamedTensors) -> str:
        """Take new weights in place between steps (an RL policy update): (name, tensor) pairs or a state
        dict, named as the checkpoint or as this model's parameters (`weight_sync.load_named_weights`). The
        prefix cache is dropped (its KV came from the old weights) and the facts name the new weights by their
        digest (returned). An empty `weights` re-digests weights a trainer changed in place. Requests still
        running are an error (`reset`)."""
        if not isinstance(self.model, CausalLM):
            raise BadInput("weights are loaded in place into a TP=1 engine only",
                           remedy="build the engine with tensor_parallel_size 1")
        self.reset()
        load_named_weights(self.model, weights)
        self.weights_digest = weights_digest(self.model)
        return self.weights_digest

    # ---- the engine contract (detent_audit.runtime.contract)
    @property
    def max_model_len(self) -> int:
        return self.scheduler.config.max_model_len

    @property
    def model_name(self) -> str:
        return self.config.resolved_model.name

    @property
    def model_positions(self) -> int:
        return self.model.config.max_position_embeddings

    @property
    def block_size(self) -> int:
        return self.config.block_size

    @property
    def vocab_size(self) -> int:
        return self.model.config.vocab_size

    def facts(self) -> Facts:
        """The bit-relevant facts a receipt records (`detent_audit.engine.deployment_facts.collect_facts`)."""
        from detent_audit.engine.deployment_facts import collect_facts

        return collect_facts(self)

    def tuple_values(self) -> TupleValues:
        """What a receipt commits to as the tuple: the mode (`mode.name`) and the per-family pins and knobs
        the kernels read (`Selection.used_tuple`: an axis that changes no kernel's params is not signed)."""
        return {"mode": {"name": self.config.mode}, **self.selection.used_tuple}

    def kernel_params_called(self) -> dict[str, list[dict]] | None:
        """kernel family -> the params the kernels were called with so far (what they report); None where the
        kernels do not report (the GPU KernelSet)."""
        report = getattr(self.selection.kernels, "params_called", None)
        return report() if report is not None else None

    # ---- requests
    def add_request(self, prompt: str | SequenceOf[int], params: SamplingParams,
                    request_id: str | None = None, *, score_from: int | None = None,
                    score_params: SamplingParams | None = None,
                    score_targets: SequenceOf[int] = (), score_prompt: bool = False) -> Sequence:
        """Queue one request. `score_prompt` (echo): also the logprob of every prompt token after the first
        (and `params.logprobs` alternatives), from the same prefill that samples the output; they reach
        `output_of`. `score_from`/`score_targets` are `rescore_batch`'s teacher forcing."""
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        if score_prompt:
            score_from, score_targets = 1, ids[1:]
        elif score_from is not None and len(score_targets) != len(ids) - score_from + 1:
            raise ValueError(f"{len(score_targets)} score targets for a sequence of {len(ids)} tokens scored "
                             f"from {score_from}: the sequence must hold every target but the last")
        score = (None if score_from is None
                 else ScoreSpec(score_from, score_params or params, tuple(score_targets)))
        seq = Sequence(next(self._ids), ids, params, request_id=request_id, score=score)
        self.scheduler.add(seq)
        return seq

    def abort(self, seq: RequestHandle) -> None:
        """Stop serving `seq` between steps (its client left): its blocks are freed, nothing more is computed
        for it, and it never finishes (also when the step queued ahead, recorded first, was its last)."""
        own = self.own(seq)
        self._drain()
        if any(s is own for s in self._finished):
            self._finished = [s for s in self._finished if s is not own]
            own.finish_reason = None
            return
        self.scheduler.abort(own)

    def step(self) -> list[Sequence]:
        """Run one scheduled step; returns the sequences that finished in it. A replayed decode step is
        followed by the next, queued on the device before this one's tokens are recorded (`overlap`); the
        next call records that one."""
        finished, self._finished = self._finished, []
        sampled: Sampled | None
        if self._ahead is not None:
            (out, sampled), self._ahead = self._ahead, None
        else:
            out = self.scheduler.schedule()
            if not out.scheduled:  # nothing runs or waits (or no block is free yet): nothing to record
                self.scheduler.update(out, {})
                return finished
            sampled = self.runner.replay(out)
        self.step_batch_sizes[len(out.scheduled)] += 1
        if sampled is None:
            bm = self.scheduler.block_manager
            results = self.runner.execute(out, lambda e: bm.slot_mapping(e.seq, e.start_pos, e.end_pos))
        else:
            if self.config.overlap:
                ahead = self.scheduler.schedule_ahead(out)
                if ahead is not None:
                    queued = self.runner.replay(ahead)
                    assert queued is not None, "a step ahead of a replayed one replays"
                    self._ahead = (ahead, queued)
            results = sampled.results()
        finished += self._record(out, results)
        if self._ahead is not None and all(e.seq.is_finished for e in self._ahead[0].scheduled):
            self._drain()  # every sequence of the step ahead finished: nothing of it is kept
        return finished

    def _record(self, out: SchedulerOutput, results: dict[int, SeqResult]) -> list[Sequence]:
        """The step's results into its sequences and the scheduler; the sequences it finished."""
        tokens = {sid: r.token for sid, r in results.items()}
        logprobs = {sid: r.logprob for sid, r in results.items() if r.logprob is not None}
        for e in out.scheduled:
            if e.seq.is_finished:  # scheduled ahead, then finished (update drops it too)
                continue
            r = results[e.seq.seq_id]
            if e.seq.score is not None:
                e.seq.record_scores(e.start_pos, r.scored, r.scored_samples, r.scored_tops)
            if r.top is not None:
                e.seq.top_logprobs.append(r.top)
        return self.scheduler.update(out, tokens, logprobs)

    def _drain(self) -> None:
        """Record the step queued ahead, if any (before anything changes the scheduler's state); what it
        finished is returned by the next `step`."""
        if self._ahead is not None:
            (out, sampled), self._ahead = self._ahead, None
            self._finished += self._record(out, sampled.results())

    def top_logprobs_so_far(self, seq: RequestHandle) -> TopLogprobs:
        """The top-n alternatives of each token `seq` has sampled so far (for streaming)."""
        return self.own(seq).top_logprobs

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self._finished)

    # ---- offline API (`generate`: EngineBase's)
    def rescore(self, prompt_ids: SequenceOf[int], output_ids: SequenceOf[int]) -> list[float]:
        """Teacher-forced logprobs of `output_ids` after `prompt_ids`, in one prefill (fp32 values)."""
        return self.rescore_batch([(prompt_ids, output_ids)])[0].logprobs

    def rescore_batch(self, pairs: SequenceOf[tuple[SequenceOf[int], SequenceOf[int]]],
                      params: SequenceOf[SamplingParams] | None = None) -> list[Rescored]:
        """Rescore many (prompt, output) pairs together (batch invariance makes batching legal): each
        output token's logprob, the token the request's sampling (`params`, default greedy) draws there, and
        (with its `logprobs` = n) the top-n alternatives there."""
        seqs = []
        for i, (prompt, output) in enumerate(pairs):
            if not output:
                raise BadInput("rescore needs at least one output token")
            # the last output token is only a target: a response that filled max_model_len rescores within it
            ids = list(prompt) + list(output[:-1])
            seqs.append(self.add_request(ids, SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True),
                                         score_from=len(prompt), score_targets=output,
                                         score_params=None if params is None else params[i]))
        self.run(seqs)
        out = []
        for s, (_, output) in zip(seqs, pairs):
            scores = s.scored
            if scores is None or len(scores.logprobs) != len(output):
                raise RuntimeError(f"rescore produced {len(scores.logprobs) if scores else 0} logprobs for "
                                   f"{len(output)} tokens")
            out.append(scores)
        return out

    def output_of(self, seq: RequestHandle) -> RequestOutput:
        """The user-facing result of a finished sequence. The text is cut before a stop string that ended it
        (stop_strings.py)."""
        seq = self.own(seq)
        text, _ = output_text(self.tokenizer.decode, seq.output_token_ids, seq.sampling_params.stop)
        out = RequestOutput(seq.request_id, list(seq.prompt_token_ids), seq.output_token_ids, text,
                            list(seq.output_logprobs), seq.finish_reason,
                            list(seq.top_logprobs), seq.num_cached_tokens)
        scores = seq.scored
        if scores is not None:  # echo: the prompt's scores
            if len(scores.logprobs) != seq.num_prompt_tokens - 1:
                raise RuntimeError(
                    f"{len(scores.logprobs)} prompt logprobs for a prompt of {seq.num_prompt_tokens}"
                )
            out.prompt_logprobs, out.prompt_top_logprobs = scores.logprobs, scores.tops
        return out


def _follow_as_rank(config: EngineConfig, rank: int, init_method: str) -> None:
    """A follower process: build the same engine as rank `rank` of the group at `init_method`, then run the
    steps rank 0 sends until it says stop."""
    llm = LLM(dataclasses.replace(config, tensor_parallel_rank=rank, tensor_parallel_init=init_method))
    group = llm.rank_group
    if group is None or not isinstance(llm.model, TensorParallelLM):
        raise RuntimeError("a follower rank built no tensor-parallel group")
    follow(llm.model, group, llm.runner.kv_caches, llm.selection.kernels)
